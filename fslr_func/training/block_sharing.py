"""Policies over blocks: :func:`share_blocks` (the paper's depth heuristic) and the paper's two
ablations, :func:`equal` and :func:`equal_all` (the rules: :mod:`fslr_func.training.policies`).

Examples:
    >>> base = {"blocks.0.w": 0.4, "head.w": 0.5}
    >>> share_blocks()(base, ["blocks.0.w", "blocks.1.w", "head.w"])
    {'blocks.0.w': 0.2, 'blocks.1.w': 0.2, 'head.w': 0.5}
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from ..probe.names import compile_block_pattern, short_list
from .policy_base import DEFAULT_PATTERN, Policy, check_total, check_unique, named

__all__ = ["equal", "equal_all", "share_blocks"]


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


def _links(
    base: Iterable[str], scaled: Sequence[str], rx: re.Pattern[str], who: str
) -> list[tuple[str, str]]:
    """The (scaled tensor, base tensor) pairs of the block mapping (see the module docstring):
    block-less names with themselves, each scaled block's tensors with those of the base block
    it answers to (one base block for ``L >= B``, several for ``L < B``).

    Raises:
        ValueError: naming the tensors where block-less names, roles, or per-block tensors do
            not correspond.
    """
    check_unique(scaled)
    base = list(base)
    b, s = _Layout(base, rx), _Layout(scaled, rx)
    problems: list[str] = []
    base_set = set(base)

    missing_plain = [n for n in s.plain if n not in base_set]
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

    links: list[tuple[str, str]] = [(n, n) for n in s.plain if n in base_set]
    if not problems:
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
    if problems:
        raise ValueError(
            f"{who}: the base record does not match the scaled model (block pattern "
            f"{rx.pattern!r}): " + "; ".join(problems) + ". Use a record of the same "
            "architecture, a block pattern that matches your block names, or a custom policy."
        )
    return links


def _share(
    base: Mapping[str, float], scaled: Sequence[str], rx: re.Pattern[str], who: str
) -> dict[str, float]:
    links = _links(base, scaled, rx, who)
    multiplicity = Counter(bn for _, bn in links)  # the scaled tensors sharing each base tensor
    targets: dict[str, float] = {}
    for sn, bn in links:
        targets[sn] = targets.get(sn, 0.0) + float(base[bn]) / multiplicity[bn]
    return {n: targets[n] for n in scaled}


def _counterparts(
    base: Iterable[str], scaled: Sequence[str], rx: re.Pattern[str]
) -> dict[str, tuple[str, ...]]:
    """Scaled tensor -> the base tensors it answers to (:func:`_links`), for
    :func:`fslr_func.training.policies.counterparts`."""
    out: dict[str, list[str]] = {}
    for sn, bn in _links(base, scaled, rx, f"block mapping (pattern {rx.pattern!r})"):
        out.setdefault(sn, []).append(bn)
    return {n: tuple(out[n]) for n in scaled if n in out}


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

    Examples:
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

    return named(policy, name, counterparts=lambda base, scaled: _counterparts(base, scaled, rx))


# ---------------------------------------------------------------------------------- ablations


def equal(total: float = 1.0, *, pattern: str | re.Pattern[str] = DEFAULT_PATTERN) -> Policy:
    """Ablation 1 of the paper: equal base FSLRs, still shared over depth.

    Every base tensor gets ``total / n_base`` (their sum is ``total``; the recorded values are
    ignored, only the base names are used), then :func:`share_blocks` with ``pattern`` maps them
    to the scaled model: embedding and readout keep ``total / n_base`` as depth grows and the
    scaled targets still sum to ``total``.

    Examples:
        >>> p = equal()
        >>> base = {"emb": 9.0, "blocks.0.w": 9.0, "blocks.1.w": 9.0, "head": 9.0}
        >>> p(base, ["emb", "blocks.0.w", "blocks.1.w", "blocks.2.w", "blocks.3.w", "head"])
        {'emb': 0.25, 'blocks.0.w': 0.125, 'blocks.1.w': 0.125, 'blocks.2.w': 0.125, 'blocks.3.w': 0.125, 'head': 0.25}
    """  # noqa: E501
    t = check_total(total)
    rx = compile_block_pattern(pattern)
    name = f"equal(total={t!r}, pattern={rx.pattern!r})"

    def policy(base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
        if not base:
            raise ValueError(f"{name}: the base record has no tensors")
        value = t / len(base)
        return _share(dict.fromkeys(base, value), scaled, rx, name)

    return named(policy, name, counterparts=lambda base, scaled: _counterparts(base, scaled, rx))


def equal_all(total: float = 1.0) -> Policy:
    """Ablation 2 of the paper: all scaled tensors equal, summing to ``total``.

    ``target_W = total / n_scaled`` for every scaled tensor. The base record is ignored
    entirely (no name check), so embedding and readout shrink as the model gets deeper.

    Examples:
        >>> equal_all()({}, ["a", "b", "c", "d"])
        {'a': 0.25, 'b': 0.25, 'c': 0.25, 'd': 0.25}
    """
    t = check_total(total)
    name = f"equal_all(total={t!r})"

    def policy(base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
        check_unique(scaled)
        return dict.fromkeys(scaled, t / len(scaled)) if scaled else {}

    return named(policy, name)
