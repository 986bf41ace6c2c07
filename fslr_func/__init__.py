"""fslr_func: function-space learning rates and FLeRM for any PyTorch model, via torch.func.

The public surface (see ``docs/api.md``):

* :func:`estimate`: one-probe FSLR estimates of an update, per parameter tensor;
* :func:`exact`: the linearised ground truth ``||J dW||_RMS`` by forward-mode AD;
* :func:`with_fslr`: wrap a module so its optimiser steps report FSLRs (EMA across probes);
* :class:`FSLRRecord`: the FSLR time series of a run, saved atomically as versioned JSON;
* :mod:`policies`: depth-mapping policies deciding which base tensor a scaled tensor matches.
"""

from . import policies
from .estimator import ESTIMATORS
from .exact import exact
from .probe import OMEGAS, estimate
from .record import FSLRRecord
from .transform import FSLRModule, Measurement, with_fslr

__version__ = "0.1.0"

__all__ = [
    "ESTIMATORS",
    "OMEGAS",
    "FSLRModule",
    "FSLRRecord",
    "Measurement",
    "__version__",
    "estimate",
    "exact",
    "policies",
    "with_fslr",
]
