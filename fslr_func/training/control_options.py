"""Options shared by :class:`~fslr_func.training.recorder.Recorder` and :class:`~fslr_func.training.flerm.FLeRM`.

Both take optimisers (unwrapped from ``accelerate`` and Lightning), an optional scheduler of
one of them and an optional ``log_fn``, validated here at construction; both save their
options with their state, and :func:`check_state` refuses to load a state saved with other
options (naming the option) unless asked not to.

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> optimizers_of(opt) == [opt], optimizers_of(None)
    (True, [])
    >>> check_state({"version": 2, "config": {"every": 5}}, "FLeRM", (2,), {"every": 10}, True)
    Traceback (most recent call last):
    ...
    ValueError: this FLeRM state was saved with every=5, but this FLeRM has every=10: build it with the same options, or load_state_dict(state, strict=False) to override
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .step_hooks import unwrap_optimizer, unwrap_scheduler

__all__ = ["check_log_fn", "check_scheduler", "check_state", "optimizers_of"]


def optimizers_of(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> list[torch.optim.Optimizer]:
    """One optimiser, several, or none, as a list of unwrapped ``torch.optim`` optimisers.

    Raises:
        TypeError: something that is not an optimiser (the message says what was given).
        ValueError: the same optimiser twice.
    """
    if optimizer is None:
        return []
    given = [optimizer] if not isinstance(optimizer, Sequence) else list(optimizer)
    out = [unwrap_optimizer(o) for o in given]
    for o in out:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim optimiser or a list of them, got "
                f"{type(o).__name__}"
            )
    if len({id(o) for o in out}) < len(out):
        raise ValueError("the same optimiser is given twice: give each optimiser once")
    return out


def check_scheduler(scheduler: Any, optimizers: Sequence[torch.optim.Optimizer]) -> Any:
    """The (unwrapped) scheduler, checked to schedule one of ``optimizers``.

    Raises:
        TypeError: not a ``torch.optim.lr_scheduler`` scheduler.
        ValueError: a scheduler of another optimiser.
    """
    if scheduler is None:
        return None
    inner = unwrap_scheduler(scheduler)
    if not isinstance(inner, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            "scheduler must be a torch.optim.lr_scheduler scheduler, got "
            f"{type(scheduler).__name__}"
        )
    if optimizers and unwrap_optimizer(inner.optimizer) not in optimizers:
        raise ValueError(
            "scheduler must be a scheduler of this optimizer (the one given as optimizer=, "
            "wrappers such as accelerate's AcceleratedOptimizer count as the optimiser inside)"
        )
    return inner


def check_log_fn(
    log_fn: Callable[[int, dict[str, float]], None] | None,
) -> Callable[[int, dict[str, float]], None] | None:
    """``log_fn`` itself, checked to be ``None`` or callable.

    Raises:
        TypeError: not callable.
    """
    if log_fn is not None and not callable(log_fn):
        raise TypeError(
            f"log_fn must be a callable log_fn(step, scalars) or None, got {type(log_fn).__name__}"
        )
    return log_fn


def check_state(
    state: Mapping[str, Any],
    what: str,
    versions: Sequence[int],
    config: Mapping[str, Any],
    strict: bool,
) -> None:
    """Check a saved state's version and, if ``strict``, that it was saved with ``config``.

    Args:
        state: the saved state (a dict with ``version`` and, from version 2, ``config``).
        what: the class name, for messages.
        versions: the state versions this class reads.
        config: the loading object's options.
        strict: compare the options; ``False`` loads a state of other options anyway.

    Raises:
        ValueError: an unreadable version, or the first option that differs.
    """
    if not isinstance(state, Mapping) or state.get("version") not in versions:
        raise ValueError(f"this {what} state was saved by an incompatible fslr_func version")
    saved = state.get("config")
    if not strict or saved is None:
        return
    for key, value in config.items():
        if key in saved and saved[key] != value:
            raise ValueError(
                f"this {what} state was saved with {key}={saved[key]!r}, but this {what} has "
                f"{key}={value!r}: build it with the same options, or "
                "load_state_dict(state, strict=False) to override"
            )
