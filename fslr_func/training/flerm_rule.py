r"""FLeRM's rule as pure functions: no optimiser, no model, no state (the way optax separates a
transformation from its application).

At a set point each tensor :math:`W` with policy target :math:`T_W` and measured unit-rate
FSLR :math:`\mathrm{FSLR}_W` gets the ratio :math:`r_W = T_W / \mathrm{FSLR}_W`
(:func:`match`); at any step its rate is

.. math::

    \eta_W(t) = \eta_0 \, \mathrm{sched}(t) \, r_W \quad (:func:`rate`),

so that :math:`\eta_W \, \mathrm{FSLR}_W = \eta_0 \, \mathrm{sched}(t) \, T_W`: the tensor moves
the function as its base counterpart did. A tensor whose FSLR or target is zero or tiny
(``<= min_fslr``: LoRA ``A`` while ``B = 0``) has no ratio and is *held* (it keeps its rate);
one whose FSLR is not finite, or whose rate would overflow its dtype, is held too and reported
apart. :class:`~fslr_func.training.flerm.FLeRM` applies the result to an optimiser
(:mod:`fslr_func.training.update_scaling`).

Examples:
    >>> m = match({"w": 0.2, "b": 0.0}, {"w": 0.4, "b": 0.1}, lr0=1e-2)
    >>> m.ratios, m.zero, m.nonfinite
    ({'w': 0.5}, ('b',), ())
    >>> rate(1e-2, 0.5, m.ratios["w"])
    0.0025
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Match", "match", "rate"]


@dataclass(frozen=True)
class Match:
    """The outcome of one set point's matching.

    Attributes:
        ratios: tensor name -> :math:`r_W = T_W / \\mathrm{FSLR}_W`, for the matched tensors.
        zero: tensors held because their FSLR or target is zero or ``<= min_fslr``.
        nonfinite: tensors held because their FSLR or ratio is not finite, or their rate
            would exceed ``max_rate``.
        unmatched: tensors with a measured FSLR but no target (no base counterpart).
    """

    ratios: dict[str, float]
    zero: tuple[str, ...]
    nonfinite: tuple[str, ...]
    unmatched: tuple[str, ...]


def match(
    targets: Mapping[str, float],
    fslrs: Mapping[str, float],
    *,
    lr0: float,
    min_fslr: float = 1e-12,
    max_rate: Mapping[str, float] | None = None,
) -> Match:
    r"""Ratios :math:`r_W = T_W / \mathrm{FSLR}_W` of the tensors that can be matched.

    Args:
        targets: tensor name -> policy target :math:`T_W` (``>= 0``).
        fslrs: tensor name -> measured unit-rate FSLR (NaN: no finite estimate; a tensor
            missing here counts as 0).
        lr0: the base learning rate :math:`\eta_0`.
        min_fslr: FSLRs or targets at or below it count as zero (held).
        max_rate: tensor name -> the largest rate :math:`\eta_0 r_W` allowed (for example
            the square root of its dtype's maximum, past which an optimiser overflows);
            default: no limit.

    Returns:
        A :class:`Match`; every name of ``fslrs`` and ``targets`` is in exactly one of its
        fields.

    Examples:
        >>> match({"w": 1.0}, {"w": float("nan")}, lr0=0.1).nonfinite
        ('w',)
    """
    ratios: dict[str, float] = {}
    zero: list[str] = []
    nonfinite: list[str] = []
    names = list(fslrs) + [n for n in targets if n not in fslrs]
    unmatched = tuple(n for n in names if n not in targets)
    for n in names:
        if n in unmatched:
            continue
        f, target = float(fslrs.get(n, 0.0)), float(targets[n])
        usable = math.isfinite(f) and f > min_fslr and target > min_fslr
        ratio = target / f if usable else 0.0
        limit = math.inf if max_rate is None else max_rate.get(n, math.inf)
        if not (math.isfinite(f) and math.isfinite(ratio) and lr0 * ratio <= limit):
            nonfinite.append(n)
        elif ratio == 0.0:
            zero.append(n)
        else:
            ratios[n] = ratio
    return Match(ratios, tuple(zero), tuple(nonfinite), unmatched)


def rate(lr0: float, sched: float, ratio: float) -> float:
    r"""FLeRM's learning rate :math:`\eta_0 \, \mathrm{sched}(t) \, r_W`.

    Examples:
        >>> rate(0.01, 1.0, 2.0)
        0.02
    """
    return lr0 * sched * ratio
