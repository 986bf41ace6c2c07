r"""Data-parallel FSLRs: every rank probes its shard, and the probe gradients are all-reduced.

With ``R`` ranks, rank ``r`` holding ``M_r`` of the ``M = sum_r M_r`` output elements of the
global batch, the probe of the global batch splits into per-rank sums:

.. math::

    \phi = \frac{1}{\sqrt{M}} \sum_r \omega_r \cdot F_r, \qquad
    g = \frac{\partial \phi}{\partial W}
      = \sum_r \underbrace{J_r^\top \omega_r / \sqrt{M}}_{\text{local vjp of rank } r},

so each rank runs one vjp of its own shard with the cotangent :math:`\omega_r/\sqrt{M}` (``M``
global), and an all-reduce (sum) of the per-sample gradients gives every rank the gradient
``g`` of the global batch. ``Z = dW * g`` and its statistics are then computed identically on
every rank; under ``DistributedDataParallel`` ``dW`` is identical on every rank (gradients are
averaged before the step), so the estimates, the EMAs and FLeRM's rates are too.

With ``omega_draw="global"`` (default) every rank draws the full ``M``-vector of each sample
from the same generator state, exactly as :func:`fslr_func.probe.probe` does for the
concatenated batch, and keeps its slice ``omega[offset_r : offset_r + M_r]`` (``offset_r`` the
output sizes of the earlier ranks, exchanged with one ``all_gather``). The result then equals,
up to floating-point summation order, the single-process estimate on the concatenated batch
with the same generator seed. ``omega_draw="local"`` draws only the ``M_r`` entries of the
rank's slice from a generator seeded per rank (independent across ranks): the same estimator in
distribution and identical on every rank, at ``1/R`` of the drawing cost, but not equal draw
for draw to the single-process run.

Costs per probe: one ``all_gather`` of three integers, then one ``all_reduce`` per chunk of
``chunk_size`` samples (per dtype) of ``chunk_size x P`` elements, ``P`` the number of probed
parameter elements: the gradient-sized all-reduce DDP performs at every step, once per sample.

For sharded parameters (FSDP2) :func:`shard_partials` / :func:`shard_log_statistics` compute the
statistics of a ``Z`` sharded along one dim with one small all-reduce; see
``docs/distributed.md`` for the design of the full sharded probe.

Example:
    Under ``torchrun --nproc-per-node=2 train.py``, with the process group initialised:

    >>> import torch, torch.distributed as dist, fslr_func as ff  # doctest: +SKIP
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
    >>> fm = ff.with_fslr(ddp, samples=8, seed=0)  # doctest: +SKIP
    >>> opt = torch.optim.Adam(fm.parameters(), lr=1e-3)  # doctest: +SKIP
    >>> loss_fn(fm(x_shard), y_shard).backward()  # doctest: +SKIP
    >>> with fm.measure(opt, probe_shard):  # doctest: +SKIP
    ...     opt.step()
    >>> fm.fslr()  # the global batch's FSLRs, identical on every rank  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import vmap
from torch.nn.parallel import DataParallel, DistributedDataParallel

from .estimator import (
    Grouping,
    check_estimator,
    log_statistics,
)
from .functional import (
    Inputs,
    OutputFn,
)
from .probe import ProbeResult, _check_options, draw_omega, prepare_vjp
from .transform import FSLRModule

OmegaDraw = Literal["global", "local"]
OMEGA_DRAWS: tuple[str, ...] = ("global", "local")
Group = Any  # a torch.distributed.ProcessGroup, or None for the default group


def is_data_parallel(model: nn.Module) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` or ``DataParallel`` wrapper.

    Example:
        >>> is_data_parallel(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(model, (DistributedDataParallel, DataParallel))


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside (possibly nested) ``DistributedDataParallel``/``DataParallel`` wrappers.

    Probes run on the inner module: the wrapper's forward would prepare gradient
    synchronisation and broadcast buffers, neither of which belongs in a functional probe.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> unwrap(torch.nn.DataParallel(lin)) is lin, unwrap(lin) is lin
        (True, True)
    """
    while is_data_parallel(model):
        inner = model.module
        assert isinstance(inner, nn.Module)
        model = inner
    return model


