"""Depth-mapping policies: which base FSLR each tensor of a scaled model should match.

FLeRM sets ``lr_W(t) = lr_0 * sched(t) * target_W(t) / FSLR_W(t)`` for every trainable tensor
``W`` of the scaled model. A *policy* says what ``target_W`` is, given the base model's FSLRs at
the current step (``FSLRRecord.at(step)``)::

    policy(base: Mapping[str, float], scaled: Sequence[str]) -> dict[str, float]

``base`` maps base tensor names to base FSLRs, ``scaled`` lists the scaled model's trainable
tensor names (``named_parameters()`` order) and the result maps *every* scaled name to a
positive target. Any callable with that signature is a policy (see :class:`Policy`);
:func:`apply` calls one and validates what it returns.

Provided policies:

- :func:`identity`: same tensors, same values (width, init-scale or LoRA-rank scaling).
- :func:`share_blocks`: depth scaling (paper, section 3.3). Blocks are found in tensor names by
  a regex (``blocks.3.lin.weight`` is block 3 with *role* ``blocks.*.lin.weight``). For a stack
  of ``B`` base blocks and ``L`` scaled blocks:

  - ``L >= B``: scaled block ``l`` answers to base block ``m(l) = floor(l * B / L)``
    (contiguous, order preserving) and each scaled tensor gets
    ``base(r, m) / #{l' : m(l') = m}``: the base value is *shared* by the blocks that replace
    the base block (4x deeper: the first 4 scaled blocks each get ``base / 4``).
  - ``L < B``: base block ``m`` goes to scaled block ``l(m) = floor(m * L / B)`` and each scaled
    tensor gets the *sum* ``sum_{m : l(m) = l} base(r, m)``.

  Either way the targets of the scaled tensors answering to a base tensor sum to its value
  (conservation), so every role keeps its total FSLR. Tensors outside blocks (embeddings,
  readout, final norm) map one to one by name.
- :func:`equal`: the paper's first ablation: every base tensor gets ``total / n_base``, then
  shared over depth as :func:`share_blocks` does (embedding and readout keep their value).
- :func:`equal_all`: the paper's second ablation: every scaled tensor gets
  ``total / n_scaled`` (embedding and readout shrink as depth grows).

Examples:
    >>> base = {"embed.weight": 1.0, "blocks.0.lin.weight": 0.4, "blocks.1.lin.weight": 0.2,
    ...         "head.weight": 0.5}
    >>> scaled = ["embed.weight"] + [f"blocks.{i}.lin.weight" for i in range(4)] + ["head.weight"]
    >>> apply("share_blocks", base, scaled)  # doctest: +NORMALIZE_WHITESPACE
    {'embed.weight': 1.0, 'blocks.0.lin.weight': 0.2, 'blocks.1.lin.weight': 0.2,
     'blocks.2.lin.weight': 0.1, 'blocks.3.lin.weight': 0.1, 'head.weight': 0.5}
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import SupportsFloat, TypeAlias, cast

from ..probe.names import short_lists
from .block_sharing import equal, equal_all, share_blocks
from .policy_base import DEFAULT_PATTERN, Policy, check_unique, identity, same_names

__all__ = [
    "DEFAULT_PATTERN",
    "POLICIES",
    "Policy",
    "PolicySpec",
    "apply",
    "counterparts",
    "describe",
    "equal",
    "equal_all",
    "identity",
    "is_one_to_one",
    "resolve",
    "share_blocks",
]


# ---------------------------------------------------------------------------------- resolve / apply

POLICIES: dict[str, Callable[[], Policy]] = {
    "identity": lambda: identity,
    "share_blocks": share_blocks,
    "equal": equal,
    "equal_all": equal_all,
}
"""Policy names accepted by :func:`resolve`, with the factory building each (defaults)."""

_FACTORIES = (share_blocks, equal, equal_all)


def is_one_to_one(policy: Policy) -> bool:
    """Whether ``policy`` maps each scaled tensor to the base tensor of the same name.

    A policy declares it with an attribute ``one_to_one = True`` (:func:`identity` does); FLeRM
    then matches a base record of a subset of the model on that subset, and checks tensor ranks.

    Examples:
        >>> is_one_to_one(identity), is_one_to_one(equal())
        (True, False)
    """
    return getattr(policy, "one_to_one", False) is True


def counterparts(
    policy: Policy, base: Iterable[str], scaled: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    """The base tensors whose values ``policy`` maps onto each scaled tensor.

    A policy declares them with an attribute ``counterparts(base, scaled)``: :func:`identity`
    (the tensor of the same name), :func:`share_blocks` and :func:`equal` (the base block a
    scaled block answers to, several for a shallower model). For any other policy a tensor's
    counterpart is the base tensor of its name, where there is one. FLeRM compares a tensor's
    feature gain with its counterparts' (``match="features"``, ``"features_all"``).

    Returns:
        Scaled name -> base names, for the scaled tensors that have counterparts.

    Raises:
        ValueError: a policy's ``counterparts`` that does not return a mapping of scaled
            tensor names to sequences of base tensor names (each named).

    Examples:
        >>> counterparts(share_blocks(), ["blocks.0.w", "head"], ["blocks.0.w", "blocks.1.w", "head"])
        {'blocks.0.w': ('blocks.0.w',), 'blocks.1.w': ('blocks.0.w',), 'head': ('head',)}
        >>> counterparts(lambda base, scaled: {}, ["w", "v"], ["w", "u"])
        {'w': ('w',)}
    """  # noqa: E501
    own = getattr(policy, "counterparts", None)
    if not callable(own):
        return same_names(base, scaled)
    base, scaled = list(base), list(scaled)
    result = own(base, scaled)
    who = f"policy {describe(policy)}: counterparts"
    if not isinstance(result, Mapping):
        raise ValueError(f"{who} returned {type(result).__name__}, expected a dict")
    known, names = set(base), set(scaled)
    bad = [
        f"{n!r}: {v!r}"
        for n, v in result.items()
        if n not in names
        or isinstance(v, str)
        or not isinstance(v, Sequence)
        or not all(isinstance(b, str) and b in known for b in v)
    ]
    if bad:
        raise ValueError(
            f"{who} must map scaled tensor names to sequences of base tensor names; "
            f"wrong: {', '.join(bad[:5])}"
        )
    return {str(n): tuple(v) for n, v in result.items()}


PolicySpec: TypeAlias = str | Policy | Callable[[], Policy] | None
"""What :func:`resolve` and :func:`apply` accept: a name, a policy, a factory, or ``None``."""


def describe(policy: Policy) -> str:
    """A name of ``policy`` that is the same in every process: its ``__qualname__``, else its
    ``repr`` without memory addresses (a callable object, a ``functools.partial``). Messages
    show it, and a saved FLeRM state is compared on it when it is loaded.

    Examples:
        >>> import functools
        >>> describe(identity), describe(functools.partial(identity))
        ('identity', 'functools.partial(<function identity>)')
    """
    name = getattr(policy, "__qualname__", None)
    return name if isinstance(name, str) else re.sub(r" at 0x[0-9a-fA-F]+", "", repr(policy))


def resolve(policy: PolicySpec) -> Policy:
    """Turn a policy name, a policy or ``None`` into a policy.

    ``None`` is :func:`identity`; ``"identity"``, ``"share_blocks"``, ``"equal"`` and
    ``"equal_all"`` build the policy with default arguments (so does passing the factory itself,
    e.g. ``share_blocks`` instead of ``share_blocks()``); any other callable is returned as is.

    Raises:
        ValueError: for an unknown name or a non-callable, listing the valid names.

    Examples:
        >>> resolve(None) is identity, resolve("equal_all").__name__
        (True, 'equal_all(total=1.0)')
    """
    if policy is None:
        return identity
    if isinstance(policy, str):
        factory = POLICIES.get(policy)
        if factory is None:
            raise ValueError(
                f"unknown policy {policy!r}: valid names are {list(POLICIES)}, or pass a "
                "callable(base, scaled) -> dict[str, float]"
            )
        return factory()
    if any(policy is f for f in _FACTORIES):
        return cast(Callable[[], Policy], policy)()
    if callable(policy):
        return cast(Policy, policy)
    raise ValueError(
        f"policy must be None, one of {list(POLICIES)} or a callable(base, scaled) -> "
        f"dict[str, float]; got {policy!r} ({type(policy).__name__})"
    )


def apply(
    policy: PolicySpec,
    base: Mapping[str, float],
    scaled: Iterable[str],
    *,
    allow_zero: bool = False,
) -> dict[str, float]:
    """Call a policy and validate its result.

    Args:
        policy: anything :func:`resolve` accepts.
        base: base tensor name -> base FSLR at the current step.
        scaled: the scaled model's trainable tensor names.
        allow_zero: accept targets of exactly 0 (a base tensor that did not move the function
            at that step, e.g. LoRA A while B is still zero); FLeRM holds such tensors at their
            current rate instead of dividing by them.

    Returns:
        Scaled name -> target FSLR, in ``scaled`` order, as floats.

    Raises:
        ValueError: if the policy does not return a mapping, misses scaled names, adds names
            that are not in the scaled model, or gives a value that is not a finite number
            ``> 0`` (``>= 0`` with ``allow_zero``; each offending tensor is named).

    Examples:
        >>> apply(lambda base, scaled: {n: 2 * base[n] for n in scaled}, {"w": 0.5}, ["w"])
        {'w': 1.0}
        >>> apply(lambda base, scaled: {"w": 0.0}, {"w": 0.5}, ["w"])
        Traceback (most recent call last):
        ...
        ValueError: policy <lambda> gave targets that are not finite numbers > 0: 'w' = 0.0
    """
    p = resolve(policy)
    names = list(scaled)
    check_unique(names)
    who = f"policy {describe(p)}"
    try:
        result = p(base, list(names))  # a copy: a policy that edits it cannot escape the checks
    except Exception as err:
        err.add_note(
            f"(raised by {who}, called with {len(base)} base and {len(names)} scaled names)"
        )
        raise
    if not isinstance(result, Mapping):
        raise ValueError(
            f"{who} returned {type(result).__name__}, expected a dict of scaled tensor name -> "
            "target FSLR"
        )
    name_set = set(names)
    missing = [n for n in names if n not in result]
    extra = [str(n) for n in result if n not in name_set]
    if missing or extra:
        listed = short_lists(
            ("scaled tensors without a target", missing), ("names not in the scaled model", extra)
        )
        raise ValueError(f"{who} returned wrong tensor names: {listed}")
    out: dict[str, float] = {}
    bad: list[str] = []
    for n in names:
        value: object = result[n]
        try:
            x = (
                float(value)
                if isinstance(value, SupportsFloat) and not isinstance(value, bool)
                else math.nan
            )
        except (TypeError, ValueError, RuntimeError):
            x = math.nan
        if not (math.isfinite(x) and (x > 0 or (allow_zero and x == 0))):
            bad.append(f"{n!r} = {value!r}")
        out[n] = x
    if bad:
        shown = ", ".join(bad[:10]) + (f", ... ({len(bad) - 10} more)" if len(bad) > 10 else "")
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{who} gave targets that are not finite numbers {bound}: {shown}")
    return out
