r"""muP (maximal update parametrisation) for any model, as a sweep baseline: no rewrite needed.

The rules of the ``mup`` package (Yang et al., Tensor Programs V; ``MuReadout``,
``set_base_shapes``, ``MuAdam``/``MuSGD``), re-implemented without its ``torchvision``
dependency and applied to a built model in place. ``tests/experiments/test_mup.py`` checks
them against the package's per-tensor learning rates, initialisation and outputs when it is
installed.

A dimension of a tensor is *infinite* when its size differs from the same tensor's in the base
model (same name); its width multiplier is :math:`m = n / n_\text{base}`. A tensor with no base
counterpart (the extra blocks of a deeper model) is compared with its *role* in the base, the
same name in another block of its stack (``blocks.7.lin.weight`` with ``blocks.0.lin.weight``,
blocks found by :data:`fslr_func.probe.names.BLOCK_PATTERN`), so a model both wider and deeper is
muP along its width; with no such tensor it has only finite dimensions: muP scales width only.

With :math:`m_\text{in}` and :math:`m_\text{out}` the multipliers of a weight's fan-in (dim 1)
and fan-out (dim 0), 1 for a finite dimension, and :math:`m` the multiplier of the last
infinite dimension of a tensor:

- **Readout** (a linear layer with a finite fan-out and an infinite fan-in, like the package's
  ``MuReadout``): its weight and bias are multiplied by :math:`\sqrt{m}` at initialisation and
  its input by :math:`1 / m` in every forward pass (the package's default ``output_mult=1``).
- **Other linear layers and convolutions**: the bias is multiplied by
  :math:`\sqrt{m_\text{in}}` (the weight keeps its fan-in initialisation); a convolution's
  :math:`m_\text{in}` is its input channels' multiplier (its kernel dims are finite), as the
  package's ``rescale_linear_bias`` reads it for ``nn.Conv*d``.
- **Adam-like optimisers** (Adam, AdamW, Adamax, Adagrad, RMSprop, sign-SGD: entrywise
  normalised updates): a tensor with two infinite dimensions (a hidden matrix) gets
  :math:`\eta / m_\text{in}` and weight decay :math:`\lambda \, m_\text{in}`; every other
  tensor keeps :math:`\eta` and :math:`\lambda`.
- **SGD**: one infinite dimension: :math:`\eta \, m`, :math:`\lambda / m`; two:
  :math:`\eta \, m_\text{out} / m_\text{in}`, :math:`\lambda \, m_\text{in} / m_\text{out}`.

Attention logits: muP divides them by the head dimension instead of its square root; the
built-in transformer keeps its head dimension fixed (16) as it widens, so they need no change.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> def mlp(width):
    ...     return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, width),
    ...                          nn.ReLU(), nn.Linear(width, 3))
    >>> base, model = mlp(8), mlp(32)
    >>> groups = apply_mup(model, base, lr=0.01)
    >>> {g["name"]: g["lr"] for g in groups}["2.weight"]  # hidden: 0.01 / 4
    0.0025
    >>> readouts(model, base)
    {'4': 4.0}
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import torch
from torch import Tensor, nn

from ..probe.names import block_role

__all__ = [
    "ADAM_LIKE",
    "SGD_LIKE",
    "apply_mup",
    "base_shapes",
    "mup_groups",
    "mup_init_task",
    "readouts",
    "width_mults",
]

ADAM_LIKE = ("adam", "adamw", "adamax", "adagrad", "rmsprop", "signsgd")
"""Optimisers (by the sweeps' names) that muP treats like Adam: entrywise normalised updates."""
SGD_LIKE = ("sgd",)
"""Optimisers muP treats like SGD."""

Mults = dict[str, tuple[float | None, ...]]
"""Per tensor, per dimension: the width multiplier ``n / n_base``, ``None`` for a finite one."""


def _role_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape of each role's first tensor among ``shapes``."""
    roles: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        roles.setdefault(block_role(name), shape)
    return roles


def width_mults(model: nn.Module, base: nn.Module | Mapping[str, Any]) -> Mults:
    """The width multiplier of every dimension of every parameter (``None``: finite).

    Args:
        model: the scaled model.
        base: the base model, or its parameter shapes by name.

    Examples:
        >>> from torch import nn
        >>> width_mults(nn.Linear(16, 3), {"weight": (3, 4), "bias": (3,)})
        {'weight': (None, 4.0), 'bias': (None,)}
    """
    shapes = (
        {n: tuple(p.shape) for n, p in base.named_parameters()}
        if isinstance(base, nn.Module)
        else {n: tuple(s) for n, s in base.items()}
    )
    roles = _role_shapes(shapes)
    out: Mults = {}
    for name, p in model.named_parameters():
        ref = shapes.get(name)
        if ref is None:
            ref = roles.get(block_role(name), tuple(p.shape))
        if len(ref) != p.dim():
            raise ValueError(f"{name}: base shape {list(ref)} vs {list(p.shape)}: another rank")
        out[name] = tuple(None if b == n else n / b for b, n in zip(ref, p.shape, strict=True))
    return out


def _main(mults: tuple[float | None, ...]) -> float:
    """The multiplier of the last infinite dimension (the package's ``InfShape.width_mult``)."""
    return next((m for m in reversed(mults) if m is not None), 1.0)


def _lr_factor(mults: tuple[float | None, ...], kind: Literal["adam", "sgd"]) -> float:
    r"""muP's factor on a tensor's learning rate (weight decay gets its inverse)."""
    ninf = sum(m is not None for m in mults)
    if ninf > 2:
        raise NotImplementedError(f"muP is defined for at most 2 infinite dimensions, got {ninf}")
    if kind == "adam":
        return 1.0 / _main(mults) if ninf == 2 else 1.0
    if ninf == 1:
        return _main(mults)
    if ninf == 2:
        fan_out, fan_in = (m or 1.0 for m in mults[:2])
        return fan_out / fan_in
    return 1.0


def readouts(model: nn.Module, base: nn.Module | Mapping[str, Any]) -> dict[str, float]:
    """Readout layers by module name, with their width multiplier: the linear layers whose
    fan-in is infinite and fan-out finite (the package asserts these are ``MuReadout``).

    Examples:
        >>> from torch import nn
        >>> readouts(nn.Linear(16, 3), {"weight": (3, 4), "bias": (3,)})
        {'': 4.0}
    """
    mults = width_mults(model, base)
    out: dict[str, float] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            fan_out, fan_in = _weight_mults(model, mults, name)
            if fan_out is None and fan_in is not None:
                out[name] = fan_in
    return out


def _weight_mults(model: nn.Module, mults: Mults, module: str) -> tuple[float | None, ...]:
    """The width multipliers of ``module``'s weight.

    Raises:
        ValueError: the weight is tied to another tensor (an embedding shared with the
            readout), which ``named_parameters()`` names only once: muP's rule for a shared
            readout (the package's ``MuSharedReadout``) is not implemented here.
    """
    name = f"{module}.weight" if module else "weight"
    if name in mults:
        return mults[name]
    weight = model.get_submodule(module).weight
    shared = [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight]
    raise ValueError(
        f"muP: {name} is tied to {shared[0] if shared else 'another tensor'}, and muP's rule "
        "for a shared readout is not implemented here: untie the weights, or leave muP out "
        "of the comparison"
    )


def mup_groups(
    model: nn.Module,
    base: nn.Module | Mapping[str, Any],
    lr: float,
    *,
    weight_decay: float = 0.0,
    optimizer: str = "adam",
) -> list[dict[str, Any]]:
    """One optimiser param group per trainable tensor with muP's learning rate and weight decay.

    Args:
        model: the scaled model.
        base: the base model or its parameter shapes.
        lr: the base model's learning rate.
        weight_decay: the base model's weight decay (coupled or decoupled: the package scales
            both the same way).
        optimizer: a name of :data:`ADAM_LIKE` or :data:`SGD_LIKE`.

    Returns:
        ``[{"params": [p], "name": name, "lr": ..., "weight_decay": ...}, ...]`` in
        ``named_parameters()`` order; torch optimisers keep the extra ``"name"`` key.

    Examples:
        >>> from torch import nn
        >>> [(g["name"], g["lr"]) for g in mup_groups(nn.Linear(8, 8), nn.Linear(2, 2), 1.0)]
        [('weight', 0.25), ('bias', 1.0)]
        >>> [g["lr"] for g in mup_groups(nn.Linear(8, 8), nn.Linear(2, 2), 1.0, optimizer="sgd")]
        [1.0, 4.0]
    """
    if optimizer in ADAM_LIKE:
        kind: Literal["adam", "sgd"] = "adam"
    elif optimizer in SGD_LIKE:
        kind = "sgd"
    else:
        raise ValueError(f"muP rules for {optimizer!r} unknown: one of {ADAM_LIKE + SGD_LIKE}")
    mults = width_mults(model, base)
    groups = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            f = _lr_factor(mults[name], kind)
            groups.append(
                {"params": [p], "name": name, "lr": lr * f, "weight_decay": weight_decay / f}
            )
    return groups


def _scale_input(factor: float, module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return (args[0] * factor, *args[1:])


@torch.no_grad()
def apply_mup(
    model: nn.Module,
    base: nn.Module | Mapping[str, Any],
    lr: float,
    *,
    weight_decay: float = 0.0,
    optimizer: str = "adam",
) -> list[dict[str, Any]]:
    r"""Turn a standard-parametrised ``model`` into muP in place; return its param groups.

    Does what ``MuReadout`` + ``set_base_shapes(model, base)`` do to a freshly initialised model
    (readout weight and bias times :math:`\sqrt{m}`, its input times :math:`1 / m`, other
    linear biases times :math:`\sqrt{m_\text{in}}`) and returns :func:`mup_groups`. Call it
    once, on a freshly built model. The base model is only read for its shapes. At the base
    width (every :math:`m = 1`) the model and the rates are unchanged.

    Args:
        model: the scaled model, as built (any initialisation that scales with fan-in).
        base: the base model or its parameter shapes.
        lr: the base model's learning rate.
        weight_decay: the base model's weight decay.
        optimizer: a name of :data:`ADAM_LIKE` or :data:`SGD_LIKE`.

    Returns:
        The param groups for the optimiser (:func:`mup_groups`).
    """
    heads = readouts(model, base)
    mults = width_mults(model, base)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            continue
        if name in heads:
            m = heads[name]
            module.weight.mul_(math.sqrt(m))
            if module.bias is not None:
                module.bias.mul_(math.sqrt(m))
            module.register_forward_pre_hook(functools.partial(_scale_input, 1.0 / m))
        elif module.bias is not None:
            fan_in = _weight_mults(model, mults, name)[1]
            module.bias.mul_(math.sqrt(fan_in or 1.0))
    return mup_groups(model, base, lr, weight_decay=weight_decay, optimizer=optimizer)


def base_shapes(
    build: Callable[[float, int], nn.Module], base_scale: float, seed: int
) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of ``build(base_scale, seed)``, muP's base shapes, built with
    torch's random state restored afterwards (a model built next is initialised as without it).

    Examples:
        >>> from torch import nn
        >>> base_shapes(lambda scale, seed: nn.Linear(int(2 * scale), 3), 1.0, 0)
        {'weight': (3, 2), 'bias': (3,)}
    """
    with torch.random.fork_rng():
        return {n: tuple(p.shape) for n, p in build(base_scale, seed).named_parameters()}


def _build_mup_init(
    build: Callable[[float, int], nn.Module], base_scale: float, scale: float, seed: int
) -> nn.Module:
    shapes = base_shapes(build, base_scale, seed)
    model = build(scale, seed)
    apply_mup(model, shapes, 1.0)
    return model


class _TaskLike(Protocol):
    """What :func:`mup_init_task` reads of a :class:`~fslr_func.experiments.task.Task` (a
    dataclass with a name and a model builder); typed so, this module needs no import of
    the task module, which imports the sweep configuration."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def name(self) -> str: ...

    @property
    def build(self) -> Callable[[float, int], nn.Module]: ...


_Task = TypeVar("_Task", bound=_TaskLike)


def mup_init_task(task: _Task, base_scale: float) -> _Task:
    """``task`` with muP's initialisation and readout multiplier, for FLeRM (or any optimiser)
    to set the rates: :func:`apply_mup` without its param groups, the base model being
    ``task.build(base_scale, seed)``. At ``base_scale`` the models are ``task``'s own.

    Examples:
        >>> import torch
        >>> from fslr_func.experiments.task import Task
        >>> def build(scale, seed):
        ...     return torch.nn.Sequential(torch.nn.Linear(2, int(4 * scale)),
        ...                                torch.nn.Linear(int(4 * scale), 3))
        >>> task = mup_init_task(Task("mlp", build, None, None), 1.0)
        >>> task.name, len(task.build(2.0, 0)[1]._forward_pre_hooks)
        ('mlp+mup-init', 1)
    """
    return dataclasses.replace(
        task,
        name=f"{task.name}+mup-init",
        build=functools.partial(_build_mup_init, task.build, base_scale),
    )
