"""Layer 1, pure statistics: the per-sample statistics of ``Z = dW * g``, the estimators of
``||Delta_W f||^2_RMS`` built from them, and the log-space EMA across probes.

Tensor functions only: nothing here knows a model, an optimiser or a process group.
"""

from .estimator import (
    EMA,
    ESTIMATORS,
    Estimator,
    Grouping,
    ReadoutRole,
    fslr_from_log,
    grouped_shape,
    log_sq_norm,
    log_statistics,
    mean_log_stats,
)

__all__ = [
    "EMA",
    "ESTIMATORS",
    "Estimator",
    "Grouping",
    "ReadoutRole",
    "fslr_from_log",
    "grouped_shape",
    "log_sq_norm",
    "log_statistics",
    "mean_log_stats",
]
