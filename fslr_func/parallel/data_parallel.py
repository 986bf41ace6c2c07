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
from the same generator state, exactly as :func:`fslr_func.probe.sampling.probe` does for the
concatenated batch, and keeps its slice ``omega[offset_r : offset_r + M_r]`` (``offset_r`` the
output sizes of the earlier ranks, exchanged with one ``all_gather``). The result then equals,
up to floating-point summation order, the single-process estimate on the concatenated batch
with the same generator seed. ``omega_draw="local"`` draws, from a generator seeded per rank
(independent across ranks), as many entries as the largest shard has, ``max_r M_r``, and uses
the first ``M_r``: the same estimator in distribution and identical on every rank, at about
``1/R`` of the drawing cost for even shards, but not equal draw for draw to the single-process
run. Drawing the same number on every rank gives every rank the same chunks of samples, so the
all-reduces match whatever the shard sizes.

Costs per probe: one ``all_gather`` of three integers, then one ``all_reduce`` per chunk of
``chunk_size`` samples (per dtype) of ``chunk_size x P`` elements, ``P`` the number of probed
parameter elements: the gradient-sized all-reduce DDP performs at every step, once per sample.

A rank that cannot probe its shard (an empty shard, a NaN in a one-shot estimate, a forward
that fails on it) sends a failure in the first all-gather: every rank then raises the same
``ValueError``, naming the failed ranks and their errors, instead of waiting for it.

The probe here is the core probe (:func:`fslr_func.probe.run_probe`, the one sampling loop)
with a :class:`DataParallelReduction` hook: every fix to the core holds here too. A model
sharded with FSDP2 (``fully_shard``) is probed the same way after its parameters and the update
are all-gathered for the probe's duration (:func:`fslr_func.parallel.fsdp.gathered`).

Examples:
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

import contextlib
import hashlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ..probe import sampling
from ..probe.functional import Inputs, check_inputs, nonfinite_fslr_error, nonfinite_names
from ..probe.names import unwrapped
from ..probe.sampling import OmegaSlice, ProbeResult
from ..stats.estimator import ReadoutRole, SampledEstimator, check_estimator
from .fsdp import gathered
from .process_group import (
    ProcessGroup,
    collective_device,
    failure_reasons,
    gathered_names,
    rank_and_size,
)

__all__ = [
    "OMEGA_DRAWS",
    "DataParallelReduction",
    "OmegaDraw",
    "all_reduce_gradients",
    "data_parallel_layer",
    "estimate",
    "is_data_parallel",
    "omega_span",
    "probe",
    "unwrap",
]

OmegaDraw = Literal["global", "local"]
"""How ranks draw omega: all of it from one shared generator, or each rank its own slice."""
OMEGA_DRAWS: tuple[str, ...] = get_args(OmegaDraw)
"""The names :data:`OmegaDraw` allows: ``"global"`` and ``"local"``."""


def data_parallel_layer(model: nn.Module) -> nn.Module | None:
    """The ``DistributedDataParallel``/``DataParallel`` wrapper that ``model`` is, also under
    ``torch.compile`` (``torch.compile(DDP(model))``, as PyTorch's DDP docs compile), or
    ``None``.

    Examples:
        >>> lin = torch.nn.Linear(2, 2)
        >>> data_parallel_layer(lin) is None
        True
        >>> data_parallel_layer(torch.nn.DataParallel(lin)).module is lin
        True
    """
    layer = unwrapped(model, data_parallel=False)[0]
    return layer if isinstance(layer, (DistributedDataParallel, DataParallel)) else None


