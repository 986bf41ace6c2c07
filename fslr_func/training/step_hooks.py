"""Drive a per-step controller from optimiser step hooks instead of a ``with`` block.

:class:`~fslr_func.training.recorder.Recorder` and :class:`~fslr_func.training.flerm.FLeRM` work
around one
training step: their ``step()`` context manager is entered just before the optimiser updates
the weights and exited just after. :class:`StepHooks` enters and exits that same context
manager from ``torch.optim.Optimizer.register_step_pre_hook`` and
``register_step_post_hook``, so any loop or framework that calls ``optimizer.step()``
(Hugging Face ``Trainer`` and ``accelerate``, Lightning, gradient accumulation and clipping,
a ``GradScaler``) is covered without editing the loop.

A step a ``GradScaler`` skips (gradients not finite) is no step here, whatever the optimiser:
a for-loop or ``foreach`` optimiser's skipped step calls no hook, and a fused one's, which the
scaler runs with ``optimizer.found_inf`` set so that the kernel leaves weights and state as
they were, is recognised from that flag in its pre-hook and passed over (its post-hook too).
Both kinds of optimiser therefore count the same steps. The ``with controller.step():`` form
counts the same steps through :class:`StepWatch`, which watches the block's optimisers.

A step of several optimisers (Muon on the matrices, AdamW on the rest) is one *round*: the
context manager is entered at the first optimiser's pre-hook and exited once every optimiser
has stepped (a fused optimiser the scaler skipped counts as stepped: the round closes when
the others have; a non-fused one's skip calls no hook, so the round takes in that
optimiser's next step). If an ``optimizer.step()`` raises, its post-hook never runs; the
open round is then abandoned (exited with :class:`StepAborted`: nothing is recorded or
scaled) at the next pre-hook of that optimiser or at :meth:`StepHooks.detach`, whichever
comes first. Steps a controller takes itself inside a round do not start a round.

Examples:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.1)
    >>> log = []
    >>> import contextlib
    >>> @contextlib.contextmanager
    ... def step():
    ...     log.append("enter")
    ...     yield
    ...     log.append("exit")
    >>> with StepHooks(step, [opt]):
    ...     w.grad = torch.ones(2)
    ...     opt.step()
    >>> opt.step()  # detached: no hook
    >>> log
    ['enter', 'exit']
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..parallel.process_group import collective_device
from ..probe.functional import all_finite, is_dtensor

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "StepAborted",
    "StepHooks",
    "StepWatch",
    "nested_step",
    "stepping_wrapper",
    "unwrap_optimizer",
    "unwrap_scheduler",
]


class StepAborted(RuntimeError):
    """Thrown into a controller's open step when its ``optimizer.step()`` did not finish."""


_INNER = ("optimizer", "_optimizer", "base_optimizer", "_base_optimizer")
# wrappers whose step is their optimiser's step and nothing else, by (module prefix, class)
_DELEGATING = (
    ("accelerate", "AcceleratedOptimizer"),
    ("lightning", "LightningOptimizer"),
    ("pytorch_lightning", "LightningOptimizer"),
    ("lightning", "_FabricOptimizer"),
    ("lightning_fabric", "_FabricOptimizer"),
)


