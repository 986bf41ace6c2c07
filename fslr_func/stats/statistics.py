r"""The per-sample statistics of ``Z = dW * g``: ``D + 2`` scalars per tensor and sample.

For one parameter tensor of rank ``D`` with unit-learning-rate update ``dW`` and probe gradient
``g = d phi / d W`` (one omega sample),

.. math::

    q_0 = \sum Z^2, \qquad q_d = \sum (\textstyle\sum_{i_d} Z)^2 \ (d = 0..D-1),
    \qquad q_\text{full} = (\sum Z)^2 ,

returned as float64 **logs** in the order ``[q_0, q_{d=0}, ..., q_{d=D-1}, q_full]``
(``-inf`` for an exact zero), finite and correct to float32 rounding for every finite ``g`` and
``dW`` of float32, bfloat16 and float16, subnormals included. The estimators built from them
are in :mod:`fslr_func.stats.estimator`.

Cost: the probe takes these statistics for every tensor of every sample, so they are built
to cost little more than the reductions themselves. The update is scaled by its power of two
once per probe (:class:`ScaledUpdate`); per sample and tensor, ``Z`` is formed at a scale
near 1 (the gradient divided by its largest magnitude) in the gradient itself, which the probe
hands over (no allocation), or in one temporary, and reduced in place; the scales of every
tensor of the sample are found at once, and the log, the scale and the shift are applied to
all their statistics at once (:class:`ProductStatistics`), in a handful of operations on
short vectors, instead of a dozen operations per tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch._C._functorch as functorch
from torch import Tensor

_LOG4 = 2.0 * math.log(2.0)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32 for accumulating statistics, whatever the parameter dtype (bf16, fp16)."""
    return torch.promote_types(dtype, torch.float32)


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
    normal number of ``z``'s dtype. ``Z 2^k`` is then exact, its largest magnitude in
    ``[2^{-22}, 1)`` for float32 (``[2^{-51}, 1)`` for float64) whatever ``Z``'s, but for
    entries more than ``2^{125}`` below the largest, which lose bits where they weigh less
    than ``2^{-125}`` of it in any statistic. An all-zero ``Z`` gets ``k = 0``; a NaN or
    infinite ``Z`` some ``k`` in range. Two reads of ``Z`` (max and min: no temporary of its
    size); no host synchronisation; works under :func:`torch.func.vmap`.

    Examples:
        >>> int(scale_exponent(torch.tensor([3.0, -6.0])))  # 6 = 0.75 * 2**3
        -3
        >>> int(scale_exponent(torch.tensor([1e-39])))  # subnormal: 2**129 is no float32
        127
    """
    peak = torch.maximum(z.amax(), -z.amin())
    low, high = _exponent_range(z.dtype)
    return -torch.frexp(peak).exponent.clamp(low, high)


@dataclass(frozen=True)
class ScaledUpdate:
    r"""An update ``dW`` prepared once per probe for :class:`ProductStatistics`.

    ``tensor`` is ``2^k dW`` in the statistic dtype (at least float32), ``k`` from
    :func:`scale_exponent`, so that the product with a gradient neither underflows (an update
    of ``1e-39`` times a gradient of ``1e-3`` is below float32's smallest subnormal) nor
    loses the bits of a subnormal; ``log_factor`` (float64, 0-d) is what comes back in log
    space, ``-2 k log 2`` plus the ``shift`` asked for (the probe's ``-log M``).

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


class ProductStatistics:
    r"""The log statistics of ``Z = g * dW`` for every tensor of one sample, at once.

    Built once per probe from the updates (each scaled once, :class:`ScaledUpdate`) and the
    shapes ``Z`` is viewed as (:func:`fslr_func.stats.estimator.grouped_shape`); called once
    per sample with that sample's gradients. Per tensor, the gradient is divided (exactly)
    by the power of two ``p`` with ``p <= max |g| < 2p``, or the smallest normal number of its
    dtype if ``max |g|`` is below it, and multiplied in place by the scaled update, so that
    ``Z' = Z / (p 2^k)`` has its largest magnitude below 2 whatever the magnitudes of ``g``
    and ``dW``: no square or sum of it overflows, and the product rounds as a product of
    normal numbers even where ``g`` or ``dW`` is subnormal.
    The statistics ``q'`` of ``Z'`` are reduced in place (in the gradient itself with
    ``overwrite``, else in one temporary the size of the tensor), then, for all tensors
    together, cast to float64 and brought back:

    .. math::

        \log q(Z) = \log q(Z') + 2 \log p - 2 k \log 2 + \text{shift} .

    Precision is lost only where every entry of ``Z'`` is below ``2^{-63}`` (squares below
    float32's normal range) although each factor has entries near 1: the gradient's large
    entries all meeting the update's tiny ones, a pattern of values, not of magnitude, that
    no optimiser's update has with the gradient it came from. Works under
    :func:`torch.func.vmap` (no data-dependent control flow) and never synchronises with the
    host.

    Args:
        updates: tensor name -> its update, from :meth:`ScaledUpdate.of`.
        views: tensor name -> the shape ``Z`` is viewed as; default (and for names left
            out): the update's shape.

    Examples:
        >>> g, d = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.full((2, 2), 1e-39)
        >>> stats = ProductStatistics({"w": ScaledUpdate.of(d)})
        >>> got = stats({"w": g * 1e-40})["w"]  # Z = 1e-79 g: no float32 holds it
        >>> torch.allclose(got, log_statistics(g.double() * 1e-79), rtol=1e-6)
        True
    """

    def __init__(
        self,
        updates: Mapping[str, ScaledUpdate],
        views: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        views = views or {}
        self.updates = dict(updates)
        self.views = {n: tuple(views.get(n, u.tensor.shape)) for n, u in self.updates.items()}
        self.sizes = [len(v) + 2 for v in self.views.values()]
        self.log_factors = torch.cat(
            [
                u.log_factor.reshape(1).expand(s)
                for u, s in zip(updates.values(), self.sizes, strict=True)
            ]
        )
        device = self.log_factors.device
        # statistic -> its tensor, to spread the tensors' scales over their statistics (filled
        # on the device: a tensor made from a host list is a copy that synchronises a GPU)
        self.owner = torch.cat(
            [torch.full((s,), i, device=device) for i, s in enumerate(self.sizes)]
        )
        # q_full, each tensor's last statistic, enters as |sum Z'| (no square to underflow):
        # its log counts twice (found on the device: writing a host scalar into a CUDA tensor
        # synchronises)
        last = torch.ones_like(self.owner, dtype=torch.bool)
        torch.ne(self.owner[1:], self.owner[:-1], out=last[:-1])
        self.powers = last.to(self.log_factors.dtype) + 1.0
        self._floors: dict[tuple[torch.dtype, ...], Tensor] = {}

    def __call__(
        self, grads: Mapping[str, Tensor], *, overwrite: bool = False, disjoint: bool = False
    ) -> dict[str, Tensor]:
        """Per tensor name, the float64 log statistics of ``Z = grads[name] * dW``.

        Args:
            grads: tensor name -> ``d phi / d W`` for one sample (any floating dtype), for
                every name of the updates.
            overwrite: the gradients are the caller's to discard: each contiguous one of
                the statistic dtype is turned into ``Z'`` in place, saving the allocation of
                a tensor of its size (the statistics are the same bit for bit); otherwise
                they are not modified. A gradient whose memory a later name's gradient
                shares (autograd hands ``a + b``'s one gradient to both operands, and a view
                of it to a parameter used through ``.view``: LSTM's two biases) is never
                overwritten: the later name reads it as it was.
            disjoint: the caller knows that no two gradients share memory (the pieces of one
                fresh buffer, as a data-parallel reduction returns, whose interleaved rows
                the memory check cannot tell apart): with ``overwrite``, all are written.

        Returns:
            tensor name -> ``[log q_0, log q_{d=0}, ..., log q_{d=D-1}, log q_full]`` for
            ``D`` the rank of its view (``-inf`` where a statistic is exactly zero; NaN or
            ``+inf`` where ``Z`` is not finite).
        """
        given = [grads[name].detach() for name in self.updates]
        writable = [overwrite] * len(given) if disjoint or not overwrite else _unshared_after(given)
        xs = [
            g.to(torch.promote_types(_stat_dtype(g.dtype), u.tensor.dtype))
            for g, u in zip(given, self.updates.values(), strict=True)
        ]
        peaks = self._powers_of_two([x.amax() for x in xs], [x.amin() for x in xs])
        values: list[Tensor] = []
        for g, x, free, scale, update, view in zip(
            given,
            xs,
            writable,
            peaks.reciprocal().unbind(0),
            self.updates.values(),
            self.views.values(),
            strict=True,
        ):
            in_place = x is not g or (free and x.is_contiguous())
            values += _reduce(_scaled(x, scale, in_place).mul_(update.tensor).reshape(view))
        log_peaks = peaks.to(torch.float64).log_().index_select(0, self.owner)
        logs = torch.stack(values).abs_().to(torch.float64).log_().mul_(self.powers)
        logs = logs.add_(log_peaks, alpha=2.0).add_(self.log_factors)
        return dict(zip(self.updates, torch.split(logs, self.sizes), strict=True))

    def _powers_of_two(self, maxima: Sequence[Tensor], minima: Sequence[Tensor]) -> Tensor:
        """Per tensor, the power of two ``p <= max |g| < 2p``, at least the smallest normal
        number of the tensor's dtype: a power whose reciprocal is a number of that dtype, so
        that ``g / p`` is exact (a product is faster than a quotient, 6x under vmap). A NaN
        in ``g`` makes ``p`` NaN, an infinite ``g`` makes ``Z'`` NaN."""
        dtypes = tuple(m.dtype for m in maxima)
        stacked = torch.maximum(torch.stack(list(maxima)), torch.stack(list(minima)).neg_())
        floors = self._floors.get(dtypes)
        if floors is None:  # filled on the device, as the owners above
            floors = torch.stack(
                [
                    torch.full((), torch.finfo(d).tiny, dtype=stacked.dtype, device=stacked.device)
                    for d in dtypes
                ]
            )
            self._floors[dtypes] = floors
        stacked = torch.maximum(stacked, floors)  # float64 if any tensor is
        mantissa, _ = torch.frexp(stacked)  # max |g| = m 2^e, m in [1/2, 1): p = 2^(e-1)
        return stacked.div_(mantissa.add_(mantissa))


def _span(t: Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, stop)`` of memory that ``t``'s elements lie in, through
    torch.func's wrappers (a vmapped gradient is a wrapper whose own storage cannot be read);
    None where they cannot be read."""
    try:
        while functorch.is_batchedtensor(t) or functorch.is_gradtrackingtensor(t):
            t = functorch.get_unwrapped(t)
        if t.numel() == 0:
            return None
        size = t.element_size()
        start = t.untyped_storage().data_ptr() + int(t.storage_offset()) * size
        last = sum((int(n) - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride(), strict=True))
        return start, start + (last + 1) * size
    except (AttributeError, NotImplementedError, RuntimeError):
        return None


def _unshared_after(tensors: Sequence[Tensor]) -> list[bool]:
    """Per tensor, whether no later tensor of ``tensors`` lies in memory it spans (so that
    overwriting it leaves what the later ones read intact); all False where any tensor's
    memory cannot be read. Tensors in one buffer but apart (the pieces of a data-parallel
    probe's all-reduced gradients, a ``torch.cat``'s gradient) stay writable.

    Examples:
        >>> g = torch.ones(6)
        >>> _unshared_after([g, torch.ones(2), g.view(2, 3)])
        [False, True, True]
        >>> _unshared_after(list(torch.ones(6).split(3)))  # one buffer, apart
        [True, True]
    """
    found = [_span(t) for t in tensors]
    spans = [s for s in found if s is not None]
    if len(spans) < len(found):
        return [False] * len(found)
    writable = [True] * len(spans)
    cluster: list[int] = []  # a run of spans that overlap, in the order of their starts
    end = -1
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        start, stop = spans[i]
        if not (cluster and start < end):
            _keep_last(cluster, writable)
            cluster, end = [], -1
        cluster.append(i)
        end = max(end, stop)
    _keep_last(cluster, writable)
    return writable


def _keep_last(cluster: list[int], writable: list[bool]) -> None:
    """Of tensors whose memory overlaps, only the last (in the order they are read) may be
    overwritten: every other one is read before it."""
    for i in sorted(cluster)[:-1]:
        writable[i] = False


def _scaled(x: Tensor, scale: Tensor, in_place: bool) -> Tensor:
    """``x * scale``, in ``x`` if ``in_place`` and torch allows it (under vmap, not where
    ``x`` is the same for every sample and ``scale`` is not)."""
    if in_place:
        try:
            return x.mul_(scale)
        except RuntimeError:  # refused before anything is written
            pass
    return x.mul(scale)


def _reduce(z: Tensor) -> list[Tensor]:
    """``[q_0, q_{d}..., sum]`` of ``z``, reduced in place (``sum`` signed: ``q_full`` is its
    square)."""
    sums = [z.sum(d) for d in range(z.dim())]
    total = sums[0].sum() if sums else z.clone()
    return [z.mul_(z).sum()] + [s.mul_(s).sum() for s in sums] + [total]


def product_log_statistics(
    grad: Tensor, update: ScaledUpdate, view: Sequence[int] | None = None
) -> Tensor:
    """:class:`ProductStatistics` of one tensor: the log statistics of ``Z = grad * dW``.

    Args:
        grad: ``d phi / d W`` for one sample (any floating dtype; not modified).
        update: the update, from :meth:`ScaledUpdate.of`.
        view: the shape ``Z`` is viewed as; ``None``: ``grad``'s.

    Examples:
        >>> g, d = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.full((2, 2), 1e-39)
        >>> got = product_log_statistics(g * 1e-40, ScaledUpdate.of(d))  # 1e-79: no float32
        >>> torch.allclose(got, log_statistics(g.double() * 1e-79), rtol=1e-6)
        True
    """
    views = {"z": grad.shape if view is None else view}
    return ProductStatistics({"z": update}, views)({"z": grad})["z"]


def log_statistics(z: Tensor) -> Tensor:
    r"""Log of the ``D + 2`` statistics of one ``Z`` (any rank ``D >= 0``).

    :func:`product_log_statistics` of ``Z`` with the update 1: finite and correct for every
    finite ``Z`` of float32, bfloat16 and float16, subnormals included, and finite for every
    finite float64 ``Z``.

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
    one = ScaledUpdate.of(torch.ones((), dtype=z.dtype, device=z.device))
    return product_log_statistics(z, one)
