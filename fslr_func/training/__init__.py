"""Layer 4, training control: the wrapper that measures an optimiser step (``with_fslr``),
the Recorder of a base run, FLeRM (a pure rule and the thin adapter that applies it to any
optimiser by scaling updates) and the depth-mapping policies.
"""

from . import policies
from .distributed import DistributedFSLRModule
from .flerm import FLeRM, SetPoint
from .recorder import Recorder
from .wrap import with_fslr
from .wrapper import FSLRModule, Measurement

__all__ = [
    "DistributedFSLRModule",
    "FLeRM",
    "FSLRModule",
    "Measurement",
    "Recorder",
    "SetPoint",
    "policies",
    "with_fslr",
]
