"""Layer 1, pure statistics: the per-sample statistics of ``Z = dW * g``, the estimators of
``||Delta_W f||^2_RMS`` built from them, and the log-space EMA across probes.

Tensor functions only: nothing here knows a model, an optimiser or a process group.
"""
