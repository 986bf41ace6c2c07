r"""Parameter names: the block-index pattern shared by depth policies, models and plots.

A tensor inside a stack of residual blocks has the block's index in its name
(``blocks.3.lin.weight``, ``layers.0.attn.q.weight``, ``h.11.mlp.c_fc.weight``);
:data:`BLOCK_PATTERN` finds it (group 1), :func:`block_index` reads it.

Example:
    >>> block_index("model.layers.12.mlp.up_proj.weight"), block_index("lm_head.weight")
    (12, None)
    >>> short_list(["a", "b", "c"], limit=2)
    "['a', 'b', ... (1 more)]"
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["BLOCK_PATTERN", "block_index", "compile_block_pattern", "short_list"]

BLOCK_PATTERN = r"(?:^|\.)(?:blocks|layers|layer|h|block)\.(\d+)\."
"""Default block regex: group 1 is the block index (``blocks.3.``, ``layers.0.``, ``h.11.``)."""


def compile_block_pattern(pattern: str | re.Pattern[str] = BLOCK_PATTERN) -> re.Pattern[str]:
    """``pattern`` compiled, checked to have a capture group for the block index.

    Raises:
        ValueError: the pattern does not compile or has no capture group.
    """
    try:
        rx = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern)
    except re.error as err:
        raise ValueError(f"invalid block pattern {pattern!r}: {err}") from err
    if rx.groups < 1:
        raise ValueError(
            f"block pattern {rx.pattern!r} has no group: group 1 must capture the block index, "
            r"e.g. r'blocks\.(\d+)\.'"
        )
    return rx


_DEFAULT = compile_block_pattern()


def block_index(name: str, pattern: re.Pattern[str] = _DEFAULT) -> int | None:
    """The block index in a parameter name, or ``None`` outside the blocks.

    Args:
        name: a ``named_parameters()`` name.
        pattern: a compiled block pattern (:func:`compile_block_pattern`).
    """
    match = pattern.search(name)
    return int(match.group(1)) if match else None


def short_list(names: Iterable[str], limit: int = 10) -> str:
    """``['a', 'b', ... (N more)]``: at most ``limit`` names, for error messages."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"[{shown}{more}]"