def is_data_parallel(model: nn.Module) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` or ``DataParallel`` wrapper, also
    under ``torch.compile`` (:func:`data_parallel_layer`).

    Examples:
        >>> is_data_parallel(torch.nn.Linear(2, 2))
        False
    """
    return data_parallel_layer(model) is not None


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside (possibly nested) ``DistributedDataParallel``/``DataParallel`` wrappers
    and the ``torch.compile`` layers around them (a compiled *inner* model stays compiled).

    Probes run on the inner module: the wrapper's forward would prepare gradient
    synchronisation and broadcast buffers, neither of which belongs in a functional probe.

    Examples:
        >>> lin = torch.nn.Linear(2, 2)
        >>> unwrap(torch.nn.DataParallel(lin)) is lin, unwrap(lin) is lin
        (True, True)
    """
    while (layer := data_parallel_layer(model)) is not None:
        model = cast(nn.Module, layer.module)
    return model


def omega_span(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    """``(offset, total)``: where rank ``rank``'s outputs sit in the concatenated output.

    Args:
        sizes: number of output elements of every rank, in rank order.
        rank: this rank.

    Examples:
        >>> omega_span([6, 4, 5], 1)
        (6, 15)
    """
    return int(sum(sizes[:rank])), int(sum(sizes))


_FAILED = -1
"""The output size sent by a rank that cannot probe its shard
(:meth:`DataParallelReduction.abort`)."""


def _first_line(err: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters), for other ranks.

    Examples:
        >>> _first_line(ValueError("the probe batch is empty\\nmore"))
        'ValueError: the probe batch is empty'
    """
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def delta_fingerprint(delta: Mapping[str, Tensor]) -> int:
    """A signed 64-bit digest of ``delta``'s names, shapes and dtypes (in name order): two
    ranks whose updates hold as many elements in other tensors differ here.

    Examples:
        >>> a = {"w": torch.zeros(2, 3), "b": torch.zeros(6)}
        >>> delta_fingerprint(a) == delta_fingerprint(dict(reversed(a.items())))
        True
        >>> delta_fingerprint(a) == delta_fingerprint({"w": torch.zeros(2, 3), "c": torch.zeros(6)})
        False
    """
    layout = repr([(n, tuple(delta[n].shape), str(delta[n].dtype)) for n in sorted(delta)])
    digest = hashlib.blake2b(layout.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _gather_layout(
    num_outputs: int,
    delta: Mapping[str, Tensor],
    samples: int,
    chunk_size: int | None,
    group: ProcessGroup,
    reason: str | None = None,
    readout: Mapping[str, ReadoutRole] | None = None,
) -> tuple[list[int], dict[str, ReadoutRole]]:
    """All ranks' output sizes, and the readout roles every rank gives; checks that all ranks
    probe the same tensors (names, shapes, dtypes), with the same samples and chunk size: any
    of them differing would pair other gradients in the all-reduces, or issue a different
    number of them.

    The readout check (:func:`fslr_func.probe.readout.rows_independent`) runs on each rank's
    shard, and one shard may show the units mixed where another does not; the roles kept are
    those of every rank, so that every rank reduces the same statistics.

    Every rank sees the same gathered table, so on a mismatch, or a rank that could not probe
    (``num_outputs == _FAILED``, its error in ``reason``), every rank raises the same error
    (no hang, no abort): the failed ranks' reasons are gathered so that every rank names them.
    """
    _, world = rank_and_size(group)
    num_params = sum(d.numel() for d in delta.values())
    names = sorted(delta)  # a role as the position of its tensor, + 1 (0: none)
    roles = [
        next((i + 1 for i, n in enumerate(names) if (readout or {}).get(n) == r), 0)
        for r in ("weight", "bias")
    ]
    local = torch.tensor(
        [num_outputs, num_params, samples, chunk_size or 0, delta_fingerprint(delta), *roles],
        dtype=torch.int64,
        device=collective_device(group),
    )
    table = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(table, local, group=group)
    rows = [[int(v) for v in t.tolist()] for t in table]
    failed = [i for i, r in enumerate(rows) if r[0] == _FAILED]
    if failed:
        why = failure_reasons(failed, reason, group)
        raise ValueError(
            f"the probe failed on rank(s) {failed} ({why}): every rank leaves this probe; fix "
            "the failing rank's shard of the probe batch"
        )
    if len({tuple(r[1:5]) for r in rows}) != 1:
        other = next(k for k, r in enumerate(rows) if r[1:5] != rows[0][1:5])
        raise ValueError(
            "ranks disagree on the probe: (probed parameter elements, samples, chunk_size) per "
            f"rank = {[(r[1], r[2], r[3] or None) for r in rows]}"
            + (
                f"; rank {other} probes other tensors than rank 0 (the names, shapes or dtypes "
                "of delta differ: a parameter frozen on one rank only?)"
                if rows[other][4] != rows[0][4]
                else ""
            )
            + "; every rank must pass the same delta, samples and chunk_size"
        )
    agreed = {
        names[rows[0][5 + k] - 1]: role
        for k, role in enumerate(("weight", "bias"))
        if rows[0][5 + k] and all(r[5 + k] == rows[0][5 + k] for r in rows)
    }
    return [r[0] for r in rows], cast(dict[str, ReadoutRole], agreed)


def all_reduce_gradients(
    grads: Mapping[str, Tensor], group: ProcessGroup = None
) -> dict[str, Tensor]:
    """Sum over the ranks of a dict of per-sample gradients, one all-reduce per dtype.

    Args:
        grads: name -> ``(S, *shape)`` gradients (any leading sample count ``S``).
        group: the process group.

    Returns:
        The summed gradients, same names and shapes. Names are laid out sorted, so every rank
        packs its buffer identically whatever the order of its dict.
    """
    names = sorted(grads)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n in names:
        by_dtype.setdefault(grads[n].dtype, []).append(n)
    out: dict[str, Tensor] = {}
    for members in by_dtype.values():
        lead = grads[members[0]].shape[0]
        flat = torch.cat([grads[n].detach().reshape(lead, -1) for n in members], dim=1)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        widths = [grads[n][0].numel() for n in members]
        for n, piece in zip(members, torch.split(flat, widths, dim=1), strict=True):
            out[n] = piece.reshape(grads[n].shape)
    return {n: out[n] for n in grads}


@dataclass(frozen=True)
class DataParallelReduction:
    """The :class:`~fslr_func.probe.sampling.GradientReduction` of a data-parallel probe.

    Rank ``r`` probes its shard of the batch with the slice
    ``omega[offset_r : offset_r + M_r]`` of every global omega (``omega_draw="global"``) or
    the first ``M_r`` of an independent draw of ``max_r M_r`` entries from a generator seeded
    per rank (``"local"``), scaled by the global ``1/sqrt(M)``; the per-sample gradients are
    then summed over ranks.

    Attributes:
        group: the process group; ``None``: the default group.
        omega_draw: ``"global"`` or ``"local"``.

    Raises:
        ValueError: an unknown ``omega_draw``.
    """

    group: ProcessGroup = field(default=None)
    omega_draw: OmegaDraw = "global"

    def __post_init__(self) -> None:
        if self.omega_draw not in OMEGA_DRAWS:
            raise ValueError(
                f"unknown omega_draw {self.omega_draw!r}; choose one of {', '.join(OMEGA_DRAWS)}"
            )

    def omega_slice(
        self,
        num_outputs: int,
        delta: Mapping[str, Tensor],
        samples: int,
        generator: torch.Generator | None,
        chunk_size: int | None = None,
        readout: Mapping[str, ReadoutRole] | None = None,
    ) -> OmegaSlice:
        """Gather every rank's output size and readout roles (checking that ranks agree) and
        place this rank."""
        rank, _ = rank_and_size(self.group)
        sizes, agreed = _gather_layout(
            num_outputs, delta, samples, chunk_size, self.group, readout=readout
        )
        offset, total = omega_span(sizes, rank)
        if self.omega_draw == "global":
            return OmegaSlice(generator, total, offset, total, agreed)
        # One draw from the shared generator (same on every rank), then a generator per rank.
        seed = int(torch.randint(0, 2**62, (), generator=generator).item())
        own = torch.Generator(device=generator.device if generator is not None else "cpu")
        own.manual_seed(seed + rank)
        # Every rank draws as many entries as the largest shard has and uses the first M_r:
        # the probe sizes its chunks of samples by the entries drawn, so every rank runs the
        # same number of all-reduces of the same shapes (uneven shards chunked differently
        # aborted the process group).
        return OmegaSlice(own, max(sizes), 0, total, agreed)

    def reduce(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """One all-reduce (sum) per dtype of the chunk's per-sample gradients."""
        return all_reduce_gradients(grads, self.group)

    def gathered(
        self, model: nn.Module, delta: Mapping[str, Tensor], params: Mapping[str, Tensor] | None
    ) -> contextlib.AbstractContextManager[
        tuple[Mapping[str, Tensor], Mapping[str, Tensor] | None]
    ]:
        """An FSDP2 module's parameters, ``delta`` and ``params`` all-gathered for the probe's
        duration (:func:`fslr_func.parallel.fsdp.gathered`); anything else as given."""
        return gathered(model, delta, params)

    def abort(
        self, delta: Mapping[str, Tensor], samples: int, chunk_size: int | None = None
    ) -> None:
        """Join the other ranks' layout gather as a rank that cannot probe, with the error
        being handled (``sys.exc_info``): every rank, this one included, raises the same
        ``ValueError`` naming the failed ranks and their errors, instead of waiting."""
        err = sys.exc_info()[1]
        reason = "it could not probe its shard" if err is None else _first_line(err)
        _gather_layout(_FAILED, delta, samples, chunk_size, self.group, reason)


def probe(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    group: ProcessGroup = None,
    omega_draw: OmegaDraw = "global",
    **kwargs: Any,
) -> ProbeResult:
    r"""Data-parallel :func:`fslr_func.probe.probe`: the statistics of the global batch.

    The core probe with ``reduction=DataParallelReduction(group, omega_draw)``. Must be called
    on every rank of ``group`` with the same ``delta`` (names and shapes), ``samples`` and
    ``chunk_size``; ``inputs`` is the rank's shard (shards may differ in size, batch-first, so
    that the ranks' flattened outputs in rank order are the global batch's). Rank ``r``
    applies its vjp to :math:`\omega_r / \sqrt{M}`, ``M`` the global number of output
    elements; the per-sample gradients are summed over ranks before ``Z = dW * g`` is reduced
    to statistics, which are therefore identical on every rank.

    Args:
        model: any module, a ``DistributedDataParallel``/``DataParallel`` wrapper (unwrapped),
            or an FSDP2 (``fully_shard``) module, whose parameters, ``delta`` and ``params``
            (DTensor shards) are all-gathered for the probe.
        inputs: this rank's shard of the probe batch.
        delta: parameter name -> unit-learning-rate update.
        group: the process group; ``None``: the default group.
        omega_draw: ``"global"`` (each rank draws the full vector and keeps its slice: equal to
            the single-process probe of the concatenated batch) or ``"local"`` (each rank draws
            its own from a per-rank generator: cheaper, same distribution).
        **kwargs: those of :func:`fslr_func.probe.probe` (``generator``: seed it identically on
            every rank for ``omega_draw="global"``; ``params``; the probe's options, where
            ``chunk_size`` is also the number of samples per all-reduce).

    Returns:
        A :class:`fslr_func.probe.ProbeResult`; ``num_outputs`` is the global ``M``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: invalid options, or ranks that disagree on ``delta`` or ``samples``.
    """
    rank_and_size(group)
    reduction = DataParallelReduction(group, omega_draw)
    return sampling.probe(unwrap(model), inputs, delta, reduction=reduction, **kwargs)


def estimate(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    estimator: SampledEstimator = "kron",
    **kwargs: Any,
) -> dict[str, Tensor]:
    """Data-parallel :func:`fslr_func.estimate`: FSLRs of the global batch, on every rank.

    Call it on every rank with the rank's shard of the probe batch; see :func:`probe` for the
    other arguments. With ``omega_draw="global"`` and the same ``generator`` seed on every rank
    the result equals ``fslr_func.estimate`` on the concatenated batch (float rounding aside).

    Returns:
        Tensor name -> float64 scalar FSLR, identical on every rank.
    """
    check_estimator(estimator, sampled=True)
    fslr = probe(model, inputs, delta, **kwargs).fslr(estimator)
    if bad := nonfinite_names(fslr):  # the same on every rank: every rank names the inputs
        infinite = gathered_names(check_inputs(inputs), kwargs.get("group"))
        raise nonfinite_fslr_error(bad, infinite)
    return fslr
