"""Data-parallel and FSDP2 FSLRs: the public face of :mod:`fslr_func.parallel`.

:func:`probe` and :func:`estimate` are the core probe (:func:`fslr_func.probe.run_probe`)
with a :class:`DataParallelReduction`: every rank probes its shard of the probe batch and the
per-sample probe gradients are all-reduced, so every rank gets the estimates of the global
batch (the math: :mod:`fslr_func.parallel.data_parallel`). :func:`fslr_func.with_fslr` gives a
:class:`DistributedFSLRModule` for a ``DistributedDataParallel`` or FSDP2 model. Guide:
docs/distributed.md.
"""

from .parallel import data_parallel
from .parallel.data_parallel import (  # noqa: F401 (re-exported through __all__ below)
    OMEGA_DRAWS,
    DataParallelReduction,
    OmegaDraw,
    all_reduce_gradients,
    data_parallel_layer,
    estimate,
    is_data_parallel,
    omega_span,
    probe,
    unwrap,
)
from .parallel.process_group import broadcast_seed, collective_device
from .training.distributed import DistributedFSLRModule

__all__ = [
    *data_parallel.__all__,
    "DistributedFSLRModule",
    "broadcast_seed",
    "collective_device",
]
