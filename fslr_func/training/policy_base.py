"""What a depth-mapping policy is (:class:`Policy`), the checks every policy shares, and the
one-to-one policy :func:`identity`. The policies over blocks are in
:mod:`fslr_func.training.block_sharing`; names, resolution and validation in
:mod:`fslr_func.training.policies`.

Examples:
    >>> identity({"w": 0.5, "b": 0.1}, ["w", "b"])
    {'w': 0.5, 'b': 0.1}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from ..probe.names import BLOCK_PATTERN, short_list, short_lists
from ..stats.checks import real

__all__ = [
    "DEFAULT_PATTERN",
    "Counterparts",
    "Policy",
    "check_total",
    "check_unique",
    "identity",
    "named",
    "same_names",
]

DEFAULT_PATTERN = BLOCK_PATTERN
"""Default block regex: group 1 is the block index (``blocks.3.``, ``layers.0.``, ``h.11.``)."""


class Policy(Protocol):
    """A depth-mapping policy: ``policy(base, scaled) -> targets``.

    A policy may also carry two optional attributes: ``one_to_one = True`` (each scaled
    tensor answers to the base tensor of its name; :func:`identity`) and
    ``counterparts(base_names, scaled) -> {scaled name: base names}`` (:data:`Counterparts`:
    which base tensors each target is made of, read by
    :func:`fslr_func.training.policies.counterparts`).
    """

    def __call__(self, base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
        """Map every scaled tensor to its target FSLR.

        Args:
            base: base tensor name -> base FSLR at the current step.
            scaled: the scaled model's trainable tensor names, in ``named_parameters()`` order.

        Returns:
            Scaled tensor name -> target FSLR (finite, ``> 0``) for every name in ``scaled``.
        """
        ...


def check_unique(scaled: Sequence[str]) -> None:
    """Refuse repeated scaled tensor names (``ValueError`` naming them)."""
    dup = [n for n, c in Counter(scaled).items() if c > 1]
    if dup:
        raise ValueError(f"scaled tensor names must be unique; repeated: {short_list(dup)}")


def check_total(total: float) -> float:
    """``total`` as a float, refused unless a finite number ``> 0`` (``ValueError``)."""
    return real(total, "total", above=0.0)


Counterparts = Callable[[Iterable[str], Sequence[str]], dict[str, tuple[str, ...]]]
"""``counterparts(base_names, scaled) -> {scaled name: base names}``: the base tensors whose
values a policy maps onto each scaled tensor (:func:`fslr_func.training.policies.counterparts`)."""


def same_names(base: Iterable[str], scaled: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each scaled tensor's counterpart: the base tensor of its name, where there is one.

    Examples:
        >>> same_names(["w", "v"], ["w", "u"])
        {'w': ('w',)}
    """
    known = set(base)
    return {n: (n,) for n in scaled if n in known}


def named(
    fn: Callable[[Mapping[str, float], Sequence[str]], dict[str, float]],
    name: str,
    counterparts: Counterparts | None = None,
) -> Policy:
    """``fn`` named ``name`` (its ``__name__`` and ``__qualname__``, which messages and saved
    FLeRM states show), with its ``counterparts`` attribute if given."""
    fn.__name__ = fn.__qualname__ = name
    if counterparts is not None:
        fn.counterparts = counterparts  # type: ignore[attr-defined]
    return fn


def identity(base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
    """One-to-one policy: ``target_W = base_W`` for tensors with the same name.

    For width, initialisation-scale or LoRA-rank scaling, where base and scaled models have the
    same tensor names.

    Raises:
        ValueError: listing the scaled tensors missing from the base record and the base
            tensors absent from the scaled model (a record from another architecture).

    Examples:
        >>> identity({"w": 0.5, "b": 0.1}, ["w", "b"])
        {'w': 0.5, 'b': 0.1}
        >>> identity({"w": 0.5}, ["w", "v"])
        Traceback (most recent call last):
        ...
        ValueError: identity policy: the base record and the scaled model have different tensors: scaled tensors missing from the base record: ['v']. Is the record from another architecture? For depth scaling use policy='share_blocks' or a custom callable.
    """  # noqa: E501
    check_unique(scaled)
    missing = [n for n in scaled if n not in base]
    scaled_set = set(scaled)
    extra = [n for n in base if n not in scaled_set]
    if missing or extra:
        listed = short_lists(
            ("scaled tensors missing from the base record", missing),
            ("base tensors absent from the scaled model", extra),
        )
        raise ValueError(
            "identity policy: the base record and the scaled model have different tensors: "
            f"{listed}. Is the record from another architecture? For depth scaling use "
            "policy='share_blocks' or a custom callable."
        )
    return {n: float(base[n]) for n in scaled}


identity.one_to_one = True  # type: ignore[attr-defined]
identity.counterparts = same_names  # type: ignore[attr-defined]
