r"""The FSLR estimators built from the statistics of ``Z`` (pure tensor functions).

For one parameter tensor ``W`` of rank ``D`` with unit-learning-rate update ``dW`` and probe
gradient ``g = d phi / d W``, the probe produces ``Z = dW * g``. Everything the estimators need
is the ``D + 2`` scalars per sample of :mod:`fslr_func.stats.statistics`:

.. math::

    q_0 = \sum Z^2, \qquad q_d = \sum (\textstyle\sum_{i_d} Z)^2 \ (d = 0..D-1),
    \qquad q_\text{full} = (\sum Z)^2 .

They are stored as **log** values (``log_stats``, float64, ``-inf`` for an exact zero) in the
order ``[q_0, q_{d=0}, ..., q_{d=D-1}, q_full]`` so that updates of any magnitude (``1e-30``
or ``1e30`` in float32) neither underflow nor overflow. Expectations ``E`` are means over the
samples of a probe (:func:`mean_log_stats`) and an exponential moving average across probes
(:class:`EMA`). The estimators of :math:`\|\Delta_W f\|^2_\mathrm{RMS}` are

* ``kron`` (tensor-normal, the paper's default): :math:`\prod_d E[q_d] / E[q_0]^{D-1}`;
* ``full`` (no assumption, unbiased): :math:`E[q_\text{full}]`;
* ``iid`` (ablation, biased): :math:`E[q_0]`;
* readout weight (rows independent): :math:`E[q_{d=1}]`; readout bias: :math:`E[q_0]`.

The FSLR is the square root of the estimate. A fourth name, ``exact``, draws no omega: the
wrapper (:func:`fslr_func.with_fslr`) then measures :math:`\|J\,dW\|^2_\mathrm{RMS}` itself
by forward-mode AD (:func:`fslr_func.exact`, one ``jvp`` per tensor and probe batch) and keeps
its log as the one statistic of a tensor, which :func:`log_sq_norm` returns as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from .checks import real

SampledEstimator = Literal["kron", "full", "iid"]
"""The estimators computed from a probe's omega samples: ``kron`` (tensor-normal), ``full``,
``iid``."""
Estimator = Literal[SampledEstimator, "exact"]
"""The estimators of ``||Delta_W f||^2_RMS``: the sampled ones and ``exact`` (forward-mode AD,
no sampling; the wrapper's option)."""
ReadoutRole = Literal["weight", "bias"]
"""A readout tensor's role, which picks its row-independent estimator variant."""
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
"""The names :data:`Estimator` allows, for validation and messages."""
SAMPLED_ESTIMATORS: tuple[str, ...] = get_args(SampledEstimator)
"""The names :data:`SampledEstimator` allows (all but ``exact``)."""
Grouping = str | Callable[[str, tuple[int, ...]], Sequence[int] | None]
"""How a tensor of rank 3 or more is viewed for ``kron``: ``"auto"``, ``"dims"``, ``"matrix"``
or ``callable(name, shape) -> grouped shape`` (``None``: the tensor's own shape)."""
GROUPINGS: tuple[str, ...] = ("auto", "dims", "matrix")


def check_estimator(name: str, *, sampled: bool = False, distributed: bool = False) -> None:
    """Raise a ``ValueError`` naming the valid estimators if ``name`` is not one of them
    (``sampled``: one of those computed from a probe's samples, :data:`SAMPLED_ESTIMATORS`;
    ``distributed``: one a data-parallel probe can reduce over processes, a sampled one).

    Examples:
        >>> check_estimator("exact")
        >>> check_estimator("exact", distributed=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: estimator='exact' measures each process's own probe batch, ...
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown estimator {name!r}; choose one of {', '.join(ESTIMATORS)}")
    if sampled and name not in SAMPLED_ESTIMATORS:
        raise ValueError(
            f"estimator {name!r} is not computed from a probe's omega samples: choose one of "
            f"{', '.join(SAMPLED_ESTIMATORS)}, or compute exact FSLRs with fslr_func.exact"
        )
    if distributed and name not in SAMPLED_ESTIMATORS:
        raise ValueError(
            "estimator='exact' measures each process's own probe batch, and a data-parallel "
            "probe (distributed=True, a DDP or FSDP2 model) reduces sampled statistics over "
            "processes: use 'kron' (or 'full', unbiased) there; for exact values per process, "
            "wrap with distributed=False and give every rank the same probe batches"
        )


def check_grouping(grouping: Grouping) -> None:
    """Raise a ``ValueError`` naming the valid groupings if ``grouping`` is not one of them."""
    if callable(grouping):
        return
    if grouping not in GROUPINGS:
        raise ValueError(
            f"unknown grouping {grouping!r}; choose one of {', '.join(GROUPINGS)} or pass a "
            f"callable (name, shape) -> view shape"
        )


def grouped_shape(name: str, shape: Sequence[int], grouping: Grouping = "auto") -> tuple[int, ...]:
    """The shape a tensor's ``Z`` is viewed as before its statistics (the Kronecker factors).

    ``kron`` assumes one covariance factor per dim of this view. ``"dims"`` keeps every dim
    (the paper's tensor-normal factorisation); ``"matrix"`` views a tensor of rank 3 or more
    as ``(shape[0], prod(shape[1:]))``, output channels by everything else (a conv weight as
    ``out x (in * kh * kw)``, as in KFC); ``"auto"`` is ``"matrix"``, the grouping measured
    closest to ``exact`` on conv layers (``docs/grouping.md``). Tensors of rank 0 to 2 are
    the same under every built-in grouping. A callable gets the parameter name and shape and
    returns a view shape with the same number of elements (``-1`` allowed), or ``None`` to
    keep the tensor's own shape.

    Examples:
        >>> grouped_shape("conv.weight", (8, 3, 5, 5), "matrix")
        (8, 75)
        >>> grouped_shape("conv.weight", (8, 3, 5, 5), "dims")
        (8, 3, 5, 5)
        >>> by_kernel = lambda name, s: (s[0], s[1], -1) if len(s) == 4 else None
        >>> grouped_shape("conv.weight", (8, 3, 5, 5), by_kernel)
        (8, 3, 25)
        >>> grouped_shape("conv.bias", (8,), by_kernel)
        (8,)
    """
    check_grouping(grouping)
    shape = tuple(int(s) for s in shape)
    if callable(grouping):
        try:
            view = grouping(name, shape)
            if view is None:
                return shape
            return tuple(torch.empty(shape, device="meta").view(*view).shape)
        except (RuntimeError, TypeError, ValueError) as err:
            raise ValueError(
                f"grouping({name!r}, {shape}) did not return a view shape of a tensor of shape "
                f"{shape}: {err}"
            ) from err
    if grouping in ("auto", "matrix") and len(shape) >= 3:
        return (shape[0], math.prod(shape[1:]))
    return shape


def mean_log_stats(log_stats: Tensor) -> Tensor:
    """Log of the mean over samples (dim 0) of statistics given in log space.

    Examples:
        >>> ls = torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64)
        >>> mean_log_stats(ls).exp()
        tensor([2.], dtype=torch.float64)
    """
    return torch.logsumexp(log_stats, dim=0) - math.log(log_stats.shape[0])


def log_sq_norm(
    log_e: Tensor, estimator: Estimator = "kron", readout: ReadoutRole | None = None
) -> Tensor:
    r"""Log of the estimated :math:`\|\Delta_W f\|^2_\mathrm{RMS}` from expected statistics.

    Args:
        log_e: log expectations ``[log E q_0, log E q_{d}..., log E q_full]`` of one tensor
            (with ``"exact"``: ``[log ||J dW||^2_RMS]``).
        estimator: ``"kron"``, ``"full"``, ``"iid"`` or ``"exact"``.
        readout: ``"weight"`` or ``"bias"`` if the tensor is the readout layer's (the
            row-independent variants apply to ``kron``; ``full`` and ``iid`` are unchanged).

    Returns:
        A float64 scalar; ``-inf`` when the estimate is exactly zero.

    Examples:
        >>> q = [30.0, 52.0, 58.0, 100.0]  # the statistics of Z = [[1, 2], [3, 4]]
        >>> ls = torch.tensor(q, dtype=torch.float64).log()
        >>> round(float(log_sq_norm(ls, "kron").exp()), 4)  # 52 * 58 / 30
        100.5333
        >>> round(float(log_sq_norm(ls, "kron", readout="weight").exp()), 4)  # 3^2 + 7^2
        58.0
    """
    check_estimator(estimator)
    if estimator in ("full", "exact"):
        return log_e[-1]
    rank = log_e.shape[0] - 2
    log_q0 = log_e[0]
    if estimator == "iid" or rank == 0:
        return log_q0
    if readout == "bias":
        return log_q0
    if readout == "weight" and rank >= 2:
        return log_e[2]
    if rank == 1:
        return log_e[1]
    kron = log_e[1 : 1 + rank].sum() - (rank - 1) * log_q0
    # Z == 0 in every sample: the update does not move the function (-inf, not -inf + inf).
    return torch.where(torch.isneginf(log_q0), log_q0, kron)


def fslr_from_log(log_sq: Tensor) -> Tensor:
    """FSLR (RMS norm) from the log of its square, as float64."""
    return (0.5 * log_sq).exp()


def valid_log(log_x: Tensor) -> Tensor:
    """Whether log statistics are usable: no NaN and no ``+inf`` along the last dim.

    ``-inf`` is a statistic of exactly zero (an update that does not move the function) and is
    valid. The result has the leading shape of ``log_x`` and stays on its device (no sync).

    Examples:
        >>> valid_log(torch.tensor([[0.0, -math.inf], [math.nan, 0.0], [math.inf, 1.0]]))
        tensor([ True, False, False])
    """
    return ~(torch.isnan(log_x) | torch.isposinf(log_x)).any(-1)


def mean_valid_log_stats(log_stats: Tensor) -> Tensor:
    """:func:`mean_log_stats` over the samples (rows) whose statistics are finite.

    A sample whose gradient overflowed, or whose probe batch or update held a NaN, is left
    out instead of poisoning the mean; with no valid row the result is NaN, which
    :meth:`EMA.update` then leaves out. Everything stays on the device (no sync).

    Examples:
        >>> ls = torch.tensor([[0.0], [math.log(3.0)], [math.nan]], dtype=torch.float64)
        >>> mean_valid_log_stats(ls).exp()
        tensor([2.], dtype=torch.float64)
    """
    valid = valid_log(log_stats)
    kept = torch.where(valid.unsqueeze(-1), log_stats, -math.inf)
    return torch.logsumexp(kept, dim=0) - valid.sum().to(log_stats.dtype).log()


def _owners(sizes: Sequence[int], device: torch.device) -> Tensor:
    """Per entry of the concatenation of segments of ``sizes``, its segment's index (int64,
    on ``device``, built there: a tensor made from a host list would synchronise a GPU)."""
    return torch.cat(
        [torch.full((s,), i, dtype=torch.int64, device=device) for i, s in enumerate(sizes)]
    )


def _batchable(tensors: Sequence[Tensor], dim: int) -> bool:
    """Whether per-tensor log statistics can go through one concatenated tensor: float64,
    of rank ``dim``, on one device, with the same leading shape."""
    first = tensors[0]
    return all(
        t.dtype == torch.float64
        and t.dim() == dim
        and t.device == first.device
        and t.shape[:-1] == first.shape[:-1]
        and t.shape[-1] > 0
        for t in tensors
    )


def mean_valid_log_stats_all(log_stats: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """:func:`mean_valid_log_stats` of every tensor of a probe at once, bit for bit.

    The statistics of all tensors are concatenated along their last dim and reduced in a
    handful of operations (a sample is valid per tensor, as in the one-tensor function),
    instead of about seven small operations per tensor, but for the mean itself.
    Falls back to the one-tensor function for statistics not all float64 ``(S, D + 2)`` on
    one device.

    Examples:
        >>> ls = {"a": torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64),
        ...       "b": torch.tensor([[0.0, 1.0], [math.nan, 0.0]], dtype=torch.float64)}
        >>> {n: v.exp() for n, v in mean_valid_log_stats_all(ls).items()}
        {'a': tensor([2.], dtype=torch.float64), 'b': tensor([1.0000, 2.7183], dtype=torch.float64)}
    """
    names = list(log_stats)
    tensors = [log_stats[n] for n in names]
    if not tensors or not _batchable(tensors, 2):
        return {n: mean_valid_log_stats(t) for n, t in zip(names, tensors, strict=True)}
    sizes = [t.shape[1] for t in tensors]
    flat = torch.cat(tensors, dim=1)
    owner = _owners(sizes, flat.device)
    invalid = torch.isnan(flat) | torch.isposinf(flat)
    # samples with a NaN or +inf among a tensor's statistics, per (sample, tensor)
    bad = torch.zeros((flat.shape[0], len(sizes)), dtype=torch.int64, device=flat.device)
    valid = bad.index_add_(1, owner, invalid.to(torch.int64)).eq(0)
    kept = torch.where(valid.index_select(1, owner), flat, -math.inf)
    counts = valid.sum(0).to(flat.dtype).log_().unbind(0)
    # logsumexp tensor by tensor: on the concatenation its vectorised exp and sum would
    # split the columns differently and round some results otherwise (by 1 ulp)
    return {
        n: torch.logsumexp(k.contiguous(), dim=0).sub_(c)
        for n, k, c in zip(names, torch.split(kept, sizes, dim=1), counts, strict=True)
    }


@dataclass
class EMA:
    r"""Bias-corrected exponential moving average of log-space statistics, per tensor.

    With decay :math:`\beta`, :math:`m_t = \beta m_{t-1} + (1-\beta) x_t`, :math:`m_0 = 0`,
    and the estimate :math:`m_t / (1 - \beta^t)`; all of it in log space (``logaddexp``), so a
    constant stream returns that constant from the first update on.

    The state lives on the device of the statistics and an update never synchronises with
    the host: an update holding a NaN or ``+inf`` (:func:`valid_log`) is not folded in (the
    average and its count ``t`` keep their values) and is counted in :attr:`dropped`, with
    its ``step`` label in :attr:`last_dropped`. A tensor with ``t = 0`` reads NaN from
    :meth:`value`: nothing valid was measured yet.

    Examples:
        >>> ema = EMA(beta=0.9)
        >>> for _ in range(3):
        ...     ema.update({"w": torch.tensor([0.0, 1.0], dtype=torch.float64)})
        >>> ema.update({"w": torch.tensor([math.nan, 1.0], dtype=torch.float64)}, step=3)
        >>> ema.value()["w"], int(ema.counts["w"]), int(ema.dropped["w"])
        (tensor([0., 1.], dtype=torch.float64), 3, 1)
    """

    beta: float = 0.9
    log_m: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, Tensor] = field(default_factory=dict)
    dropped: dict[str, Tensor] = field(default_factory=dict)
    last_dropped: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a plain float (np.float64 too): the EMA's beta goes into states and records
        self.beta = real(self.beta, "beta", low=0.0, below=1.0, what="in [0, 1), a number")

    def update(
        self,
        log_x: Mapping[str, Tensor],
        *,
        step: int = -1,
        include: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Fold one probe's log expectations (one entry per tensor) into the averages.

        Args:
            log_x: tensor name -> log expectations; an entry holding a NaN or ``+inf`` is
                dropped (see the class docstring).
            step: a label kept in :attr:`last_dropped` when an entry is dropped.
            include: tensor name -> 0-d bool; an entry marked ``False`` is skipped: neither
                folded in nor counted as dropped (a tensor the step did not change).
        """
        log_beta = math.log(self.beta) if self.beta > 0 else -math.inf
        log_1mb = math.log1p(-self.beta)
        xs = {name: x.detach().to(torch.float64) for name, x in log_x.items()}
        for name, x in xs.items():
            previous = self.log_m.get(name)
            if previous is None or previous.shape != x.shape:
                self.log_m[name] = torch.full_like(x, -math.inf)
                zero = torch.zeros((), dtype=torch.int64, device=x.device)
                self.counts[name], self.dropped[name] = zero, zero
                self.last_dropped[name] = zero - 1
        if len(xs) > 1 and _batchable(list(xs.values()), 1):
            self._update_all(xs, log_beta, log_1mb, step, include)
            return
        for name, x in xs.items():
            previous = self.log_m[name].to(x.device)
            ok = valid_log(x)
            wanted = None if include is None else include.get(name)
            take = ok if wanted is None else ok & wanted
            bad = ~ok if wanted is None else ~ok & wanted
            self.log_m[name] = torch.where(
                take, torch.logaddexp(previous + log_beta, x + log_1mb), previous
            )
            self.counts[name] = self.counts[name].to(x.device) + take
            self.dropped[name] = self.dropped[name].to(x.device) + bad
            self.last_dropped[name] = torch.where(bad, step, self.last_dropped[name].to(x.device))

    def _update_all(
        self,
        xs: Mapping[str, Tensor],
        log_beta: float,
        log_1mb: float,
        step: int,
        include: Mapping[str, Tensor] | None,
    ) -> None:
        """:meth:`update` of every tensor at once, bit for bit: the averages, counts and flags
        of all tensors concatenated, updated in about fifteen operations and one ``logaddexp``
        per tensor instead of a dozen per tensor, and split back (the stored tensors are
        views of one tensor each)."""
        names = list(xs)
        sizes = [xs[n].shape[0] for n in names]
        x = torch.cat([xs[n] for n in names])
        device = x.device
        previous = torch.cat([self.log_m[n].to(device) for n in names])
        owner = _owners(sizes, device)
        invalid = (torch.isnan(x) | torch.isposinf(x)).to(torch.int64)
        ok = torch.zeros(len(names), dtype=torch.int64, device=device)
        ok = ok.index_add_(0, owner, invalid).eq(0)
        wanted = None
        if include is not None and any(n in include for n in names):
            every = torch.ones((), dtype=torch.bool, device=device)
            wanted = torch.stack([include.get(n, every).to(device) for n in names])
        take = ok if wanted is None else ok & wanted
        bad = ~ok if wanted is None else ~ok & wanted
        # logaddexp tensor by tensor: on the concatenation its vectorised exp and log would
        # split the entries differently and round some results otherwise (by 1 ulp)
        mixed = torch.cat(
            [
                torch.logaddexp(p, q)
                for p, q in zip(
                    torch.split(previous + log_beta, sizes),
                    torch.split(x + log_1mb, sizes),
                    strict=True,
                )
            ]
        )
        log_m = torch.where(take.index_select(0, owner), mixed, previous)
        counts = torch.stack([self.counts[n].to(device) for n in names]) + take
        dropped = torch.stack([self.dropped[n].to(device) for n in names]) + bad
        last = torch.where(bad, step, torch.stack([self.last_dropped[n].to(device) for n in names]))
        self.log_m.update(zip(names, torch.split(log_m, sizes), strict=True))
        self.counts.update(zip(names, counts.unbind(0), strict=True))
        self.dropped.update(zip(names, dropped.unbind(0), strict=True))
        self.last_dropped.update(zip(names, last.unbind(0), strict=True))

    def value(self) -> dict[str, Tensor]:
        """Bias-corrected log expectations per tensor (NaN where nothing valid was folded in)."""
        out = {}
        for name, log_m in self.log_m.items():
            t = self.counts[name].to(torch.float64)
            if self.beta > 0:
                log_m = log_m - torch.log1p(-torch.pow(self.beta, t))
            out[name] = torch.where(t > 0, log_m, math.nan)
        return out

    def state_dict(self) -> dict[str, object]:
        """Plain-data state for checkpoints."""
        return {
            "beta": self.beta,
            "log_m": {k: v.clone() for k, v in self.log_m.items()},
            "counts": {k: v.clone() for k, v in self.counts.items()},
            "dropped": {k: v.clone() for k, v in self.dropped.items()},
            "last_dropped": {k: v.clone() for k, v in self.last_dropped.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` (older states, with int counts, load too)."""
        self.beta = float(state["beta"])
        self.log_m = {str(k): v.clone() for k, v in state["log_m"].items()}

        def counter(key: str, name: str, default: int) -> Tensor:
            value = state.get(key, {}).get(name, default)
            device = self.log_m[name].device
            return torch.as_tensor(value, dtype=torch.int64).to(device).clone()

        self.counts = {n: counter("counts", n, 0) for n in self.log_m}
        self.dropped = {n: counter("dropped", n, 0) for n in self.log_m}
        self.last_dropped = {n: counter("last_dropped", n, -1) for n in self.log_m}
