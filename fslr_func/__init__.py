"""fslr_func: function-space learning rates and FLeRM for any PyTorch model, via torch.func.

The public surface (see ``docs/api.md``):

* :func:`estimate`: one-probe FSLR estimates of an update, per parameter tensor;
* :func:`exact`: the linearised ground truth ``||J dW||_RMS`` by forward-mode AD;
* :func:`with_fslr`: wrap a module so its optimiser steps report FSLRs (EMA across probes).
"""

from .estimator import ESTIMATORS
from .exact import exact
from .probe import OMEGAS, estimate
from .transform import FSLRModule, Measurement, with_fslr

__version__ = "0.1.0"

__all__ = [
    "ESTIMATORS",
    "OMEGAS",
    "FSLRModule",
    "Measurement",
    "__version__",
    "estimate",
    "exact",
    "with_fslr",
]
