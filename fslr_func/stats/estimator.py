r"""Statistics of ``Z`` and the FSLR estimators built from them (pure tensor functions).

For one parameter tensor ``W`` of rank ``D`` with unit-learning-rate update ``dW`` and probe
gradient ``g = d phi / d W``, the probe produces ``Z = dW * g``. Everything the estimators need
is ``D + 2`` scalars per sample:

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

The FSLR is the square root of the estimate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor

Estimator = Literal["kron", "full", "iid"]
"""The estimators of ``||Delta_W f||^2_RMS``: ``kron`` (tensor-normal), ``full``, ``iid``."""
ReadoutRole = Literal["weight", "bias"]
"""A readout tensor's role, which picks its row-independent estimator variant."""
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
"""The names :data:`Estimator` allows, for validation and messages."""
Grouping = str | Callable[[str, tuple[int, ...]], Sequence[int] | None]
"""How a tensor of rank 3 or more is viewed for ``kron``: ``"auto"``, ``"dims"``, ``"matrix"``
or ``callable(name, shape) -> grouped shape`` (``None``: the tensor's own shape)."""
GROUPINGS: tuple[str, ...] = ("auto", "dims", "matrix")


def check_estimator(name: str) -> None:
    """Raise a ``ValueError`` naming the valid estimators if ``name`` is not one of them."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown estimator {name!r}; choose one of {', '.join(ESTIMATORS)}")


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


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32 for accumulating statistics, whatever the parameter dtype (bf16, fp16)."""
    return torch.promote_types(dtype, torch.float32)


_LOG4 = 2.0 * math.log(2.0)


@functools.cache
def _exponent_range(dtype: torch.dtype) -> tuple[int, int]:
    """Exponents ``e`` for which ``2**-e`` is a normal number of ``dtype``: ``[-127, 126]``
    for float32, ``[-1023, 1022]`` for float64."""
    info = torch.finfo(dtype)
    return 1 - math.frexp(info.max)[1], 1 - math.frexp(info.tiny)[1]


def scale_exponent(z: Tensor) -> Tensor:
    r"""The power of two that brings ``max |Z|`` to ``[1/2, 1)``: an int tensor ``k``, 0-d.

    ``max |Z| = m 2^e`` with ``m`` in ``[1/2, 1)`` (:func:`torch.frexp`, read from the
    exponent bits, so subnormals are exact too) and ``k = -e``, clamped so that ``2^k`` is a
    normal number of ``z``'s dtype. The largest magnitude of ``Z 2^k`` then lies in
    ``[2^{-22}, 4)`` for float32 (``[2^{-51}, 4)`` for float64) whatever ``Z``'s, and
    ``Z 2^k`` is exact but for entries more than ``2^{125}`` below the largest, which lose
    bits where they weigh less than ``2^{-125}`` of it in any statistic. An all-zero
    ``Z`` gets ``k = 0``; a NaN or infinite ``Z`` some ``k`` in range (its statistics are then
    NaN or infinite, which :func:`valid_log` refuses). Two reads of ``Z`` (max and min: no
    temporary of its size); no host synchronisation; works under :func:`torch.func.vmap`.

    Examples:
        >>> int(scale_exponent(torch.tensor([3.0, -6.0])))  # 6 = 0.75 * 2**3
        -3
        >>> int(scale_exponent(torch.tensor([1e-39])))  # subnormal: 2**129 is no float32
        127
    """
    peak = torch.maximum(z.amax(), -z.amin())
    low, high = _exponent_range(z.dtype)
    return -torch.frexp(peak).exponent.clamp(low, high)


def _log_statistics_(u: Tensor, k: Tensor, log_factor: Tensor | float) -> Tensor:
    """The log statistics of ``Z`` from ``u = 2^k Z`` (overwritten: it is squared in place)."""
    sums = [u.sum(d).to(torch.float64) for d in range(u.dim())]
    total = (sums[0] if sums else u.to(torch.float64)).sum()
    parts = [u.mul_(u).sum().to(torch.float64)]
    parts += [s.square().sum() for s in sums]
    parts.append(total.square())
    log_q = torch.stack(parts).log().sub_(k.to(torch.float64), alpha=_LOG4)
    return log_q.add_(log_factor)


def log_statistics(z: Tensor) -> Tensor:
    r"""Log of the ``D + 2`` per-sample statistics of one ``Z`` (any rank ``D >= 0``).

    ``Z`` (cast to at least float32) is multiplied by the power of two ``2^k`` of
    :func:`scale_exponent`, which is exact and brings its largest magnitude near 1, so no
    square or sum below overflows or underflows; ``2 k \log 2`` comes off in log space:

    .. math::

        \log q(Z) = \log q(2^k Z) - 2 k \log 2 .

    The reductions run in the statistic dtype (pairwise summation, accurate over millions of
    elements); the per-dim sums are squared and summed in float64. Finite and correct for
    every finite ``Z`` of float32, bfloat16 and float16, subnormals included, and finite
    for every finite float64 ``Z``.
    Passes over ``Z``: max and min, the scaling, one
    per dim for its sums (``q_full`` is the sum of the first dim's sums), the square in place
    and its sum. Works under :func:`torch.func.vmap` (no data-dependent control flow) and
    never synchronises with the host. :func:`product_log_statistics` is the same for
    ``Z = g * dW`` formed from a gradient and a pre-scaled update (the probe's case).

    Args:
        z: ``dW * g`` for one sample, shape of the (grouped) parameter.

    Returns:
        float64 tensor ``[log q_0, log q_{d=0}, ..., log q_{d=D-1}, log q_full]`` (``-inf``
        where a statistic is exactly zero; NaN or ``+inf`` where ``Z`` is not finite).

    Examples:
        >>> z = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> log_statistics(z).exp().round()
        tensor([ 30.,  52.,  58., 100.], dtype=torch.float64)
        >>> log_statistics(z * 1e-39).exp() / 1e-78  # subnormal float32: same statistics
        tensor([ 30.0000,  52.0000,  58.0000, 100.0000], dtype=torch.float64)
    """
    z = z.detach().to(_stat_dtype(z.dtype))
    k = scale_exponent(z)
    return _log_statistics_(z * torch.exp2(k.to(z.dtype)), k, 0.0)


