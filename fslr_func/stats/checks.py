"""The checks of numeric options, shared by every entry point (lowest layer: all may use it).

An integer option takes any :class:`numbers.Integral` but ``bool`` (``2``, ``np.int64(2)``); a
real option any :class:`numbers.Real` but ``bool`` (``0.1``, ``np.float64(0.1)``, an int).
Both come back as a plain ``int`` / ``float``, so that saved states and JSON records hold plain
numbers. Strings, NaN, infinities and values out of range are refused with a ``ValueError``
naming the option; so are tensors, even 0-d ones (``torch.tensor(2)``), with the hint to pass
``t.item()``: a tensor is not a number of Python's numeric tower, and an option read from one
on an accelerator would synchronise with it.

Examples:
    >>> import numpy as np
    >>> integer(np.int64(2), "every", low=1), real(np.float64(0.1), "beta", low=0.0)
    (2, 0.1)
    >>> integer(True, "every", low=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: every must be a positive integer, got True
"""

from __future__ import annotations

import math
import numbers
from typing import cast

__all__ = ["integer", "is_integer", "is_real", "real", "torch_seed"]


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer of any kind but ``bool`` (``numbers.Integral``).

    Examples:
        >>> [is_integer(v) for v in (3, True, 3.0, "3")]
        [True, False, False, False]
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a finite real number of any kind but ``bool``.

    Examples:
        >>> [is_real(v) for v in (3, 0.5, float("nan"), False, "1")]
        [True, True, False, False, False]
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except (OverflowError, TypeError, ValueError):
        return False


def _tensor_hint(value: object) -> str:
    kind = type(value)
    if kind.__module__.startswith("torch") and kind.__name__ == "Tensor":
        return " (a tensor: pass a Python number, t.item())"
    return ""


def integer(
    value: object, name: str, *, low: int = 0, optional: bool = False, what: str | None = None
) -> int:
    """``value`` as a plain ``int``, refused unless an integer ``>= low``.

    Args:
        value: the option's value.
        name: the option's name, for the message.
        low: the least value allowed (1: "a positive integer", 0: "a non-negative integer").
        optional: the message says ``None`` is allowed too (the caller handles ``None``).
        what: the message's description instead of the one ``low`` gives.

    Raises:
        ValueError: ``value`` is no integer (``bool``, ``float``, ``str``, a tensor) or is
            below ``low``; the message is ``"{name} must be [None or ]{what}, got {value!r}"``.

    Examples:
        >>> integer(0, "start_step")
        0
        >>> integer(-1, "start_step")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: start_step must be a non-negative integer, got -1
    """
    if is_integer(value) and (n := int(cast(numbers.Integral, value))) >= low:
        return n
    if what is None:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(
            low, f"an integer >= {low}"
        )
    none = "None or " if optional else ""
    raise ValueError(f"{name} must be {none}{what}, got {value!r}{_tensor_hint(value)}")


def real(
    value: object,
    name: str,
    *,
    low: float | None = None,
    above: float | None = None,
    below: float | None = None,
    optional: bool = False,
    what: str | None = None,
) -> float:
    """``value`` as a plain ``float``, refused unless a finite real number in range.

    Args:
        value: the option's value.
        name: the option's name, for the message.
        low: the least value allowed (inclusive).
        above: a bound the value must exceed (exclusive).
        below: a bound the value must stay under (exclusive).
        optional: the message says ``None`` is allowed too (the caller handles ``None``).
        what: the message's description instead of the one the bounds give.

    Raises:
        ValueError: ``value`` is no finite real number (``bool``, ``str``, NaN, Inf, a tensor)
            or is out of range; the message is ``"{name} must be [None or ]{what}, got ..."``.

    Examples:
        >>> real(1, "min_fslr", low=0.0)
        1.0
        >>> real(0.0, "feature_power", above=0.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: feature_power must be a finite number > 0, got 0.0
    """
    if is_real(value):
        x = float(cast(numbers.Real, value))
        if (
            (low is None or x >= low)
            and (above is None or x > above)
            and (below is None or x < below)
        ):
            return x
    if what is None:
        bounds = [
            f"{sign} {bound:g}"
            for sign, bound in ((">=", low), (">", above), ("<", below))
            if bound is not None
        ]
        what = " ".join(["a finite number", " and ".join(bounds)]).rstrip()
    none = "None or " if optional else ""
    raise ValueError(f"{name} must be {none}{what}, got {value!r}{_tensor_hint(value)}")


def torch_seed(seed: object, name: str) -> int:
    """``seed`` as a plain int that ``torch.manual_seed`` takes, checked before any model runs.

    Raises:
        TypeError: ``seed`` is not an integer (any ``numbers.Integral``; no bool).
        ValueError: outside ``[-2**63, 2**64)``, which torch refuses only when it seeds.

    Examples:
        >>> torch_seed(2**64, "forward_seed")
        Traceback (most recent call last):
        ...
        ValueError: forward_seed must be in [-2**63, 2**64) (a torch seed), got 18446744073709551616
    """
    if not is_integer(seed):
        raise TypeError(f"{name} must be None or an int, got {seed!r}{_tensor_hint(seed)}")
    value = int(cast(numbers.Integral, seed))
    if not -(2**63) <= value < 2**64:
        raise ValueError(f"{name} must be in [-2**63, 2**64) (a torch seed), got {value}")
    return value