def omega_span(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    """``(offset, total)``: where rank ``rank``'s outputs sit in the concatenated output.

    Args:
        sizes: number of output elements of every rank, in rank order.
        rank: this rank.

    Example:
        >>> omega_span([6, 4, 5], 1)
        (6, 15)
    """
    return int(sum(sizes[:rank])), int(sum(sizes))


def _rank_and_size(group: Group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "first (torchrun sets up its environment), or use fslr_func.estimate in one process"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: Group = None) -> torch.device:
    """Device for small collectives: the current CUDA device under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_seed(seed: int | None, group: Group = None) -> int:
    """``seed`` of the group's first rank on every rank (drawn there from torch's RNG if None)."""
    _rank_and_size(group)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    t = torch.tensor([seed], dtype=torch.int64, device=collective_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(t.item())


def _gather_layout(num_outputs: int, num_params: int, samples: int, group: Group) -> list[int]:
    """All ranks' output sizes; checks that all ranks probe the same tensors and samples.

    Every rank sees the same gathered table, so on a mismatch every rank raises (no hang).
    """
    _, world = _rank_and_size(group)
    local = torch.tensor(
        [num_outputs, num_params, samples], dtype=torch.int64, device=collective_device(group)
    )
    table = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(table, local, group=group)
    rows = [[int(v) for v in t.tolist()] for t in table]
    if len({(r[1], r[2]) for r in rows}) != 1:
        raise ValueError(
            "ranks disagree on the probe: (probed parameter elements, samples) per rank = "
            f"{[(r[1], r[2]) for r in rows]}; every rank must pass the same delta and samples"
        )
    return [r[0] for r in rows]


def all_reduce_gradients(grads: Mapping[str, Tensor], group: Group = None) -> dict[str, Tensor]:
    """Sum over the ranks of a dict of per-sample gradients, one all-reduce per dtype.

    Args:
        grads: name -> ``(S, *shape)`` gradients (any leading sample count ``S``).
        group: the process group.

    Returns:
        The summed gradients, same names and shapes. Names are laid out sorted, so every rank
        packs its buffer identically whatever the order of its dict.
    """
    names = sorted(grads)
    groups: dict[torch.dtype, list[str]] = {}
    for n in names:
        groups.setdefault(grads[n].dtype, []).append(n)
    out: dict[str, Tensor] = {}
    for members in groups.values():
        lead = grads[members[0]].shape[0]
        flat = torch.cat([grads[n].reshape(lead, -1) for n in members], dim=1)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        widths = [grads[n][0].numel() for n in members]
        for n, piece in zip(members, flat.split(widths, dim=1), strict=True):
            out[n] = piece.reshape(grads[n].shape)
    return {n: out[n] for n in grads}


def probe(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    group: Group = None,
    params: Mapping[str, Tensor] | None = None,
    samples: int = 8,
    omega: str = "gaussian",
    generator: torch.Generator | None = None,
    output_fn: OutputFn | None = None,
    readout: str | None = "auto",
    chunk_size: int | None = None,
    strategy: str = "auto",
    grouping: Grouping = "auto",
    forward_seed: int | None = None,
    omega_draw: str = "global",
) -> ProbeResult:
    r"""Data-parallel :func:`fslr_func.probe.probe`: the statistics of the global batch.

    Must be called on every rank of ``group`` with the same ``delta`` (names and shapes),
    ``samples`` and ``chunk_size``; ``inputs`` is the rank's shard (shards may differ in size).
    Rank ``r`` applies its vjp to :math:`\omega_r / \sqrt{M}`, ``M`` the global number of
    output elements; the per-sample gradients are summed over ranks (all-reduce) before
    ``Z = dW * g`` is reduced to statistics, which are therefore identical on every rank.

    Args:
        model: any module, or a ``DistributedDataParallel``/``DataParallel`` wrapper (unwrapped).
        inputs: this rank's shard of the probe batch (batch-first, so that concatenating the
            ranks' flattened outputs in rank order gives the global batch's flattened output).
        delta: parameter name -> unit-learning-rate update (the same on every rank under DDP).
        group: the process group; ``None``: the default group.
        params: values to evaluate the gradient at; defaults to the module's parameters.
        samples: number ``S`` of omega samples.
        omega: ``"gaussian"`` or ``"rademacher"``.
        generator: draws omega; seed it identically on every rank for ``omega_draw="global"``.
        output_fn: maps the model output to the tensor whose movement is measured.
        readout: ``"auto"``, a module name, or ``None``.
        chunk_size: samples per vjp batch and per all-reduce; ``None``: all at once. Peak
            memory holds ``chunk_size`` gradients (and their all-reduce buffer).
        strategy: ``"auto"``, ``"vmap"``, ``"loop"`` or ``"autograd"`` (how the local vjps run).
        grouping: Kronecker factors of each tensor (:func:`fslr_func.estimator.grouped_shape`).
        forward_seed: seeds the forward's own RNG (dropout masks), as in the single process.
        omega_draw: ``"global"`` (each rank draws the full vector and keeps its slice: equal to
            the single-process probe of the concatenated batch) or ``"local"`` (each rank draws
            only its slice from a per-rank generator: cheaper, same distribution).

    Returns:
        A :class:`fslr_func.probe.ProbeResult`; ``num_outputs`` is the global ``M``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: invalid options, or ranks that disagree on ``delta`` or ``samples``.
    """
    _check_options(samples, omega, chunk_size, strategy)
    if omega_draw not in OMEGA_DRAWS:
        raise ValueError(f"unknown omega_draw {omega_draw!r}; choose one of {OMEGA_DRAWS}")
    rank, _ = _rank_and_size(group)
    setup = prepare_vjp(
        unwrap(model),
        inputs,
        delta,
        params=params,
        output_fn=output_fn,
        readout=readout,
        strategy=strategy,
        grouping=grouping,
        forward_seed=forward_seed,
    )
    out = setup.output
    local = out.numel()
    num_params = sum(d.numel() for d in delta.values())
    offset, total = omega_span(_gather_layout(local, num_params, samples, group), rank)
    if total == 0:
        raise ValueError("the model output is empty on every rank: nothing to probe")
    scale = 1.0 / math.sqrt(total)

    own: torch.Generator | None = None
    if omega_draw == "local":
        # One draw from the shared generator (same on every rank), then a generator per rank.
        seed = int(torch.randint(0, 2**62, (), generator=generator).item())
        own = torch.Generator(device=generator.device if generator is not None else "cpu")
        own.manual_seed(seed + rank)

    home = generator.device if generator is not None else out.device

    def draw(count: int) -> Tensor:
        if own is not None:
            ws = [draw_omega(local, omega, own, out.device, out.dtype) for _ in range(count)]
        else:  # draw where the generator lives, and move only this rank's slice
            ws = [
                draw_omega(total, omega, generator, home, out.dtype)[offset : offset + local]
                for _ in range(count)
            ]
        return torch.stack(ws).to(out.device)

    def sample_grads(w: Tensor) -> dict[str, Tensor]:
        return setup.vjp_fn(w * scale)[0]

    def sample_stats(grads: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: log_statistics((grads[n] * d).reshape(setup.views[n])) for n, d in delta.items()}

    chunk = samples if chunk_size is None else min(chunk_size, samples)
    rows: list[dict[str, Tensor]] = []
    for start in range(0, samples, chunk):
        grads = setup.map_samples(sample_grads, draw(min(chunk, samples - start)))
        grads = all_reduce_gradients({n: grads[n].detach() for n in delta}, group)
        rows.append(vmap(sample_stats)(grads))
    log_stats = {n: torch.cat([r[n] for r in rows]) for n in delta}
    return ProbeResult(log_stats, setup.readout, setup.readout_module, total, setup.strategy)


def estimate(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    group: Group = None,
    samples: int = 8,
    estimator: str = "kron",
    omega: str = "gaussian",
    generator: torch.Generator | None = None,
    output_fn: OutputFn | None = None,
    readout: str | None = "auto",
    chunk_size: int | None = None,
    strategy: str = "auto",
    params: Mapping[str, Tensor] | None = None,
    grouping: Grouping = "auto",
    forward_seed: int | None = None,
    omega_draw: str = "global",
) -> dict[str, Tensor]:
    """Data-parallel :func:`fslr_func.estimate`: FSLRs of the global batch, on every rank.

    Call it on every rank with the rank's shard of the probe batch; see :func:`probe` for the
    arguments. With ``omega_draw="global"`` and the same ``generator`` seed on every rank the
    result equals ``fslr_func.estimate`` on the concatenated batch (float rounding aside).

    Returns:
        Tensor name -> float64 scalar FSLR, identical on every rank.
    """
    check_estimator(estimator)
    result = probe(
        model,
        inputs,
        delta,
        group=group,
        params=params,
        samples=samples,
        omega=omega,
        generator=generator,
        output_fn=output_fn,
        readout=readout,
        chunk_size=chunk_size,
        strategy=strategy,
        grouping=grouping,
        forward_seed=forward_seed,
        omega_draw=omega_draw,
    )
    return result.fslr(estimator)


class DistributedFSLRModule(FSLRModule):
    """:class:`~fslr_func.transform.FSLRModule` for data-parallel training.

    Built by :func:`fslr_func.with_fslr` when it is given a ``DistributedDataParallel`` module
    or ``distributed=True``. A DDP (or ``DataParallel``) wrapper is unwrapped: ``fm.module`` is
    the inner model (so names, ``state_dict`` keys and FSLR keys are the single-process ones),
    ``fm.ddp`` is the wrapper, and ``fm(x)`` runs the wrapper's forward (gradients stay
    synchronised). The other order works too: ``DDP(with_fslr(model, distributed=True))``.

    With ``distributed=True`` every probe goes through :func:`probe` over ``group``; the omega
    generator is seeded with rank 0's ``seed`` on every rank, so the estimates equal the
    single-process ones on the concatenated probe batch. With ``distributed=False`` each rank
    probes only its shard (estimates then differ across ranks).
    """

    ddp: nn.Module | None

    def __init__(
        self,
        model: nn.Module,
        *,
        distributed: bool | None = True,
        group: Group = None,
        omega_draw: str = "global",
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        if distributed is None:
            distributed = isinstance(model, DistributedDataParallel)
        if omega_draw not in OMEGA_DRAWS:
            raise ValueError(f"unknown omega_draw {omega_draw!r}; choose one of {OMEGA_DRAWS}")
        if distributed:
            seed = broadcast_seed(seed, group)
        super().__init__(unwrap(model), seed=seed, **kwargs)
        # Not a submodule: parameters, state_dict keys and FSLR names stay the inner model's.
        object.__setattr__(self, "ddp", model if is_data_parallel(model) else None)
        self.distributed = bool(distributed)
        self.group = group
        self.omega_draw = omega_draw

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The data-parallel wrapper's forward (or the model's if it was not wrapped)."""
        return (self.module if self.ddp is None else self.ddp)(*args, **kwargs)

    def train(self, mode: bool = True) -> DistributedFSLRModule:
        """Set training mode on the module and on the wrapper."""
        super().train(mode)
        if self.ddp is not None:
            self.ddp.train(mode)
        return self

    def _probe(
        self, inputs: Inputs, delta: Mapping[str, Tensor], params: Mapping[str, Tensor] | None
    ) -> ProbeResult:
        if not self.distributed:
            return super()._probe(inputs, delta, params)
        return probe(
            self.module,
            inputs,
            delta,
            group=self.group,
            params=params,
            omega_draw=self.omega_draw,
            **self._probe_options(),
        )


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


def shard_log_statistics(z_shard: Tensor, dim: int, group: Group = None) -> Tensor:
    """:func:`fslr_func.estimator.log_statistics` of a ``Z`` sharded along ``dim`` over ranks.

    Two collectives: an all-reduce (max) of ``max |Z|`` for a common scale, and one all-reduce
    (sum) of :func:`shard_partials`, of ``D + numel(Z) / Z.shape[dim]`` elements. Every rank
    gets the same result. Shards may be uneven or empty; the other dims must match.

    Args:
        z_shard: this rank's shard of ``Z`` for one omega sample.
        dim: the sharded dim.
        group: the process group.
    """
    _rank_and_size(group)
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
