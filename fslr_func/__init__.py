"""fslr_func: function-space learning rates and FLeRM for any PyTorch model, via torch.func.

The public surface (see ``docs/api.md``):

* :func:`estimate`: one-probe FSLR estimates of an update, per parameter tensor;
* :func:`exact`: the linearised ground truth ``||J dW||_RMS`` by forward-mode AD;
* :func:`with_fslr`: wrap a module so its optimiser steps report FSLRs (EMA across probes);
* :class:`FSLRRecord`: the FSLR time series of a run, saved atomically as versioned JSON;
* :mod:`policies`: depth-mapping policies deciding which base tensor a scaled tensor matches;
* :class:`Recorder`: records a base run's FSLRs from any training loop into an ``FSLRRecord``;
* :class:`FLeRM`: sets per-tensor learning rates of a scaled model to match a base record;
* :mod:`distributed`: data-parallel probes whose estimates equal the single-process ones.
"""

from . import distributed, policies
from .distributed import DistributedFSLRModule
from .estimator import ESTIMATORS
from .exact import exact
from .flerm import FLeRM, SetPoint
from .options import OMEGAS, ProbeOptions
from .probe import estimate
from .record import FSLRRecord
from .recorder import Recorder
from .transform import FSLRModule, Measurement
from .wrap import with_fslr

__version__ = "0.1.0"

__all__ = [
    "ESTIMATORS",
    "OMEGAS",
    "DistributedFSLRModule",
    "FLeRM",
    "FSLRModule",
    "FSLRRecord",
    "Measurement",
    "ProbeOptions",
    "Recorder",
    "SetPoint",
    "__version__",
    "distributed",
    "estimate",
    "exact",
    "policies",
    "with_fslr",
]