@dataclass(frozen=True)
class ScaledUpdate:
    r"""An update ``dW`` prepared once per probe for :func:`product_log_statistics`.

    ``tensor`` is ``2^k dW`` in the statistic dtype (at least float32), ``k`` from
    :func:`scale_exponent`, so that the product with a gradient neither underflows (an update
    of ``1e-39`` times a gradient of ``1e-3`` is below float32's smallest subnormal) nor
    loses the bits of a subnormal; ``log_factor`` is what comes back in log space,
    ``-2 k log 2`` plus the ``shift`` asked for (the probe's ``-log M``).

    Examples:
        >>> u = ScaledUpdate.of(torch.tensor([1e-30, -3e-30]))  # 2**98 times the update
        >>> u.tensor, round(float(-u.log_factor / (2 * math.log(2))))
        (tensor([ 0.3169, -0.9507]), 98)
    """

    tensor: Tensor
    log_factor: Tensor

    @classmethod
    def of(cls, delta: Tensor, shift: float = 0.0) -> ScaledUpdate:
        """Scale ``delta`` by its power of two; ``shift`` is added to every log statistic."""
        d = delta.detach().to(_stat_dtype(delta.dtype))
        k = scale_exponent(d)
        log_factor = shift - _LOG4 * k.to(torch.float64)
        return cls(d * torch.exp2(k.to(d.dtype)), log_factor)


def product_log_statistics(
    grad: Tensor, update: ScaledUpdate, view: Sequence[int] | None = None
) -> Tensor:
    r""":func:`log_statistics` of ``Z = grad * dW`` (viewed as ``view``), plus the shift.

    The gradient is brought near 1 by its own power of two ``2^j`` (:func:`scale_exponent`)
    as it is cast to the statistic dtype, then multiplied in place by the update, pre-scaled
    once per probe outside the sampled loop (:class:`ScaledUpdate`). Both factors then have
    their largest magnitude in ``[2^{-22}, 4)``, so their product rounds as a product of
    normal numbers even where the gradient or the update is subnormal, ``|2^j 2^k Z| < 16``
    cannot overflow in any square or sum, and ``2 (j + k) \log 2`` comes off in log space.
    The one temporary, the size of the tensor, is written once and then updated in place.
    Finite and correct (to float32 rounding) for every finite update and gradient of
    float32, bfloat16 and float16, whatever their magnitudes. Precision is lost only where
    every entry of the scaled ``Z`` is below ``2^{-63}`` (squares below float32's normal
    range) although each factor has entries near 1: the gradient's large entries all meeting
    the update's tiny ones, a pattern of values, not of magnitude, that no optimiser's
    update has with the gradient it came from.

    Args:
        grad: ``d phi / d W`` for one sample (any floating dtype; not modified).
        update: the update, from :meth:`ScaledUpdate.of`.
        view: the shape ``Z`` is viewed as (:func:`grouped_shape`); ``None``: ``grad``'s.

    Examples:
        >>> g, d = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.full((2, 2), 1e-39)
        >>> got = product_log_statistics(g * 1e-40, ScaledUpdate.of(d))  # 1e-79: no float32
        >>> torch.allclose(got, log_statistics(g.double() * 1e-79), rtol=1e-6)
        True
    """
    g = grad.detach()
    dtype = torch.promote_types(_stat_dtype(g.dtype), update.tensor.dtype)
    j = scale_exponent(g)
    factor = torch.exp2(j.to(dtype))
    z = g * factor if g.dtype == dtype else g.to(dtype).mul_(factor)  # never g itself
    z = z.mul_(update.tensor)
    return _log_statistics_(z if view is None else z.reshape(view), j, update.log_factor)


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
        log_e: log expectations ``[log E q_0, log E q_{d}..., log E q_full]`` of one tensor.
        estimator: ``"kron"``, ``"full"`` or ``"iid"``.
        readout: ``"weight"`` or ``"bias"`` if the tensor is the readout layer's (the
            row-independent variants apply to ``kron``; ``full`` and ``iid`` are unchanged).

    Returns:
        A float64 scalar; ``-inf`` when the estimate is exactly zero.

    Examples:
        >>> z = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> ls = log_statistics(z)
        >>> round(float(log_sq_norm(ls, "kron").exp()), 4)  # 52 * 58 / 30
        100.5333
        >>> round(float(log_sq_norm(ls, "kron", readout="weight").exp()), 4)  # 3^2 + 7^2
        58.0
    """
    check_estimator(estimator)
    rank = log_e.shape[0] - 2
    log_q0 = log_e[0]
    if estimator == "full":
        return log_e[-1]
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
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {self.beta}")

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
        for name, x in log_x.items():
            x = x.detach().to(torch.float64)
            previous = self.log_m.get(name)
            if previous is None or previous.shape != x.shape:
                previous = torch.full_like(x, -math.inf)
                zero = torch.zeros((), dtype=torch.int64, device=x.device)
                self.counts[name], self.dropped[name] = zero, zero
                self.last_dropped[name] = zero - 1
            previous = previous.to(x.device)
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
