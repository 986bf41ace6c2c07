"""``with_fslr``: the one entry point that wraps a model, in one process, data-parallel or FSDP2.

It picks the wrapper: :class:`~fslr_func.training.wrapper.FSLRModule` for a plain module,
:class:`~fslr_func.distributed.DistributedFSLRModule` for a data-parallel one, an FSDP2
(``fully_shard``) one, or when asked for a distributed probe. Either way the probe options
are validated here, before anything else.

Examples:
    >>> import torch, fslr_func as ff
    >>> fm = ff.with_fslr(torch.nn.Linear(4, 2), samples=4, seed=0)
    >>> type(fm).__name__, fm.samples
    ('FSLRModule', 4)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..parallel.data_parallel import is_data_parallel
from ..parallel.fsdp import is_fully_sharded
from ..parallel.process_group import ProcessGroup
from ..probe.functional import check_module
from ..stats.estimator import Estimator, check_estimator
from .distributed import DistributedFSLRModule
from .wrapper import FSLRModule

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..probe.options import ProbeKwargs

__all__ = ["with_fslr"]


def with_fslr(
    model: nn.Module,
    *,
    estimator: Estimator = "kron",
    beta: float = 0.9,
    seed: int | None = None,
    distributed: bool | None = None,
    group: ProcessGroup = None,
    **options: Unpack[ProbeKwargs],
) -> FSLRModule:
    """Wrap ``model`` so that its optimiser steps can report function-space learning rates.

    Args:
        model: any ``nn.Module``, a ``DistributedDataParallel`` one (also compiled:
            ``torch.compile(DDP(model))``), or one sharded with
            FSDP2's ``fully_shard`` (DTensor parameters; docs/distributed.md).
        estimator: ``"kron"`` (default), ``"full"`` or ``"iid"``; or ``"exact"``, each probe
            batch's ``||J dW||_RMS`` by forward-mode AD (one process only;
            :class:`~fslr_func.training.wrapper.FSLRModule`).
        beta: EMA decay across probes (bias-corrected).
        seed: seeds the omega generator; ``None`` takes it from torch's global RNG (rank 0's
            when distributed) without advancing it: the run's own draws are as without it.
        distributed: all-reduce the probe over the ranks of ``group`` so every rank gets the
            estimates of the global batch (:mod:`fslr_func.distributed`); ``None``: exactly
            when ``model`` is a ``DistributedDataParallel`` module (always unwrapped) or has
            FSDP2-sharded parameters (always distributed).
        group: the process group of a distributed probe; ``None``: the default group.
        **options: the probe's options (:class:`~fslr_func.probe.options.ProbeOptions`):
            ``samples=8`` (omega samples per probe batch), ``omega="gaussian"``,
            ``output_fn`` (``lambda o: o.logits``), ``readout="auto"`` (a module name, or
            ``None`` to switch the readout variants off), ``chunk_size`` (bounds the probe's
            peak memory), ``strategy="auto"``, ``grouping="auto"`` (conv weights as
            ``out x rest``; ``"dims"``, ``"matrix"`` or a callable), ``forward_seed``.

    Returns:
        An :class:`~fslr_func.training.wrapper.FSLRModule`; ``fm(x) == model(x)``.

    Raises:
        ValueError: an invalid option (at once, before any probe), a model without
            trainable parameters, or ``distributed=False`` for an FSDP2 model.
    """
    check_module(model)
    check_estimator(estimator, distributed=bool(distributed) or is_fully_sharded(model))
    if distributed or is_data_parallel(model) or is_fully_sharded(model):
        return DistributedFSLRModule(
            model,
            distributed=distributed,
            group=group,
            seed=seed,
            estimator=estimator,
            beta=beta,
            **options,
        )
    return FSLRModule(model, estimator=estimator, beta=beta, seed=seed, **options)
