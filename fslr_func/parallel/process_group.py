"""What every distributed piece shares: the process group's rank and size, the device of
small collectives, and one seed for all ranks.

Examples:
    Outside ``torch.distributed.init_process_group`` every piece says what to do:

    >>> rank_and_size(None)
    Traceback (most recent call last):
    ...
    RuntimeError: torch.distributed is not initialised: call ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ProcessGroup",
    "broadcast_seed",
    "collective_device",
    "failure_reasons",
    "gathered_names",
    "next_seed",
    "raise_if_any_rank_failed",
    "rank_and_size",
]

ProcessGroup = Any
"""A ``torch.distributed.ProcessGroup``, or ``None`` for the default group."""


def rank_and_size(group: ProcessGroup) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "first (torchrun sets up its environment), or use fslr_func.estimate in one process"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: ProcessGroup = None) -> torch.device:
    """Device for small collectives: the current CUDA device under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def next_seed() -> int:
    """The global RNG's next draw of a seed, taken without advancing it: a wrapper built
    without ``seed=`` is reproducible under ``torch.manual_seed``, and the run's own draws
    (dropout masks, a collator's) are those of a run without it.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> next_seed() == next_seed()
        True
    """
    with torch.random.fork_rng(devices=[]):  # the CPU generator, whatever the default device
        return int(torch.randint(0, 2**62, (), device="cpu").item())


def broadcast_seed(seed: int | None, group: ProcessGroup = None) -> int:
    """``seed`` of the group's first rank on every rank (if None, its :func:`next_seed`)."""
    rank_and_size(group)
    if seed is None:
        seed = next_seed()
    t = torch.tensor([seed], dtype=torch.int64, device=collective_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(t.item())


def raise_if_any_rank_failed(reason: str | None, what: str, fix: str, group: ProcessGroup) -> None:
    """Every rank learns whether a rank failed at this point, and all raise the same error.

    A rank that fails alone where the others go on into a collective leaves them waiting until
    the group's timeout. Each rank calls this at the same point instead, with ``reason`` its
    failure (``None``: it did not fail): one ``all_gather`` of a flag, and the reasons
    gathered only on a failure.

    Args:
        reason: why this rank failed, or ``None``.
        what: what failed, for the message ("drawing the probe batches").
        fix: what to do, for the message.
        group: the process group.

    Raises:
        ValueError: on every rank, if any rank failed; it names the failed ranks and reasons.
    """
    _, world = rank_and_size(group)
    flag = torch.tensor([reason is not None], dtype=torch.int64, device=collective_device(group))
    flags = [torch.zeros_like(flag) for _ in range(world)]
    dist.all_gather(flags, flag, group=group)
    failed = [i for i, f in enumerate(flags) if int(f.item())]
    if failed:
        why = failure_reasons(failed, reason, group)
        raise ValueError(f"{what} failed on rank(s) {failed} ({why}): every rank stops here; {fix}")


def gathered_names(names: Sequence[str], group: ProcessGroup) -> list[str]:
    """Every rank's ``names`` as ``"rank i: name"``, on every rank of ``group`` (one
    ``all_gather_object``): what one rank found in its own shard, for an error all raise."""
    per_rank: list[Sequence[str] | None] = [None] * rank_and_size(group)[1]
    dist.all_gather_object(per_rank, list(names), group=group)
    return [f"rank {i}: {n}" for i, got in enumerate(per_rank) for n in got or ()]


def failure_reasons(failed: Sequence[int], reason: str | None, group: ProcessGroup) -> str:
    """``"rank i: reason; ..."`` of the ``failed`` ranks, every rank having passed its own
    ``reason`` (one ``all_gather_object``, on every rank of ``group``)."""
    reasons: list[str | None] = [None] * rank_and_size(group)[1]
    dist.all_gather_object(reasons, reason, group=group)
    return "; ".join(f"rank {i}: {reasons[i]}" for i in failed)
