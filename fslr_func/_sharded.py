r"""Statistics of a ``Z`` sharded across ranks: the building block of a lower-memory FSDP2 probe.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) every parameter is a DTensor sharded along
dim 0, so each rank holds a shard of ``Z = dW * g``. The ``D + 2`` statistics of the full ``Z``
(:func:`fslr_func.estimator.log_statistics`) follow from per-shard partial sums and two small
all-reduces (:func:`shard_log_statistics`). Not used by the probe yet, which all-gathers the
parameters and the update instead (:mod:`fslr_func.fsdp`; ``docs/distributed.md`` says what a
probe on shards would save).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .process_group import ProcessGroup, rank_and_size

__all__ = ["partials_to_log_statistics", "shard_log_statistics", "shard_partials"]


def shard_partials(z_shard: Tensor, dim: int, scale: Tensor | float = 1.0) -> Tensor:
    r"""Per-shard partial sums from which the statistics of a sharded ``Z`` are recovered.

    For ``Z`` of rank ``D`` split along ``dim`` into shards (FSDP2 shards dim 0), with
    ``U = Z / scale`` (``scale`` the same on every shard, e.g. the global ``max |Z|``):

    * :math:`q_0 = \sum U^2` is a sum over elements: per-shard values add;
    * :math:`q_d = \sum (\sum_{i_d} U)^2` for ``d != dim``: the inner sum runs inside a shard,
      so per-shard values add;
    * :math:`q_\text{dim}` and :math:`q_\text{full}`: the inner sum crosses shards, so the
      partial sums :math:`\sum_{i_\text{dim}} U` (a tensor of ``numel / n_dim`` elements) are
      summed over shards *before* squaring; :math:`\sum Z` is their sum.

    The result is ``[q_0, q_d for d != dim, (partial sums over dim).flatten()]``: summing it
    over the shards (one all-reduce) and passing it to :func:`partials_to_log_statistics` gives
    :func:`fslr_func.estimator.log_statistics` of the full ``Z``.

    Args:
        z_shard: this shard of ``Z`` (may be empty along ``dim``).
        dim: the sharded dim.
        scale: divides ``Z`` before squaring (the same on every shard).

    Example:
        >>> from fslr_func.estimator import log_statistics
        >>> z = torch.arange(12.0, dtype=torch.float64).reshape(4, 3) - 5
        >>> a, b = z.tensor_split([1], dim=0)  # uneven shards along dim 0
        >>> summed = shard_partials(a, 0) + shard_partials(b, 0)
        >>> torch.allclose(partials_to_log_statistics(summed, 2, 0), log_statistics(z))
        True
    """
    rank = z_shard.dim()
    if rank == 0:
        raise ValueError("a 0-dim tensor cannot be sharded")
    dim = dim % rank
    u = z_shard.to(torch.promote_types(z_shard.dtype, torch.float32)) / scale
    parts = [u.square().sum().reshape(1)]
    parts += [u.sum(d).square().sum().reshape(1) for d in range(rank) if d != dim]
    parts.append(u.sum(dim).reshape(-1))
    return torch.cat(parts)


def partials_to_log_statistics(
    summed: Tensor, ndim: int, dim: int, scale: Tensor | float = 1.0
) -> Tensor:
    """Log statistics of the full ``Z`` from the shard-summed :func:`shard_partials`.

    Args:
        summed: the sum over shards of :func:`shard_partials`.
        ndim: the rank ``D`` of ``Z``.
        dim: the sharded dim.
        scale: the ``scale`` given to :func:`shard_partials`.

    Returns:
        float64 ``[log q_0, log q_{d=0}, ..., log q_{d=D-1}, log q_full]``, as
        :func:`fslr_func.estimator.log_statistics`.
    """
    dim = dim % ndim
    q0, others, sums = summed[0], summed[1:ndim], summed[ndim:]
    rest = iter(others)
    per_dim = [sums.square().sum() if d == dim else next(rest) for d in range(ndim)]
    stats = torch.stack([q0, *per_dim, sums.sum().square()]).to(torch.float64)
    log_scale = torch.as_tensor(scale, dtype=torch.float64).log()
    return stats.log() + 2.0 * log_scale


def shard_log_statistics(z_shard: Tensor, dim: int, group: ProcessGroup = None) -> Tensor:
    """:func:`fslr_func.estimator.log_statistics` of a ``Z`` sharded along ``dim`` over ranks.

    Two collectives: an all-reduce (max) of ``max |Z|`` for a common scale, and one all-reduce
    (sum) of :func:`shard_partials`, of ``D + numel(Z) / Z.shape[dim]`` elements. Every rank
    gets the same result. Shards may be uneven or empty; the other dims must match.

    Args:
        z_shard: this rank's shard of ``Z`` for one omega sample.
        dim: the sharded dim.
        group: the process group.
    """
    rank_and_size(group)
    stat = torch.promote_types(z_shard.dtype, torch.float32)
    if z_shard.numel():
        scale = z_shard.detach().abs().amax().to(stat).reshape(1)
    else:
        scale = torch.zeros(1, dtype=stat, device=z_shard.device)
    dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[0]
    partials = shard_partials(z_shard, dim, safe)
    dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=group)
    return partials_to_log_statistics(partials, z_shard.dim(), dim, safe)
