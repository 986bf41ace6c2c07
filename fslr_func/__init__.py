"""fslr_func: function-space learning rates and FLeRM for any PyTorch model, via torch.func.

The public surface (see ``docs/api.md``), grouped by layer:

* the probe: :func:`estimate` (one-probe FSLR estimates of an update, per parameter tensor),
  :func:`exact` (the linearised ground truth ``||J dW||_RMS`` by forward-mode AD),
  :class:`ProbeOptions`, :data:`ESTIMATORS`, :data:`OMEGAS`;
* training control: :func:`with_fslr` (wrap a module so its optimiser steps report FSLRs),
  :class:`FSLRModule`, :class:`Measurement`, :class:`Recorder` (a base run's FSLRs into a
  record), :class:`FLeRM` and :class:`SetPoint` (per-tensor learning rates matching a base
  record), :mod:`policies` (depth mapping);
* records: :class:`FSLRRecord` (an FSLR time series, saved atomically as versioned JSON);
* distributed: :mod:`distributed`, :class:`DistributedFSLRModule`.

The layers, bottom to top: ``stats`` (pure statistics and estimators), ``probe``, ``parallel``
and ``io``, ``training``, ``integrations``, ``experiments``; each imports only from those below
it (``tests/test_structure.py`` checks it).
"""

from types import ModuleType

from . import _moved, distributed
from .io.record import FSLRRecord
from .probe.exact import exact
from .probe.options import OMEGAS, ProbeOptions
from .probe.sampling import estimate
from .stats.estimator import ESTIMATORS
from .training import policies
from .training.distributed import DistributedFSLRModule
from .training.flerm import FLeRM, SetPoint
from .training.readout_scale import scale_readout
from .training.recorder import Recorder
from .training.wrap import with_fslr
from .training.wrapper import FSLRModule, Measurement

_moved.install()

__version__ = "0.3.0"

__all__ = [  # noqa: RUF022 (grouped by layer, sorted within a group)
    # the probe
    "ESTIMATORS",
    "OMEGAS",
    "ProbeOptions",
    "estimate",
    "exact",
    # training control
    "FLeRM",
    "FSLRModule",
    "Measurement",
    "Recorder",
    "SetPoint",
    "policies",
    "scale_readout",
    "with_fslr",
    # records
    "FSLRRecord",
    # distributed
    "DistributedFSLRModule",
    "distributed",
    "__version__",
]


def __getattr__(name: str) -> ModuleType:
    """Old module paths read as attributes (``ff.recorder``), with their deprecation warning."""
    return _moved.moved_attribute(name)
