r"""Parameter names: block indices, and the prefixes that model wrappers add.

A tensor inside a stack of residual blocks has the block's index in its name
(``blocks.3.lin.weight``, ``layers.0.attn.q.weight``, ``h.11.mlp.c_fc.weight``);
:data:`BLOCK_PATTERN` finds it (group 1), :func:`block_index` reads it.

Wrappers rename every tensor of the model they wrap: ``torch.compile`` prefixes
``_orig_mod.``, ``DistributedDataParallel``/``DataParallel`` (and ``with_fslr``'s own
``state_dict``) ``module.``. The *bare* name is the name in the model inside all wrappers.
Records, FLeRM and ``FSLRModule.state_dict`` meet on bare names:

- where the model is at hand, only the prefixes of wrapper *objects* are removed
  (:func:`unwrapped`), so a submodule of your own called ``module`` (``module.weight``,
  ``blocks.0.module.weight``) keeps its name;
- a record's names (no model to ask) are read by :func:`recorded_names`: as they are if the
  record shares a name with the model, else with one leading ``_orig_mod.`` or ``module.``
  removed from each, repeatedly, until it does. Only *leading* prefixes are removed, except
  the names that wrappers of submodules insert (:data:`SUBMODULE_WRAPPERS`), matched on both
  sides wherever they stand.

Examples:
    >>> block_index("model.layers.12.mlp.up_proj.weight"), block_index("lm_head.weight")
    (12, None)
    >>> short_list(["a", "b", "c"], limit=2)
    "['a', 'b', ... (1 more)]"
    >>> recorded_names(["module._orig_mod.0.weight"], ["0.weight", "0.bias"])
    {'module._orig_mod.0.weight': '0.weight'}
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

__all__ = [
    "BLOCK_PATTERN",
    "SUBMODULE_WRAPPERS",
    "WRAPPER_PREFIXES",
    "block_index",
    "block_role",
    "compile_block_pattern",
    "recorded_names",
    "short_list",
    "short_lists",
    "unwrapped",
]

WRAPPER_PREFIXES = ("_orig_mod.", "module.")
"""The prefixes wrappers add: ``torch.compile``'s, then data parallelism's (and ``with_fslr``'s)."""

SUBMODULE_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
"""The names that wrappers of *submodules* insert inside a tensor's name: activation
checkpointing's ``checkpoint_wrapper`` (``apply_activation_checkpointing``, the FSDP recipe)
and ``torch.compile`` of a block assigned back (``blocks[0] = torch.compile(blocks[0])``).
No module of a model's own is called either, so they are removed wherever they stand."""

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


def block_role(name: str, pattern: re.Pattern[str] = _DEFAULT) -> str:
    """``name`` with its block index replaced by ``*``: the tensor's role in its stack of blocks
    (``name`` itself outside the blocks).

    Args:
        name: a ``named_parameters()`` name.
        pattern: a compiled block pattern (:func:`compile_block_pattern`).

    Examples:
        >>> block_role("blocks.7.lin.weight"), block_role("readout.bias")
        ('blocks.*.lin.weight', 'readout.bias')
    """
    match = pattern.search(name)
    return name if match is None else f"{name[: match.start(1)]}*{name[match.end(1) :]}"


def short_list(names: Iterable[str], limit: int = 10) -> str:
    """``['a', 'b', ... (N more)]``: at most ``limit`` names, for error messages."""
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"[{shown}{more}]"


def short_lists(*lists: tuple[str, Sequence[str]]) -> str:
    """``"what: ['a', ...]; other: [...]"`` for the ``(what, names)`` pairs that have names:
    the two sides of a name mismatch, never an empty ``[]``.

    Examples:
        >>> short_lists(("missing", ["v"]), ("extra", []))
        "missing: ['v']"
    """
    return "; ".join(f"{what}: {short_list(names)}" for what, names in lists if names)


def _wrapped(model: nn.Module, compiled: bool, data_parallel: bool) -> tuple[nn.Module, str] | None:
    """The module one wrapper layer holds and the prefix it adds, or ``None`` for no wrapper."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded by torch.compile only
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if compiled and optimized is not None and isinstance(model, optimized):
        inner, prefix = getattr(model, "_orig_mod", None), WRAPPER_PREFIXES[0]
    elif data_parallel and isinstance(model, (DistributedDataParallel, DataParallel)):
        inner, prefix = model.module, WRAPPER_PREFIXES[1]
    else:
        return None
    return (inner, prefix) if isinstance(inner, nn.Module) else None


def unwrapped(
    model: nn.Module, *, compiled: bool = True, data_parallel: bool = True
) -> tuple[nn.Module, str]:
    """The bare model inside (nested) wrappers, and the prefix they add to its names.

    Args:
        model: any module.
        compiled: look through ``torch.compile``'s ``OptimizedModule`` (``_orig_mod.``).
        data_parallel: look through ``DistributedDataParallel``/``DataParallel`` (``module.``).

    Returns:
        ``(bare, prefix)``: every name of ``model`` is ``prefix`` + the bare model's name.

    Examples:
        >>> lin = nn.Sequential(nn.Linear(2, 2))
        >>> unwrapped(nn.DataParallel(lin)) == (lin, "module."), unwrapped(lin) == (lin, "")
        (True, True)
    """
    prefix = ""
    while (layer := _wrapped(model, compiled, data_parallel)) is not None:
        model, prefix = layer[0], prefix + layer[1]
    return model, prefix


def _strip_one(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _without_submodule_wrappers(name: str) -> str:
    """``name`` without the :data:`SUBMODULE_WRAPPERS` segments, wherever they stand."""
    dropped = {wrapper.rstrip(".") for wrapper in SUBMODULE_WRAPPERS}
    return ".".join(part for part in name.split(".") if part not in dropped)


def recorded_names(recorded: Iterable[str], model: Iterable[str]) -> dict[str, str]:
    """A record's tensor names read as the bare names of ``model``'s tensors.

    The record is taken as it is if one of its names is a name of ``model``; otherwise one
    leading ``_orig_mod.`` or ``module.`` is removed from every name that has one, and again,
    until one is, or no name has such a prefix left (the policy then reports the mismatch).
    Names are compared whole, so a block inside a stack (``blocks.0.module.weight``) is never
    touched, and a record of a model whose own top-level submodule is called ``module`` keeps
    that name when the scaled model has it too. A recorded name that is still not the
    model's is then matched without the :data:`SUBMODULE_WRAPPERS` segments on either side,
    so a record of a model without activation-checkpoint wrappers drives one with them
    (``layers.0._checkpoint_wrapped_module.attn.weight``), and the other way round.

    Args:
        recorded: the record's names (any wrapper's form).
        model: the scaled model's bare names.

    Returns:
        Recorded name -> the name to match against ``model``.

    Raises:
        ValueError: two recorded names read as one.

    Examples:
        >>> recorded_names(["_orig_mod.w", "_orig_mod.b"], ["w", "b"])
        {'_orig_mod.w': 'w', '_orig_mod.b': 'b'}
        >>> recorded_names(["module.w"], ["module.w"])  # a submodule called ``module``
        {'module.w': 'module.w'}
        >>> recorded_names(["layers.0.w"], ["layers.0._checkpoint_wrapped_module.w"])
        {'layers.0.w': 'layers.0._checkpoint_wrapped_module.w'}
    """
    names = list(recorded)
    known = set(model)
    read = list(names)
    while not known.intersection(read) and any(_strip_one(n) != n for n in read):
        read = [_strip_one(n) for n in read]
    unwrapped_known: dict[str, list[str]] = {}
    for name in known:
        unwrapped_known.setdefault(_without_submodule_wrappers(name), []).append(name)
    for i, name in enumerate(read):
        same = unwrapped_known.get(_without_submodule_wrappers(name), [])
        if name not in known and len(same) == 1:
            read[i] = same[0]
    by_read: dict[str, list[str]] = {}
    for name, bare in zip(names, read, strict=True):
        by_read.setdefault(bare, []).append(name)
    clash = [same for same in by_read.values() if len(same) > 1]
    if clash:
        raise ValueError(
            f"the record's names {clash[:5]} read as one tensor once their wrapper prefixes "
            f"({', '.join(WRAPPER_PREFIXES)}) are removed: record the bare model"
        )
    return dict(zip(names, read, strict=True))
