"""A plain training loop with two hooks, so FSLR measurement and FLeRM plug in without a rewrite.

:func:`train` runs ``steps`` optimiser steps and returns the per-step losses. Two optional hooks:

- ``around_step(step)`` returns a context manager entered around ``optimizer.step()``: FLeRM or
  an FSLR recorder snapshots the parameters on entry and measures the update on exit.
- ``on_step(step, model, optimizer)`` is called after every step (logging, periodic FLeRM
  updates, schedulers).

:func:`last_mean` is the paper's metric: the training loss averaged over the last batches, with
a diverged run scoring ``inf``.

:func:`make_optimizer` and :func:`make_schedule` build the optimisers of the paper's appendix
(Adam, AdamW, SGD with momentum, sign-SGD, Adagrad, Adamax) and the schedules (constant,
cosine, warm-up + cosine) a sweep names.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "AroundStep",
    "LossFn",
    "OnStep",
    "SignSGD",
    "last_mean",
    "lm_loss",
    "make_optimizer",
    "make_schedule",
    "train",
]

OPTIMIZERS = ("adam", "adamw", "sgd", "signsgd", "adagrad", "adamax")
"""Optimisers a sweep can name (:func:`make_optimizer`)."""
SCHEDULES = ("constant", "cosine", "warmup_cosine")
"""Learning-rate schedules a sweep can name (:func:`make_schedule`)."""
SGD_MOMENTUM = 0.9
"""Momentum of ``"sgd"``."""
WARMUP_FRACTION = 0.1
"""Fraction of the steps that ``"warmup_cosine"`` warms up over."""

LossFn = Callable[[Tensor, Tensor], Tensor]
"""``loss_fn(output, target) -> scalar tensor``."""
OnStep = Callable[[int, nn.Module, torch.optim.Optimizer], None]
"""``on_step(step, model, optimizer)``, called after ``optimizer.step()``."""
AroundStep = Callable[[int], contextlib.AbstractContextManager[Any]]
"""``around_step(step)`` -> a context manager wrapping ``optimizer.step()``."""


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy for ``(..., vocab)`` logits and matching integer targets.

    Examples:
        >>> round(lm_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)).item(), 4)
        1.3863
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class SignSGD(torch.optim.Optimizer):
    r"""Sign gradient descent: :math:`W \leftarrow W - \eta (\operatorname{sign}(g) + \lambda W)`.

    Examples:
        >>> w = nn.Parameter(torch.tensor([1.0, -2.0]))
        >>> w.grad = torch.tensor([0.3, -5.0])
        >>> SignSGD([w], lr=0.5).step()
        >>> w.data
        tensor([ 0.5000, -1.5000])
    """

    def __init__(self, params: Any, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One step with each group's ``lr`` and ``weight_decay``."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign() + group["weight_decay"] * p, alpha=-group["lr"])


def make_optimizer(
    name: str, params: Any, lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """The optimiser ``name`` of :data:`OPTIMIZERS` over ``params`` (tensors or param groups).

    ``"sgd"`` has momentum :data:`SGD_MOMENTUM`; ``weight_decay`` is decoupled for AdamW and
    added to the gradient (or, for sign-SGD, to the step) for the others. Param groups keep
    their own ``lr`` and ``weight_decay``.

    Examples:
        >>> type(make_optimizer("adamw", nn.Linear(2, 2).parameters(), 0.1, 0.01)).__name__
        'AdamW'
    """
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, weight_decay=weight_decay)
    if name == "signsgd":
        return SignSGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    if name == "adamax":
        return torch.optim.Adamax(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def _schedule_factor(name: str, steps: int, t: int) -> float:
    """The schedule's ratio to the initial rate at step ``t``.

    Examples:
        >>> [round(_schedule_factor("warmup_cosine", 20, t), 3) for t in (0, 1, 2, 11, 19)]
        [0.5, 1.0, 1.0, 0.5, 0.008]
    """
    warm = max(1, round(WARMUP_FRACTION * steps)) if name == "warmup_cosine" else 0
    if t < warm:
        return (t + 1) / warm
    return 0.5 * (1.0 + math.cos(math.pi * (t - warm) / max(1, steps - warm)))


def make_schedule(
    optimizer: torch.optim.Optimizer, name: str, steps: int
) -> torch.optim.lr_scheduler.LambdaLR | None:
    r"""The schedule ``name`` of :data:`SCHEDULES` over ``steps`` steps (``None``: constant).

    ``"cosine"``: :math:`\eta_t = \eta \, \tfrac12 (1 + \cos(\pi t / T))`;
    ``"warmup_cosine"``: linear warm-up over the first :data:`WARMUP_FRACTION` of the steps,
    then a cosine to zero over the rest. Every param group is scaled by the same ratio. Call
    its ``step()`` after each ``optimizer.step()``.

    Examples:
        >>> opt = make_optimizer("adam", nn.Linear(2, 2).parameters(), 1.0)
        >>> sched = make_schedule(opt, "cosine", 4)
        >>> [round(sched.lr_lambdas[0](t), 3) for t in range(4)]
        [1.0, 0.854, 0.5, 0.146]
    """
    if name == "constant":
        return None
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: _schedule_factor(name, steps, t))


def train(
    model: nn.Module,
    batches: Iterable[tuple[Any, Tensor]],
    optimizer: torch.optim.Optimizer,
    steps: int,
    loss_fn: LossFn = F.cross_entropy,
    *,
    on_step: OnStep | None = None,
    around_step: AroundStep | None = None,
    stop_on_divergence: bool = True,
) -> list[float]:
    """Train ``model`` for ``steps`` optimiser steps and return the per-step training losses.

    Each step: ``loss = loss_fn(model(*inputs), target)``, backward, then ``optimizer.step()``
    inside ``around_step(step)`` when given, then ``on_step(step, model, optimizer)``. ``inputs``
    may be a tensor or a tuple of positional arguments.

    Args:
        model: the network (put in train mode).
        batches: iterable of ``(inputs, target)``; it must yield at least ``steps`` items.
        optimizer: any ``torch.optim`` optimiser over the model's parameters.
        steps: number of optimiser steps.
        loss_fn: ``loss_fn(output, target)``; cross-entropy by default (see :func:`lm_loss`).
        on_step: called after each step with ``(step, model, optimizer)``.
        around_step: factory of a context manager entered around ``optimizer.step()``.
        stop_on_divergence: stop at the first non-finite loss (which is still recorded), so a
            diverged run costs little; :func:`last_mean` then returns ``inf``.

    Returns:
        Losses of the steps run, ``len == steps`` unless the run diverged and was stopped.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(4, 3)
        >>> data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))] * 50
        >>> seen = []
        >>> losses = train(model, data, torch.optim.Adam(model.parameters(), lr=0.05), 50,
        ...                on_step=lambda step, m, o: seen.append(step))
        >>> len(losses), losses[-1] < losses[0], seen[-1]
        (50, True, 49)
    """
    model.train()
    losses: list[float] = []
    it = iter(batches)
    for step in range(steps):
        try:
            inputs, target = next(it)
        except StopIteration:
            raise ValueError(f"batches ran out after {step} of {steps} steps") from None
        optimizer.zero_grad(set_to_none=True)
        if isinstance(inputs, dict):
            output = model(**inputs)
        else:
            output = model(*(inputs if isinstance(inputs, tuple) else (inputs,)))
        loss = loss_fn(output, target)
        value = loss.item()
        losses.append(value)
        if stop_on_divergence and not math.isfinite(value):
            break
        loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch
        ctx = around_step(step) if around_step is not None else contextlib.nullcontext()
        with ctx:
            optimizer.step()
        if on_step is not None:
            on_step(step, model, optimizer)
    return losses


def last_mean(losses: Sequence[float], k: int) -> float:
    """Mean of the last ``k`` losses (the paper's metric); ``inf`` if any is non-finite.

    A run stopped early by divergence ends in a non-finite loss, so it scores ``inf``.

    Args:
        losses: per-step losses, e.g. from :func:`train`.
        k: window length; the whole list if shorter.

    Examples:
        >>> last_mean([4.0, 3.0, 2.0, 1.0], 2)
        1.5
        >>> last_mean([1.0, float("nan")], 10)
        inf
    """
    if not losses:
        raise ValueError("no losses")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an int >= 1 (the window's length), got {k!r}")
    tail = list(losses[-k:])
    if not all(math.isfinite(v) for v in tail):
        return math.inf
    return sum(tail) / len(tail)
