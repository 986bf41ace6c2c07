"""A plain training loop with two hooks, so FSLR measurement and FLeRM plug in without a rewrite.

:func:`train` runs ``steps`` optimiser steps and returns the per-step losses. Two optional hooks:

- ``around_step(step)`` returns a context manager entered around ``optimizer.step()``: FLeRM or
  an FSLR recorder snapshots the parameters on entry and measures the update on exit.
- ``on_step(step, model, optimizer)`` is called after every step (logging, periodic FLeRM
  updates, schedulers).

:func:`last_mean` is the paper's metric: the training loss averaged over the last batches, with
a diverged run scoring ``inf``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["AroundStep", "LossFn", "OnStep", "last_mean", "lm_loss", "train"]

#: ``loss_fn(output, target) -> scalar tensor``.
LossFn = Callable[[Tensor, Tensor], Tensor]
#: ``on_step(step, model, optimizer)``, called after ``optimizer.step()``.
OnStep = Callable[[int, nn.Module, torch.optim.Optimizer], None]
#: ``around_step(step)`` -> a context manager wrapping ``optimizer.step()``.
AroundStep = Callable[[int], contextlib.AbstractContextManager[Any]]


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy for ``(..., vocab)`` logits and matching integer targets.

    Example:
        >>> round(lm_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)).item(), 4)
        1.3863
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


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

    Example:
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
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*args), target)
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

    Example:
        >>> last_mean([4.0, 3.0, 2.0, 1.0], 2)
        1.5
        >>> last_mean([1.0, float("nan")], 10)
        inf
    """
    if not losses:
        raise ValueError("no losses")
    tail = list(losses[-k:])
    if not all(math.isfinite(v) for v in tail):
        return math.inf
    return sum(tail) / len(tail)
