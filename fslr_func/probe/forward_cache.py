"""What a probe's forward structure decided, kept per model for the next probe of the same
model and shapes: the readout layer, that no probed tensor is cut out of the graph, names and
shapes, and the path the samples took (:class:`KnownForward`), under a key of everything it
depends on (:func:`probe_signature`), weakly (a model that goes away takes its entries with
it). :func:`forget` drops them.

Examples:
    >>> import torch
    >>> from fslr_func.probe.options import ProbeOptions
    >>> model = torch.nn.Linear(3, 2)
    >>> delta = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    >>> key = probe_signature(model, torch.randn(4, 3), delta, None, ProbeOptions())
    >>> remember(model, key, KnownForward("", {}, {}, "loop"))
    >>> known(model, key).strategy
    'loop'
    >>> forget(model)
    >>> known(model, key) is None
    True
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ..stats.estimator import ReadoutRole
from .functional import Inputs
from .options import ProbeOptions, Strategy

__all__ = [
    "KNOWN_PER_MODEL",
    "KnownForward",
    "forget",
    "known",
    "probe_signature",
    "remember",
]


@dataclass(frozen=True)
class KnownForward:
    """What an earlier probe found about a model for one :func:`probe_signature`.

    Attributes:
        readout_module: the readout module's name, or ``None``.
        readout: readout tensor names -> ``"weight"`` or ``"bias"``.
        views: tensor name -> the shape ``Z`` is viewed as.
        strategy: the path the samples took (``"vmap"``, ``"loop"`` or ``"autograd"``).
        num_outputs: the elements of the flat output (0: not known).
        output_dtype: the output's dtype.
        output_device: the output's device (``None``: not known).
        splittable: whether the backward may be split at the readout
            (:mod:`fslr_func.probe.split_head`): ``False`` once a forward's output was not
            the readout's own.
    """

    readout_module: str | None
    readout: dict[str, ReadoutRole]
    views: dict[str, tuple[int, ...]]
    strategy: Strategy
    num_outputs: int = 0
    output_dtype: torch.dtype = torch.float32
    output_device: torch.device | None = None
    splittable: bool = True


KNOWN_PER_MODEL = 64
"""Signatures remembered per model, the least recently used forgotten first: probe batches of
varying sequence lengths (dynamic padding) each have one, and a miss re-runs the checks (1.5x
a probe; with 8, nine lengths in turn missed every time)."""

_known: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, KnownForward]] = (
    weakref.WeakKeyDictionary()
)


def _tensors_key(tensors: Mapping[str, Tensor]) -> tuple[Hashable, ...]:
    return tuple((n, t.shape, t.dtype, t.device, t.layout) for n, t in tensors.items())


def _leaf_key(leaf: object) -> Hashable:
    if isinstance(leaf, Tensor):
        return ("tensor", leaf.shape, leaf.dtype, leaf.device, leaf.layout, leaf.requires_grad)
    hash(leaf)  # an unhashable argument: TypeError, and no signature
    return (type(leaf), leaf)


_FLAGS = (bool, int, float, str, type(None), enum.Enum)


def _module_key(name: str, module: nn.Module) -> Hashable:
    own_forward = module.__dict__.get("forward")  # a forward patched onto the instance
    return (
        name,
        type(module),
        id(module),
        module.training,
        tuple(module._forward_hooks),
        tuple(module._forward_pre_hooks),
        None if own_forward is None else id(own_forward),
        # Plain attributes a forward may branch on (use_reentrant, gradient_checkpointing,
        # an Enum mode).
        tuple((k, v) for k, v in module.__dict__.items() if isinstance(v, _FLAGS)),
    )


def probe_signature(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    params: Mapping[str, Tensor] | None,
    options: ProbeOptions,
) -> Hashable | None:
    """What a probe's structural checks depend on, as a hashable key; ``None``: do not cache.

    The key holds every parameter's name, identity, shape, dtype, device and
    ``requires_grad``; every submodule's name, type, identity, training mode, forward hooks,
    instance-patched ``forward`` and plain attributes (bools, numbers, strings, enums: the
    flags a forward branches on); the buffers' names, shapes and dtypes; the names,
    shapes and dtypes of ``delta`` and ``params``; the inputs' structure, and the shape,
    dtype and device of each input tensor (other arguments by value); the readout,
    ``output_fn``, grouping and strategy options; and the autocast state. A probe with the
    same key runs the same forward code on tensors of the same shapes, so the readout
    layer, the connectivity of the graph, the names and shapes, and the path the samples
    take need not be found again (:func:`prepare_vjp`). What the key cannot see is a
    forward whose graph depends on the *values* of its inputs or on state outside the model:
    :func:`forget` drops what is known about a model.

    Returns ``None`` (never cache) where an argument is not hashable or ``delta`` or
    ``params`` are not mappings of tensors (the checks then run and say what is wrong).
    """
    try:
        leaves, spec = tree_flatten(inputs)
        key = (
            spec,
            tuple(_leaf_key(leaf) for leaf in leaves),
            tuple(
                (n, id(p), p.shape, p.dtype, p.device, p.requires_grad)
                for n, p in model.named_parameters()
            ),
            tuple(_module_key(n, m) for n, m in model.named_modules()),
            tuple((n, b.shape, b.dtype, b.device) for n, b in model.named_buffers()),
            _tensors_key(delta),
            None if params is None else _tensors_key(params),
            options.readout,
            options.output_fn,
            options.grouping,
            options.strategy,
            tuple(
                (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                for device in ("cpu", "cuda")
            ),
        )
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key


def known(model: nn.Module, signature: Hashable | None) -> KnownForward | None:
    """What an earlier probe of ``model`` with ``signature`` found, or ``None``."""
    if signature is None:
        return None
    entries = _known.get(model)
    if entries is None or signature not in entries:
        return None
    entries[signature] = entries.pop(signature)  # the most recently used, forgotten last
    return entries[signature]


def remember(model: nn.Module, signature: Hashable | None, found: KnownForward) -> None:
    """Keep what a probe of ``model`` found for later probes with the same ``signature``
    (nothing if ``None``, or if its path is still undecided)."""
    if signature is None or found.strategy not in ("vmap", "loop", "autograd"):
        return
    entries = _known.setdefault(model, {})
    entries.pop(signature, None)
    entries[signature] = found
    while len(entries) > KNOWN_PER_MODEL:
        del entries[next(iter(entries))]


def forget(model: nn.Module | None = None) -> None:
    """Drop what earlier probes found about ``model`` (every model: ``None``).

    Needed only for a forward whose graph or output layer changes with something the
    signature (:func:`probe_signature`) does not hold, such as a global flag it reads.
    """
    if model is None:
        _known.clear()
    else:
        _known.pop(model, None)