def _chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimisers inside it, outermost first: each level's inner one is
    its first ``torch.optim`` optimiser among :data:`_INNER`'s attributes."""
    chain = [optimizer]
    while True:
        inner = next(
            (
                o
                for o in (getattr(chain[-1], a, None) for a in _INNER)
                if isinstance(o, torch.optim.Optimizer) and o is not chain[-1]
            ),
            None,
        )
        if inner is None or any(inner is o for o in chain):
            return chain
        chain.append(inner)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim`` optimiser inside wrappers: framework wrappers and optimisers that
    step another one.

    ``accelerate``'s ``AcceleratedOptimizer`` keeps it as ``.optimizer``, Lightning's
    ``LightningOptimizer`` as ``._optimizer``, Lookahead as ``.optimizer`` (torch-optimizer)
    or ``._base_optimizer`` (timm), SAM as ``.base_optimizer``; anything else is returned as
    it is. The hooks of :class:`StepHooks` then run on the inner optimiser's own step, where
    the weights are those it steps from, whatever the wrapper does around it.

    Examples:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> class Wrapper:
        ...     optimizer = opt
        >>> unwrap_optimizer(Wrapper()) is opt, unwrap_optimizer(opt) is opt
        (True, True)
    """
    return _chain(optimizer)[-1]


def stepping_wrapper(optimizer: Any) -> str | None:
    """The class name of a wrapper around ``optimizer``'s inner optimiser whose step may do
    more than that optimiser's step (Lookahead's slow weights, SAM's perturbation), or None
    (no wrapper, or only ``accelerate``'s, Lightning's and Fabric's, which just delegate).

    Examples:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> class Lookahead:
        ...     optimizer = opt
        >>> stepping_wrapper(Lookahead()), stepping_wrapper(opt)
        ('Lookahead', None)
    """
    # Lightning and Fabric give each wrapper a class of its own (LightningAdam, FabricAdam)
    # derived from theirs: the classes it derives from tell
    return next(
        (
            type(wrapper).__name__
            for wrapper in _chain(optimizer)[:-1]
            if not any(
                cls.__module__.startswith(m) and cls.__name__ == c
                for cls in type(wrapper).__mro__
                for m, c in _DELEGATING
            )
        ),
        None,
    )


def unwrap_scheduler(scheduler: Any) -> Any:
    """The ``torch.optim.lr_scheduler`` scheduler inside ``accelerate``'s wrapper, if any.

    Examples:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> s = torch.optim.lr_scheduler.StepLR(opt, 1)
        >>> unwrap_scheduler(s) is s
        True
    """
    inner = getattr(scheduler, "scheduler", None)
    return inner if isinstance(inner, torch.optim.lr_scheduler.LRScheduler) else scheduler


def _hook_runner_code() -> Any:
    """The code object of torch's step-hook runner (``Optimizer.profile_hook_step``'s
    wrapper), or ``None`` if this torch has none."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    return getattr(wrap(lambda *a, **k: None), "__code__", None) if callable(wrap) else None


_HOOK_RUNNER = _hook_runner_code()


def nested_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this call of ``optimizer``'s step hooks is nested in another of its steps.

    torch wraps each optimiser class's ``step`` with its hook runner when the class is first
    built; a subclass whose ``step`` calls ``super().step()`` therefore runs the hooks twice,
    one call inside the other, once the parent class has been built too. Only the outer call
    is a step: this tells the inner one by finding the runner of the same optimiser twice on
    the call stack.

    Examples:
        >>> class Logged(torch.optim.SGD):
        ...     def step(self, closure=None):
        ...         return super().step(closure)
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> _ = torch.optim.SGD([w], lr=0.1)  # SGD.step wrapped too
        >>> opt = Logged([w], lr=0.1)
        >>> seen = []
        >>> _ = opt.register_step_pre_hook(lambda o, a, k: seen.append(nested_step(o)))
        >>> w.grad = torch.ones(1)
        >>> _ = opt.step()
        >>> seen
        [False, True]
    """
    if _HOOK_RUNNER is None:
        return False
    runs = 0
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _HOOK_RUNNER and frame.f_locals.get("self") is optimizer:
            runs += 1
            if runs > 1:
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _skipped_by_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` is a step a ``GradScaler`` skips inside the optimiser.

    ``GradScaler.step`` hands an optimiser that unscales in its own kernel (the fused ones:
    ``_step_supports_amp_scaling``) the count of non-finite gradients as
    ``optimizer.found_inf`` for the duration of its ``step()``; a non-zero count makes the
    kernel leave weights and state unchanged. Reading it is one device sync per step: the
    one the scaler makes itself for a non-fused optimiser, and which a fused one otherwise
    avoids (the price, on a GPU, of counting the same steps as a non-fused optimiser).

    Examples:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> _skipped_by_scaler(opt)
        False
        >>> opt.found_inf = torch.tensor(1.0)
        >>> _skipped_by_scaler(opt)
        True
    """
    found_inf = getattr(optimizer, "found_inf", None)
    return isinstance(found_inf, torch.Tensor) and bool(found_inf.item() != 0)


