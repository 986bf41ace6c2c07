r"""The learning rate in force for each tensor, when FLeRM scales updates.

FLeRM leaves the optimiser's param groups at their own rates :math:`\eta_g` and scales each
tensor's update by :math:`c_W = \eta_W / \eta_g` after the step
(:mod:`fslr_func.training.update_scaling`). The factors it applies are published here, per
optimiser (:class:`Scaling`), so that whatever else needs a tensor's rate reads
:func:`rates_in_force`: a :class:`~fslr_func.training.recorder.Recorder` of a FLeRM-driven run
records FLeRM's rates, and a measurement divides the update by the rate it was taken at
(:class:`ScaledSince`), in whichever order the two are nested or attached.

Examples:
    >>> import torch
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> scaling_registry()[opt] = Scaling(factors={id(net.weight): 3.0})
    >>> {n: round(r, 6) for n, r in rates_in_force(net, opt).items()}
    {'weight': 0.3, 'bias': 0.1}
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ScaledSince",
    "Scaling",
    "group_lr",
    "group_rates",
    "initial_lr",
    "rates_in_force",
    "scaling_of",
    "scaling_registry",
    "when_final",
]


def group_lr(group: dict[str, Any]) -> float:
    """A param group's learning rate as a Python float (a tensor rate is read once).

    Examples:
        >>> group_lr({"lr": torch.tensor(0.5)})
        0.5
    """
    lr = group["lr"]
    return float(lr.item() if isinstance(lr, Tensor) else lr)


def initial_lr(group: dict[str, Any]) -> Any:
    """The group's ``initial_lr``, set to its current rate where no scheduler set one
    (``ReduceLROnPlateau``, a group added after the scheduler was built). A tensor rate is
    copied, as torch's schedulers do: the plateau scheduler cuts ``lr`` in place, and an
    ``initial_lr`` that were the same tensor would follow it (a ratio of 1 forever).

    Examples:
        >>> group = {"lr": torch.tensor(0.5)}
        >>> initial_lr(group) is group["lr"], float(group["initial_lr"])
        (False, 0.5)
    """
    if "initial_lr" not in group:
        lr = group["lr"]
        group["initial_lr"] = lr.clone() if isinstance(lr, Tensor) else lr
    return group["initial_lr"]


@dataclass
class Scaling:
    r"""The factors :math:`c_W = \eta_W / \eta_g` applied to one optimiser's updates.

    Attributes:
        factors: ``id(parameter)`` -> :math:`c_W` in force (absent: 1).
        applied: how many steps were scaled so far (a measurement compares it before and after
            its step to know whether the update it sees is already scaled).
        open: a step is under way whose factors may still change (FLeRM's set point).
        waiting: called once, in order, when the open step's factors are final.
    """

    factors: dict[int, float] = field(default_factory=dict)
    applied: int = 0
    open: bool = False
    waiting: list[Callable[[], None]] = field(default_factory=list)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickle) keeps the step count only: its factors are keyed
        by the original parameters' ``id`` and are published again at the copy's next step."""
        return {"factors": {}, "applied": self.applied, "open": False, "waiting": []}

    def when_final(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once this step's factors are final: now, or when the step closes."""
        if self.open:
            self.waiting.append(fn)
        else:
            fn()

    def close(self) -> None:
        """The step's factors are final: run what waited for them."""
        self.open = False
        waiting, self.waiting = self.waiting, []
        for fn in waiting:
            fn()


_SCALINGS: weakref.WeakKeyDictionary[torch.optim.Optimizer, Scaling] = weakref.WeakKeyDictionary()


def scaling_registry() -> weakref.WeakKeyDictionary[torch.optim.Optimizer, Scaling]:
    """The :class:`Scaling` of every optimiser FLeRM drives (weakly keyed by the optimiser)."""
    return _SCALINGS


def scaling_of(optimizer: torch.optim.Optimizer) -> Scaling | None:
    """The :class:`Scaling` of an optimiser FLeRM drives, or ``None``."""
    return _SCALINGS.get(optimizer)


def when_final(optimizers: Sequence[torch.optim.Optimizer], fn: Callable[[], None]) -> None:
    """Call ``fn`` once the rates of this step are final for every optimiser: now, or when the
    last FLeRM step under way on them (:attr:`Scaling.open`) closes."""
    open_ = [s for o in optimizers if (s := scaling_of(o)) is not None and s.open]
    remaining = [len(open_)]

    def one_closed() -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            fn()

    if not open_:
        fn()
    for scaling in open_:
        scaling.when_final(one_closed)


def group_rates(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    named: Mapping[str, Tensor] | None = None,
) -> dict[str, float]:
    """The rate of the param group holding each trainable named parameter of ``model`` that
    the optimiser updates (any group layout; parameters it does not hold are left out).

    Examples:
        >>> net = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD([{"params": [net.weight], "lr": 0.1},
        ...                        {"params": [net.bias], "lr": 0.2}])
        >>> group_rates(net, opt)
        {'weight': 0.1, 'bias': 0.2}

    ``named``: ``dict(model.named_parameters())`` where the caller has it (one walk of the
    module less).
    """
    params = model.named_parameters() if named is None else named.items()
    names = {id(p): n for n, p in params if p.requires_grad}
    return {
        names[id(p)]: group_lr(group)
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) in names
    }


def rates_in_force(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    named: Mapping[str, Tensor] | None = None,
    held: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Each parameter's learning rate: its group's, times FLeRM's factor where FLeRM drives
    the optimiser (:class:`Scaling`).

    Examples:
        >>> net = torch.nn.Linear(2, 1)
        >>> rates_in_force(net, torch.optim.SGD(net.parameters(), lr=0.1))
        {'weight': 0.1, 'bias': 0.1}

    ``named`` (``dict(model.named_parameters())``) and ``held`` (:func:`group_rates` of the
    same) spare walks of the module where the caller has them.
    """
    rates = dict(group_rates(model, optimizer, named) if held is None else held)
    scaling = scaling_of(optimizer)
    if scaling is None:
        return rates
    params = model.named_parameters() if named is None else named.items()
    ids = {n: id(p) for n, p in params}
    return {n: lr * scaling.factors.get(ids[n], 1.0) for n, lr in rates.items()}


class ScaledSince:
    """Which of some optimisers' updates FLeRM has scaled since this object was made: a
    measurement made around a step uses it to divide each update by the rate it was taken at.

    Args:
        optimizers: the optimisers of the step.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._start = [(o, s.applied if (s := scaling_of(o)) else 0) for o in optimizers]

    def rates(
        self,
        model: nn.Module,
        lrs: Mapping[str, float],
        named: Mapping[str, Tensor] | None = None,
    ) -> dict[str, float]:
        """``lrs`` (group rates) of the tensors whose update was scaled since, times the factor
        applied; tensors not scaled since are left out. ``named``: ``model``'s
        ``dict(named_parameters())`` where the caller has it."""
        out: dict[str, float] = {}
        for optimizer, applied in self._start:
            scaling = scaling_of(optimizer)
            if scaling is None or scaling.applied == applied:
                continue
            if named is None:
                named = dict(model.named_parameters())
            ids = {n: id(p) for n, p in named.items()}
            for n in group_rates(model, optimizer, named):
                if n in lrs:
                    out[n] = lrs[n] * scaling.factors.get(ids[n], 1.0)
        return out
