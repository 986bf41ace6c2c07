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

Example:
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
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, SupportsFloat, TypeAlias, cast

from ..probe.names import BLOCK_PATTERN, compile_block_pattern, short_list

__all__ = [
    "DEFAULT_PATTERN",
    "POLICIES",
    "Policy",
    "PolicySpec",
    "apply",
    "equal",
    "equal_all",
    "identity",
    "resolve",
    "share_blocks",
]

DEFAULT_PATTERN = BLOCK_PATTERN
"""Default block regex: group 1 is the block index (``blocks.3.``, ``layers.0.``, ``h.11.``)."""


class Policy(Protocol):
    """A depth-mapping policy: ``policy(base, scaled) -> targets``.

    Args:
        base: base tensor name -> base FSLR at the current step.
        scaled: the scaled model's trainable tensor names, in ``named_parameters()`` order.

    Returns:
        Scaled tensor name -> target FSLR (finite, ``> 0``) for every name in ``scaled``.
    """

    def __call__(self, base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
        """Map every scaled tensor to its target FSLR."""
        ...


def _check_unique(scaled: Sequence[str]) -> None:
    dup = [n for n, c in Counter(scaled).items() if c > 1]
    if dup:
        raise ValueError(f"scaled tensor names must be unique; repeated: {short_list(dup)}")


def _check_total(total: float) -> float:
    t = float(total)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"total must be a finite number > 0, got {total!r}")
    return t


def _named(
    fn: Callable[[Mapping[str, float], Sequence[str]], dict[str, float]], name: str
) -> Policy:
    fn.__name__ = fn.__qualname__ = name
    return fn


# ---------------------------------------------------------------------------------- identity