class _OptimizerHooks:
    """A pre- and a post-step hook (``_pre``, ``_post``) on each of some optimisers, kept
    until :meth:`close` (or the end of a ``with`` block over this object)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._hooked = list(optimizers)
        self._register()

    def _register(self) -> None:
        # run eagerly under a compiled step (torch.compile(opt.step) traces into its hooks,
        # and the probe's forward cannot be compiled there): a graph break, not an error
        pre = torch.compiler.disable(self._pre)  # type: ignore[no-untyped-call]
        post = torch.compiler.disable(self._post)  # type: ignore[no-untyped-call]
        self._handles = [
            h
            for opt in self._hooked
            for h in (opt.register_step_pre_hook(pre), opt.register_step_post_hook(post))
        ]

    def __getstate__(self) -> dict[str, Any]:
        """torch drops an optimiser's hooks when it is copied (``copy.deepcopy``, pickle);
        the copy of hooks still attached registers them again on the copied optimisers."""
        return {**vars(self), "_handles": bool(self._handles)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        attached = state.pop("_handles")
        vars(self).update(state)
        # a copy pickled before the hooked optimisers were kept here: StepHooks' own list
        self._hooked = state.get("_hooked", state.get("_optimizers", []))
        self._handles = []
        if attached:
            self._register()

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before each ``optimizer.step()``."""

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After each ``optimizer.step()`` that returned."""

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class StepHooks(_OptimizerHooks):
    """Enters ``step()`` before every round of optimiser steps and exits it after.

    Args:
        step: the controller's context-manager factory (``recorder.step``, ``flerm.step``).
        optimizers: the optimisers whose steps make up one training step.

    The hooks stay until :meth:`detach` (or the end of a ``with`` block over this object),
    which removes them and abandons a round left open by an exception.
    """

    def __init__(
        self,
        step: Callable[[], contextlib.AbstractContextManager[Any]],
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> None:
        if not optimizers:
            raise ValueError("StepHooks needs at least one optimiser to attach to")
        self._step = step
        self._optimizers = list(optimizers)
        self._open: contextlib.AbstractContextManager[Any] | None = None
        self._entered: set[int] = set()
        self._stepped: set[int] = set()
        self._skipped: set[int] = set()
        self._passed: set[int] = set()  # skipped (fused) before the round's first step
        self._nested: dict[int, int] = {}  # inner calls of an optimiser's step, still open
        self._busy = False
        super().__init__(self._optimizers)

    @property
    def attached(self) -> bool:
        """Whether the hooks are still registered."""
        return bool(self._handles)

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._busy:
            return
        key = id(optimizer)
        unfinished = self._open is not None and key in self._entered - self._stepped
        # inside this optimiser's own step (a subclass calling super().step()), or after a
        # step of it that raised: the call stack tells, read only then
        if unfinished and nested_step(optimizer):
            self._nested[key] = self._nested.get(key, 0) + 1
            return
        self._nested.pop(key, None)  # (left by an inner call that raised)
        self._skipped.discard(key)  # (left by a skipped step that raised)
        if key in self._passed:  # its next step: a new round of steps has begun
            self._passed.clear()
        if unfinished:
            warnings.warn(
                "the previous optimizer.step() did not finish (it raised): its measurement is "
                "discarded and the param groups were put back",
                RuntimeWarning,
                stacklevel=3,
            )
            self._abort()
        elif self._open is not None and key in self._stepped:
            self._close()  # another optimiser of the round was skipped: the round is over
        if _skipped_by_scaler(optimizer):
            # as a non-fused optimiser's skipped step: no step; but its turn in the round is
            # over, so the round can close when the others have stepped
            self._skipped.add(key)
            if self._open is None:
                self._passed.add(key)
                return
            self._entered.add(key)
            self._stepped.add(key)
            if len(self._stepped) == len(self._optimizers):
                self._close()
            return
        if self._open is None:
            manager = self._step()
            self._run(manager.__enter__)
            self._open = manager
            self._entered, self._stepped = set(self._passed), set(self._passed)
            self._passed.clear()
        self._entered.add(key)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._nested.get(id(optimizer)):  # the end of an inner call: not a step
            self._nested[id(optimizer)] -= 1
            return
        if id(optimizer) in self._skipped:
            self._skipped.discard(id(optimizer))
            return
        if self._busy or self._open is None:
            return
        self._stepped.add(id(optimizer))
        if len(self._stepped) == len(self._optimizers):
            self._close()

    def _run(self, fn: Callable[[], Any]) -> None:
        self._busy = True
        try:
            fn()
        finally:
            self._busy = False

    def _close(self) -> None:
        manager, self._open = self._open, None
        if manager is not None:
            self._run(lambda: manager.__exit__(None, None, None))

    def _abort(self) -> None:
        manager, self._open = self._open, None
        if manager is not None:
            err = StepAborted("optimizer.step() did not finish")
            self._run(lambda: manager.__exit__(StepAborted, err, None))

    def detach(self) -> None:
        """Remove the hooks; a round left open by an exception is abandoned (groups put back)."""
        super().close()
        self._abort()

    close = detach


class StepWatch(_OptimizerHooks):
    """Whether the optimiser steps of one ``with controller.step():`` block were skipped.

    The ``with`` form sees the block, not the step inside it; a step a ``GradScaler`` skips
    must still be no step there, as in the hooks form (:class:`StepHooks`). For the block's
    duration a pre- and a post-hook watch its optimisers, and on exit :meth:`skipped` says
    whether no optimiser stepped and a ``GradScaler`` skip is the reason:

    - a fused optimiser's skipped step runs its hooks with ``optimizer.found_inf`` set;
    - a for-loop or ``foreach`` optimiser's skipped step runs no hook at all, and the
      gradients it was not stepped on are not finite (the scaler skips for that reason
      alone; they are read only then, so ``zero_grad()`` belongs after the block); with
      FSDP2's sharded gradients the ranks agree on the answer with one all-reduce.

    A block in which no step ran and every gradient is finite (the weights were updated by
    hand, or ``optimizer.step()`` was not called) is not a skip: it counts, as before.

    Args:
        optimizers: the block's optimisers.
        group: the process group over which FSDP2 ranks agree (``None``: the default group).

    Examples:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> w.grad = torch.tensor([1.0, float("inf")])
        >>> with StepWatch([opt]) as watch:
        ...     pass  # scaler.step(opt) with this gradient does not call opt.step()
        >>> watch.skipped()
        True
        >>> w.grad = torch.ones(2)
        >>> with StepWatch([opt]) as watch:
        ...     opt.step()
        >>> watch.skipped()
        False
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], group: Any = None) -> None:
        self._group = group
        self._optimizers = optimizers
        self._called = self._ran = self._flagged = False
        super().__init__(optimizers)

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._called = True
        self._flagged = _skipped_by_scaler(optimizer)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._ran = self._ran or not self._flagged

    def skipped(self) -> bool:
        """Whether no optimiser stepped because a ``GradScaler`` skipped the step (also after
        :meth:`close`)."""
        if self._ran:
            return False
        if self._called:
            return self._flagged
        grads = [p.grad for o in self._optimizers for g in o.param_groups for p in g["params"]]
        return _any_not_finite([g for g in grads if g is not None], self._group)


def _any_not_finite(grads: Sequence[torch.Tensor], group: Any) -> bool:
    """Whether any of ``grads`` holds an inf or a NaN (across the ranks, for DTensor shards).

    Examples:
        >>> _any_not_finite([torch.ones(2), torch.tensor([float("nan")])], None)
        True
        >>> _any_not_finite([], None)
        False
    """
    sharded = any(is_dtensor(g) for g in grads)
    local = [g.to_local() if is_dtensor(g) else g for g in grads]  # type: ignore[attr-defined]
    found = not all(map(all_finite, local))  # (only read when no step ran: rare)
    if not sharded:
        return found
    flag = torch.tensor(int(found), dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
