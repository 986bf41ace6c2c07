r"""FSDP2 models (``fully_shard``) for the data-parallel probe: their parameters, unsharded.

Under FSDP2 every parameter is a DTensor holding this rank's dim-0 shard, and the module's
forward hooks all-gather the shards before each layer runs and free them after. A functional
probe cannot run through those hooks: they would put FSDP's own unsharded parameters back in
place of the ones :func:`torch.func.functional_call` substitutes, so the probe's gradients would
be taken with respect to tensors the forward never used (every FSLR exactly 0).

:func:`gathered` therefore, for the duration of one probe, replaces every DTensor parameter by
its full value (``DTensor.full_tensor()``: one all-gather per tensor, the same all-gathers FSDP's
forward performs), switches FSDP's forward hooks off, and gathers the update ``delta`` the same
way. The model is then a plain module on every rank, holding the same full parameters, and the
data-parallel probe (:class:`fslr_func.distributed.DataParallelReduction`: each rank its shard of
the probe batch, the per-sample gradients all-reduced) gives every rank the FSLRs of the global
batch, equal up to float rounding to one process on the concatenated batch. On exit the
sharded parameters and the hooks are back exactly as they were.

Memory: during the probe every rank holds the full parameters at the probed point and the full
update (two copies of the model's parameters) besides the probe's own per-chunk gradients,
which are full-size on every rank as under DDP. Bound the latter with ``chunk_size``.

Examples:
    Under ``torchrun --nproc-per-node=2 train.py``, with the process group initialised:

    >>> from torch.distributed.fsdp import fully_shard  # doctest: +SKIP
    >>> for layer in model.layers:  # doctest: +SKIP
    ...     fully_shard(layer)
    >>> fm = ff.with_fslr(fully_shard(model), samples=8, seed=0)  # doctest: +SKIP
    >>> with fm.measure(opt, probe_shard):  # doctest: +SKIP
    ...     opt.step()
    >>> fm.fslr()  # the global batch's FSLRs, identical on every rank  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..probe.functional import is_dtensor

__all__ = ["full_tensors", "gathered", "is_fully_sharded", "unsharded"]


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2 ``fully_shard``).

    Examples:
        >>> is_fully_sharded(torch.nn.Linear(2, 2))
        False
    """
    return any(is_dtensor(p) for p in model.parameters())


def full_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every DTensor in ``tensors`` as its full (unsharded) value; other tensors as they are.

    The all-gathers run in sorted name order, so ranks holding the same names stay in step
    whatever the order of their dicts.

    Examples:
        >>> full_tensors({"w": torch.ones(2)})
        {'w': tensor([1., 1.])}
    """
    full = {n: _full(tensors[n]) for n in sorted(tensors)}
    return {n: full[n] for n in tensors}


def _full(t: Tensor) -> Tensor:
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.full_tensor()  # type: ignore[attr-defined, no-any-return]


def _fsdp_hook_ids(model: nn.Module) -> set[int]:
    """Ids of the forward (pre-)hooks that ``fully_shard`` registered on ``model``'s modules."""
    from torch.distributed.fsdp import FSDPModule

    ids: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            state = module._get_fsdp_state()
            handles = (state._pre_forward_hook_handle, state._post_forward_hook_handle)
            for handle in handles:
                ids.update(h.id for h in getattr(handle, "handles", (handle,)))
        except AttributeError as err:
            raise RuntimeError(
                f"cannot find the forward hooks of FSDP2 in this torch version "
                f"({torch.__version__}): {err}. The probe needs them off to run the model on "
                f"unsharded parameters; please report this"
            ) from err
    return ids


@contextlib.contextmanager
def _hooks_off(model: nn.Module, ids: set[int]) -> Iterator[None]:
    """Remove the forward hooks with these ids from ``model``'s modules; put them back after."""
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if ids.intersection(hooks):
                saved.append((hooks, dict(hooks)))
                for i in ids.intersection(hooks):
                    del hooks[i]
    try:
        yield
    finally:
        for hooks, before in saved:
            added = {k: v for k, v in hooks.items() if k not in before}
            hooks.clear()
            hooks.update(before)
            hooks.update(added)


@contextlib.contextmanager
def unsharded(model: nn.Module, values: Mapping[str, Tensor] | None = None) -> Iterator[set[str]]:
    """Inside the block, ``model``'s DTensor parameters are full plain parameters.

    Every DTensor parameter is replaced by an ``nn.Parameter`` holding its full value (or the
    full value of ``values[name]``, e.g. the weights before an optimiser step), with the same
    ``requires_grad``; tied parameters stay tied, and FSDP2's forward hooks are off, so a
    forward computes the model at exactly these tensors without any collective. Must be entered
    on every rank (the all-gathers are collectives). A model without DTensor parameters is left
    as it is.

    Args:
        model: a module, possibly with FSDP2-sharded parameters.
        values: name -> value (DTensor or full tensor) to put in place of that parameter.

    Yields:
        The names (as in ``named_parameters()``) of the parameters that were replaced.
    """
    given = values or {}
    full: dict[int, nn.Parameter] = {}
    names: set[str] = set()
    for name, p in model.named_parameters():  # the same order on every rank
        if is_dtensor(p):
            value = _full(given.get(name, p)).detach()
            full[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            names.add(name)
    if not full:
        yield names
        return
    slots = [
        (module, key, p)
        for module in model.modules()
        for key, p in module._parameters.items()
        if p is not None and id(p) in full
    ]
    try:
        for module, key, p in slots:
            module._parameters[key] = full[id(p)]
        with _hooks_off(model, _fsdp_hook_ids(model)):
            yield names
    finally:
        for module, key, p in slots:
            module._parameters[key] = p


@contextlib.contextmanager
def gathered(
    model: nn.Module, delta: Mapping[str, Tensor], params: Mapping[str, Tensor] | None
) -> Iterator[tuple[Mapping[str, Tensor], Mapping[str, Tensor] | None]]:
    """The arguments of a probe of ``model`` at ``params``, unsharded for the block's duration.

    Inside the block the model is :func:`unsharded` at ``params`` (where given) and the
    yielded ``(delta, params)`` are the full update and whatever of ``params`` is left to pass
    to the probe (those entries that were not sharded parameters; ``None`` if none). For a model
    without DTensor parameters both are yielded unchanged and nothing is gathered.

    Args:
        model: the module to probe.
        delta: name -> unit-learning-rate update (DTensor shards or full tensors).
        params: name -> the values to probe at, or ``None`` for the current parameters.
    """
    with unsharded(model, params) as replaced:
        if not replaced:
            yield delta, params
            return
        rest = {n: v for n, v in (params or {}).items() if n not in replaced}
        yield full_tensors(delta), rest or None