def identity(base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
    """One-to-one policy: ``target_W = base_W`` for tensors with the same name.

    For width, initialisation-scale or LoRA-rank scaling, where base and scaled models have the
    same tensor names.

    Raises:
        ValueError: listing the scaled tensors missing from the base record and the base
            tensors absent from the scaled model (a record from another architecture).

    Example:
        >>> identity({"w": 0.5, "b": 0.1}, ["w", "b"])
        {'w': 0.5, 'b': 0.1}
        >>> identity({"w": 0.5}, ["w", "v"])
        Traceback (most recent call last):
        ...
        ValueError: identity policy: the base record and the scaled model have different tensors: scaled tensors missing from the base record: ['v']; base tensors absent from the scaled model: []. Is the record from another architecture? For depth scaling use policy='share_blocks' or a custom callable.
    """  # noqa: E501
    _check_unique(scaled)
    missing = [n for n in scaled if n not in base]
    scaled_set = set(scaled)
    extra = [n for n in base if n not in scaled_set]
    if missing or extra:
        raise ValueError(
            "identity policy: the base record and the scaled model have different tensors: "
            f"scaled tensors missing from the base record: {short_list(missing)}; "
            f"base tensors absent from the scaled model: {short_list(extra)}. Is the record from "
            "another architecture? For depth scaling use policy='share_blocks' or a custom "
            "callable."
        )
    return {n: float(base[n]) for n in scaled}


identity.one_to_one = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------- share_blocks


class _Layout:
    """Tensor names split into block-less names and (stack, block index, suffix) triples."""

    def __init__(self, names: Iterable[str], rx: re.Pattern[str]) -> None:
        self.plain: list[str] = []
        self.blocks: dict[str, set[int]] = {}  # stack prefix -> block indices
        self.tensors: dict[tuple[str, int, str], str] = {}  # (stack, index, suffix) -> name
        self.roles: dict[tuple[str, str], str] = {}  # (stack, suffix) -> first name with it
        for name in names:
            m = rx.search(name)
            if m is None:
                self.plain.append(name)
                continue
            start, end = m.span(1)
            try:
                index = int(name[start:end])
            except ValueError:
                raise ValueError(
                    f"block pattern {rx.pattern!r}: group 1 must capture the block index, but in "
                    f"{name!r} it captured {name[start:end]!r}"
                ) from None
            stack, suffix = name[:start], name[end:]
            self.blocks.setdefault(stack, set()).add(index)
            self.tensors[(stack, index, suffix)] = name
            self.roles.setdefault((stack, suffix), name)


def _role(stack: str, suffix: str) -> str:
    return f"{stack}*{suffix}"


def _block_pairs(n_base: int, n_scaled: int) -> list[tuple[int, int]]:
    """(scaled position, base position) pairs of a stack; see the module docstring."""
    if n_scaled >= n_base:
        return [(ll, ll * n_base // n_scaled) for ll in range(n_scaled)]
    return [(m * n_scaled // n_base, m) for m in range(n_base)]


def _share(
    base: Mapping[str, float], scaled: Sequence[str], rx: re.Pattern[str], who: str
) -> dict[str, float]:
    _check_unique(scaled)
    b, s = _Layout(base, rx), _Layout(scaled, rx)
    problems: list[str] = []

    missing_plain = [n for n in s.plain if n not in base]
    scaled_plain = set(s.plain)
    extra_plain = [n for n in b.plain if n not in scaled_plain]
    if missing_plain:
        problems.append(
            "scaled tensors outside blocks missing from the base record: "
            f"{short_list(missing_plain)}"
        )
    if extra_plain:
        problems.append(
            f"base tensors outside blocks absent from the scaled model: {short_list(extra_plain)}"
        )
    missing_roles = [f"{_role(*r)} (e.g. {n!r})" for r, n in s.roles.items() if r not in b.roles]
    extra_roles = [f"{_role(*r)} (e.g. {n!r})" for r, n in b.roles.items() if r not in s.roles]
    if missing_roles:
        problems.append(
            f"scaled block tensors whose role is not in the base record: {missing_roles}"
        )
    if extra_roles:
        problems.append(
            f"base block tensors whose role is absent from the scaled model: {extra_roles}"
        )

    targets: dict[str, float] = {n: float(base[n]) for n in s.plain if n in base}
    if not problems:
        # pairs (scaled tensor, base tensor) with, for each base tensor, its multiplicity
        links: list[tuple[str, str]] = []
        unmatched_scaled: list[str] = []
        unmatched_base: list[str] = []
        for stack in s.blocks:
            b_idx, s_idx = sorted(b.blocks[stack]), sorted(s.blocks[stack])
            suffixes = [suf for (st, suf) in s.roles if st == stack]
            for pos_l, pos_m in _block_pairs(len(b_idx), len(s_idx)):
                for suf in suffixes:
                    sn = s.tensors.get((stack, s_idx[pos_l], suf))
                    bn = b.tensors.get((stack, b_idx[pos_m], suf))
                    if sn is not None and bn is not None:
                        links.append((sn, bn))
                    elif sn is not None:
                        unmatched_scaled.append(
                            f"{sn!r} (base block {b_idx[pos_m]} of {_role(stack, '')!r} has no "
                            f"{_role(stack, suf)!r})"
                        )
                    elif bn is not None:
                        unmatched_base.append(
                            f"{bn!r} (scaled block {s_idx[pos_l]} of {_role(stack, '')!r} has "
                            f"no {_role(stack, suf)!r})"
                        )
        if unmatched_scaled:
            problems.append(f"scaled tensors with no base counterpart: {unmatched_scaled[:10]}")
        if unmatched_base:
            problems.append(f"base tensors with no scaled counterpart: {unmatched_base[:10]}")
        multiplicity = Counter(bn for _, bn in links)
        for sn, bn in links:
            targets[sn] = targets.get(sn, 0.0) + float(base[bn]) / multiplicity[bn]
    if problems:
        raise ValueError(
            f"{who}: the base record does not match the scaled model (block pattern "
            f"{rx.pattern!r}): " + "; ".join(problems) + ". Use a record of the same "
            "architecture, a block pattern that matches your block names, or a custom policy."
        )
    return {n: targets[n] for n in scaled}


def share_blocks(pattern: str | re.Pattern[str] = DEFAULT_PATTERN) -> Policy:
    """Depth-scaling policy: share each base block's FSLRs among the scaled blocks replacing it.

    Names are split by ``re.search(pattern, name)``: group 1 of the first match is the block
    index; the name with it replaced by ``*`` is the tensor's *role* and the part before it its
    *stack* (so ``encoder.layers.*`` and ``decoder.layers.*`` scale independently). With ``B``
    base and ``L`` scaled blocks in a stack (ranked by index):

    - ``L >= B``: scaled block ``l`` answers to base block ``m = floor(l * B / L)`` and gets
      ``base / multiplicity``, multiplicity being the number of scaled blocks answering to
      ``m`` (``floor(L/B)`` or ``ceil(L/B)``); ``L == B`` is the identity.
    - ``L < B``: scaled block ``l`` gets the *sum* of the base blocks ``m`` with
      ``floor(m * L / B) = l``.

    The targets answering to one base tensor sum to its value in both cases. Names without a
    block index map one to one.

    Args:
        pattern: regex whose group 1 captures the block index.

    Returns:
        A :class:`Policy`. It raises ValueError naming the tensors when block-less names,
        roles, or per-block tensors do not correspond.

    Example:
        >>> p = share_blocks()
        >>> base = {"layers.0.w": 0.6, "layers.1.w": 0.3}
        >>> p(base, ["layers.0.w", "layers.1.w", "layers.2.w"])  # B=2, L=3
        {'layers.0.w': 0.3, 'layers.1.w': 0.3, 'layers.2.w': 0.3}
        >>> p(base, ["layers.0.w"])  # B=2, L=1: the sum
        {'layers.0.w': 0.8999999999999999}
    """
    rx = compile_block_pattern(pattern)
    name = f"share_blocks(pattern={rx.pattern!r})"

    def policy(base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
        return _share(base, scaled, rx, name)

    return _named(policy, name)


# ---------------------------------------------------------------------------------- ablations


def equal(total: float = 1.0, *, pattern: str | re.Pattern[str] = DEFAULT_PATTERN) -> Policy:
    """Ablation 1 of the paper: equal base FSLRs, still shared over depth.

    Every base tensor gets ``total / n_base`` (their sum is ``total``; the recorded values are
    ignored, only the base names are used), then :func:`share_blocks` with ``pattern`` maps them
    to the scaled model: embedding and readout keep ``total / n_base`` as depth grows and the
    scaled targets still sum to ``total``.

    Example:
        >>> p = equal()
        >>> base = {"emb": 9.0, "blocks.0.w": 9.0, "blocks.1.w": 9.0, "head": 9.0}
        >>> p(base, ["emb", "blocks.0.w", "blocks.1.w", "blocks.2.w", "blocks.3.w", "head"])
        {'emb': 0.25, 'blocks.0.w': 0.125, 'blocks.1.w': 0.125, 'blocks.2.w': 0.125, 'blocks.3.w': 0.125, 'head': 0.25}
    """  # noqa: E501
    t = _check_total(total)
    rx = compile_block_pattern(pattern)
    name = f"equal(total={t!r}, pattern={rx.pattern!r})"

    def policy(base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
        if not base:
            raise ValueError(f"{name}: the base record has no tensors")
        value = t / len(base)
        return _share(dict.fromkeys(base, value), scaled, rx, name)

    return _named(policy, name)


def equal_all(total: float = 1.0) -> Policy:
    """Ablation 2 of the paper: all scaled tensors equal, summing to ``total``.

    ``target_W = total / n_scaled`` for every scaled tensor. The base record is ignored
    entirely (no name check), so embedding and readout shrink as the model gets deeper.

    Example:
        >>> equal_all()({}, ["a", "b", "c", "d"])
        {'a': 0.25, 'b': 0.25, 'c': 0.25, 'd': 0.25}
    """
    t = _check_total(total)
    name = f"equal_all(total={t!r})"

    def policy(base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
        _check_unique(scaled)
        return dict.fromkeys(scaled, t / len(scaled)) if scaled else {}

    return _named(policy, name)


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

    Example:
        >>> is_one_to_one(identity), is_one_to_one(equal())
        (True, False)
    """
    return getattr(policy, "one_to_one", False) is True


PolicySpec: TypeAlias = str | Policy | Callable[[], Policy] | None
"""What :func:`resolve` and :func:`apply` accept: a name, a policy, a factory, or ``None``."""


def resolve(policy: PolicySpec) -> Policy:
    """Turn a policy name, a policy or ``None`` into a policy.

    ``None`` is :func:`identity`; ``"identity"``, ``"share_blocks"``, ``"equal"`` and
    ``"equal_all"`` build the policy with default arguments (so does passing the factory itself,
    e.g. ``share_blocks`` instead of ``share_blocks()``); any other callable is returned as is.

    Raises:
        ValueError: for an unknown name or a non-callable, listing the valid names.

    Example:
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

    Example:
        >>> apply(lambda base, scaled: {n: 2 * base[n] for n in scaled}, {"w": 0.5}, ["w"])
        {'w': 1.0}
        >>> apply(lambda base, scaled: {"w": 0.0}, {"w": 0.5}, ["w"])
        Traceback (most recent call last):
        ...
        ValueError: policy <lambda> gave targets that are not finite numbers > 0: 'w' = 0.0
    """
    p = resolve(policy)
    names = list(scaled)
    _check_unique(names)
    who = f"policy {getattr(p, '__qualname__', None) or repr(p)}"
    result = p(base, names)
    if not isinstance(result, Mapping):
        raise ValueError(
            f"{who} returned {type(result).__name__}, expected a dict of scaled tensor name -> "
            "target FSLR"
        )
    name_set = set(names)
    missing = [n for n in names if n not in result]
    extra = [str(n) for n in result if n not in name_set]
    if missing or extra:
        raise ValueError(
            f"{who} returned wrong tensor names: scaled tensors without a target: "
            f"{short_list(missing)}; names not in the scaled model: {short_list(extra)}"
        )
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
