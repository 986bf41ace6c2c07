"""The wrapper of a data-parallel or FSDP2 model: :class:`DistributedFSLRModule`.

Its probes go through :class:`~fslr_func.parallel.data_parallel.DataParallelReduction`, so
every rank gets the estimates of the global probe batch (the math: :mod:`fslr_func.distributed`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..parallel.data_parallel import (
    DataParallelReduction,
    OmegaDraw,
    data_parallel_layer,
    is_data_parallel,
    unwrap,
)
from ..parallel.fsdp import is_fully_sharded
from ..parallel.process_group import ProcessGroup, broadcast_seed, gathered_names
from ..probe.functional import Inputs, check_inputs
from .wrapper import FSLRModule

__all__ = ["DistributedFSLRModule"]


class DistributedFSLRModule(FSLRModule):
    """:class:`~fslr_func.training.wrapper.FSLRModule` for data-parallel and FSDP2 training.

    Built by :func:`fslr_func.with_fslr` when it is given a ``DistributedDataParallel`` module,
    an FSDP2 (``fully_shard``) module or ``distributed=True``. A DDP (or ``DataParallel``)
    wrapper is unwrapped: ``fm.module`` is the inner model (so names, ``state_dict`` keys and
    FSLR keys are the single-process ones), ``fm.ddp`` is the wrapper, and ``fm(x)`` runs the
    wrapper's forward (gradients stay synchronised). The other order works too:
    ``DDP(with_fslr(model, distributed=True))``. An FSDP2 module is ``fm.module`` itself (its
    parameter names are the unsharded model's) and runs its own forward.

    With ``distributed=True`` every probe goes through the data-parallel reduction
    (:class:`DataParallelReduction` over ``group``); the omega generator is seeded with rank
    0's ``seed`` on every rank, so the estimates equal the single-process ones on the
    concatenated probe batch. Under FSDP2 each probe first all-gathers the parameters and the
    update (:func:`fslr_func.parallel.fsdp.gathered`). With ``distributed=False`` each rank probes
    only its shard (estimates then differ across ranks); an FSDP2 module refuses it.

    Raises:
        ValueError: ``distributed=False`` for an FSDP2 module.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        distributed: bool | None = True,
        group: ProcessGroup = None,
        omega_draw: OmegaDraw = "global",
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        sharded = is_fully_sharded(model)
        if distributed is None:
            distributed = isinstance(data_parallel_layer(model), DistributedDataParallel) or sharded
        if sharded and not distributed:
            raise ValueError(
                "an FSDP2 (fully_shard) model is probed across its ranks: distributed=False "
                "is not supported for it (leave distributed=None)"
            )
        reduction = DataParallelReduction(group, omega_draw) if distributed else None
        if distributed:
            seed = broadcast_seed(seed, group)
        super().__init__(unwrap(model), seed=seed, reduction=reduction, **kwargs)
        # A plain attribute, not a submodule: parameters, state_dict keys and FSLR names stay
        # the inner model's.
        self._wrapper = (model,) if is_data_parallel(model) else ()
        self.distributed = bool(distributed)
        self.group = group
        self.omega_draw = omega_draw

    def _infinite(self, batch: Inputs) -> list[str]:
        """Every rank's inputs with infinite entries: the statistics, all-reduced, are NaN on
        every rank where one rank's Inf reached a gradient, so every rank raises, naming it."""
        found = check_inputs(batch)
        return gathered_names(found, self.group) if self.distributed else found

    @property
    def ddp(self) -> nn.Module | None:
        """The data-parallel wrapper given to :func:`fslr_func.with_fslr`, or ``None``."""
        return self._wrapper[0] if self._wrapper else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The data-parallel wrapper's forward (or the model's if it was not wrapped)."""
        return (self.module if self.ddp is None else self.ddp)(*args, **kwargs)

    def train(self, mode: bool = True) -> DistributedFSLRModule:
        """Set training mode on the module and on the wrapper."""
        super().train(mode)
        if self.ddp is not None:
            self.ddp.train(mode)
        return self
