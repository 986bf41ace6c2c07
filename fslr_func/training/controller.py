r"""One probed training step at a time: the base of :class:`~fslr_func.training.recorder.Recorder`
and :class:`~fslr_func.training.flerm.FLeRM`.

Both controllers work around one ``optimizer.step()`` of a wrapped model
(:func:`fslr_func.with_fslr`): before it they decide whether this step is probed (its
:class:`~fslr_func.training.probe_schedule.ProbePlan`: an EMA warm-up of
:math:`\lceil \text{warmup\_samples} / S \rceil` probes at ``start_step``, then one probe every
``every`` steps), and if so they measure it (:meth:`FSLRModule.measure
<fslr_func.training.wrapper.FSLRModule.measure>`) on fresh probe batches
(:class:`~fslr_func.training.probe_schedule.ProbeFeed`); after it they act on the measurement
(a record row, a FLeRM set point). :class:`StepController` holds everything that is the same
for both, once:

- the options, validated at construction (:func:`optimizers_of`, :func:`check_scheduler`,
  :func:`check_log_fn`), and saved with the state, which :func:`check_state` compares on load;
- the two forms of use, ``with controller.step(): optimizer.step()`` and
  ``controller.attach()`` (the optimiser's step hooks, :mod:`fslr_func.training.step_hooks`),
  which count the same steps: a step a ``GradScaler`` skips is no step in either;
- the steps that cannot be measured, which are waited out: a probed step at which every
  learning rate is 0 (a warm-up from 0) or at which no parameter changed (no gradients, a
  skipped step) owes its probes to the next step, drawn again on the same probe batches and
  omegas, with a note the first time; a *stall*,
  probes owed for :meth:`StepController.stall_after` consecutive steps (the larger of 50 steps
  and 5 probe intervals), warns once per stall, again after the run recovered and stalled anew;
- warnings given once per cause, and the step counter and probe-batch count of the state.

A subclass says what happens around the step through five hooks: :meth:`_prepare` (before,
every step), :meth:`_plain` (a context around an unprobed step), :meth:`_measured` (after a
probed step that moved the weights), :meth:`_finish` (after, every step) and
:meth:`_abandon` (in its place after a ``with`` block whose step was skipped).

Examples:
    >>> import torch, fslr_func as ff
    >>> class Counter(StepController):
    ...     kind = "Counter"
    ...     def _measured(self, m):
    ...         self.seen.append((self.t, sorted(m.read().values)))
    >>> fm = ff.with_fslr(torch.nn.Linear(3, 2), samples=2, seed=0)
    >>> opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    >>> ctl = Counter(fm, [torch.randn(4, 3)], opt, warmup_samples=2, every=2, start_step=0)
    >>> ctl.seen = []
    >>> for _ in range(3):
    ...     fm(torch.randn(4, 3)).sum().backward()
    ...     with ctl.step():
    ...         opt.step()
    >>> ctl.seen, ctl.t
    ([(0, ['bias', 'weight']), (2, ['bias', 'weight'])], 3)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..parallel.process_group import raise_if_any_rank_failed
from ..probe.functional import Inputs
from ..probe.names import short_list, unwrapped
from ..stats.checks import is_integer
from .probe_schedule import ProbeFeed, ProbePlan
from .rates import rates_in_force
from .step_hooks import (
    StepHooks,
    StepWatch,
    stepping_wrapper,
    unwrap_optimizer,
    unwrap_scheduler,
)
from .wrapper import FSLRModule, Measurement

__all__ = [
    "LogFn",
    "StepController",
    "check_log_fn",
    "check_scheduler",
    "check_state",
    "fslr_module_of",
    "optimizers_of",
]

LogFn = Callable[[int, dict[str, float]], None]
"""``log_fn(step, scalars)``: receives named scalars (``fslr/<tensor>``...) at a step."""

_STATE_VERSION = 2
_STALL_STEPS = 50
"""A stall warns after at least this many consecutive steps with probes owed."""
_STALL_PROBES = 5
"""... and after at least this many probe intervals (:meth:`StepController.stall_after`)."""


def optimizers_of(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> list[torch.optim.Optimizer]:
    """One optimiser, several, or none, as a list of unwrapped ``torch.optim`` optimisers.

    Raises:
        TypeError: something that is not an optimiser (the message says what was given).
        ValueError: the same optimiser twice.

    Examples:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> optimizers_of(opt) == [opt], optimizers_of(None)
        (True, [])
    """
    out = [unwrap_optimizer(o) for o in _given(optimizer)]
    for o in out:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim optimiser or a list of them, got "
                f"{type(o).__name__}"
            )
    if len({id(o) for o in out}) < len(out):
        raise ValueError("the same optimiser is given twice: give each optimiser once")
    return out


def _stepping_wrapper_of(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> str | None:
    """:func:`~fslr_func.training.step_hooks.stepping_wrapper` of the first given optimiser
    that is one."""
    return next((w for o in _given(optimizer) if (w := stepping_wrapper(o)) is not None), None)


def _given(optimizer: Any) -> list[Any]:
    """One optimiser, several, or none (``None``), as a list of what was given."""
    if optimizer is None:
        return []
    return [optimizer] if not isinstance(optimizer, Sequence) else list(optimizer)


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


def check_log_fn(log_fn: LogFn | None) -> LogFn | None:
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

    Examples:
        >>> check_state({"version": 2, "config": {"every": 5}}, "FLeRM", (2,), {"every": 10},
        ...             True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: this FLeRM state was saved with every=5, but this FLeRM has every=10: ...
    """
    if not isinstance(state, Mapping) or state.get("version") not in versions:
        raise ValueError(f"this {what} state was saved by an incompatible fslr_func version")
    saved = state.get("config")
    if state["version"] >= 2 and not isinstance(saved, Mapping):
        raise ValueError(
            f"this {what} state has no 'config' (every state of its version has one): it is "
            "damaged or edited; load the state as it was saved"
        )
    if not strict or saved is None:
        return
    for key, value in config.items():
        if key in saved and saved[key] != value:
            raise ValueError(
                f"this {what} state was saved with {_difference(key, saved[key], value, what)}: "
                "build it with the same options, model and optimiser, or "
                "load_state_dict(state, strict=False) to override"
            )


def trainable_shapes(fm: FSLRModule) -> dict[str, list[int]]:
    """The trainable tensors' shapes by the bare model's names (those of records and states).

    Examples:
        >>> import fslr_func as ff
        >>> trainable_shapes(ff.with_fslr(torch.nn.Linear(3, 2)))
        {'weight': [2, 3], 'bias': [2]}
    """
    prefix = fm.name_prefix
    return {
        n.removeprefix(prefix): list(p.shape)
        for n, p in fm.module.named_parameters()
        if p.requires_grad
    }


def _difference(key: str, saved: Any, value: Any, what: str) -> str:
    """``key=saved``, then what this object has, in a few words (for the shapes: the first
    tensors that differ, not two whole models)."""
    if key != "shapes" or not isinstance(saved, Mapping):
        return f"{key}={saved!r}, but this {what} has {key}={value!r}"
    names = list(dict.fromkeys([*saved, *value]))
    differ = [n for n in names if saved.get(n) != value.get(n)]
    listed = "; ".join(f"{n!r}: {saved.get(n)} there, {value.get(n)} here" for n in differ[:5])
    more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
    return f"another model's tensors: {listed}{more}"


def fslr_module_of(fm: object) -> FSLRModule:
    """The :func:`~fslr_func.with_fslr` wrapper that ``fm`` is, or holds under
    ``torch.compile`` and data-parallel layers: ``torch.compile(fm)``, or ``DDP(fm)`` around
    a ``with_fslr(model, distributed=True)``.

    Raises:
        TypeError: ``fm`` is no such wrapper.
    """
    inner = unwrapped(fm)[0] if isinstance(fm, torch.nn.Module) else fm
    if not isinstance(inner, FSLRModule):
        raise TypeError(f"fm must be a with_fslr(model) wrapper, got {type(fm).__name__}")
    return inner


KEEP_BUFFERS_WITHIN = 50
"""Probe intervals (steps) below which the wrapper keeps its buffers from probe to probe
(allocating them again costs page faults, a few ms on the benchmark ResMLP); at longer
intervals, or none after the warm-up, they are freed after each probe."""


class StepController:
    """Runs the probe schedule around one optimiser step at a time; see the module docstring.

    Args:
        fm: the wrapped model (:func:`fslr_func.with_fslr`).
        probe_batches: probe inputs, separate from the training batches: an endless iterator
            or a re-iterable such as a ``DataLoader`` (cycled).
        optimizers: the optimiser(s) whose steps are controlled (``accelerate``'s and
            Lightning's wrappers are unwrapped); empty: given to each :meth:`step`.
        warmup_samples: omega samples of the EMA warm-up at ``start_step``.
        every: probe once every ``every`` steps after the warm-up; ``None``: warm-up only.
        start_step: the first probed step.
        scheduler: a ``torch.optim.lr_scheduler`` scheduler of one of the optimisers, or
            ``None``.
        log_fn: ``log_fn(step, scalars)`` or ``None``.
        config: the subclass's own options, saved with the state and compared on load.

    Attributes:
        t: index of the next training step.
        plan: the :class:`~fslr_func.training.probe_schedule.ProbePlan`.

    Raises:
        TypeError: ``fm``, ``probe_batches``, an optimiser, ``scheduler`` or ``log_fn`` of the
            wrong kind.
        ValueError: an invalid option (named).
    """

    #: The controller's name in messages and saved states.
    kind: ClassVar[str] = "StepController"
    #: The note on a step that cannot be measured (``{t}``: the step, ``{why}``: the cause).
    deferral: ClassVar[str] = (
        "{kind}: step {t} is not measured: {why}; its probes move to the next step that "
        "changes the weights"
    )

    def __init__(
        self,
        fm: FSLRModule,
        probe_batches: Iterable[Inputs],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        *,
        warmup_samples: int,
        every: int | None,
        start_step: int,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        log_fn: LogFn | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        fm = fslr_module_of(fm)
        if not isinstance(probe_batches, Iterable):
            raise TypeError(
                "probe_batches must be an iterable of probe inputs (a DataLoader, a list, a "
                f"generator), got {type(probe_batches).__name__}"
            )
        self.fm = fm
        # a DistributedFSLRModule's (read once: a missing attribute of a module is slow)
        self._distributed = bool(getattr(fm, "distributed", False))
        self._group = getattr(fm, "group", None)
        self.optimizers = optimizers_of(optimizers)
        self._wrapper = _stepping_wrapper_of(optimizers)
        self.plan = ProbePlan.of(warmup_samples, fm.samples, every, start_step)
        # checked integers, kept plain (np.int64 too): they go into states and records
        warmup_samples = int(warmup_samples)
        every, start_step = self.plan.every, self.plan.start_step
        self.scheduler = check_scheduler(scheduler, self.optimizers)
        self.log_fn = check_log_fn(log_fn)
        self._feed = ProbeFeed(probe_batches)
        self.t = 0
        self._owed = 0
        self._stalled_since: int | None = None  # first step of the current run of deferrals
        self._stall_steps = 0  # its length in steps (a skipped step too)
        self._stall_noted = False
        self._hooks: StepHooks | None = None
        self._in_round = False  # inside a step's block: another would count the step twice
        self._noted: set[str] = set()
        self._config: dict[str, Any] = {
            "warmup_samples": warmup_samples,
            "every": every,
            "start_step": start_step,
            **(config or {}),
            "scheduler": None if scheduler is None else type(self.scheduler).__name__,
            # a state is the model's and optimiser's: another width or optimiser is refused
            "shapes": trainable_shapes(fm),
            "optimizers": [type(o).__name__ for o in self.optimizers],
        }

    @property
    def probes_used(self) -> int:
        """Probe batches drawn so far."""
        return self._feed.used

    def attach(self) -> StepHooks:
        """Run every ``optimizer.step()`` from now on through :meth:`step`, by the optimiser's
        step hooks (any loop or framework: Hugging Face ``Trainer``, Lightning, a
        ``GradScaler``, whose skipped steps call no hook).

        Returns:
            The :class:`~fslr_func.training.step_hooks.StepHooks`; ``.detach()`` (or a
            ``with`` block over it) removes them.

        Raises:
            ValueError: the controller was built without an optimiser.
            RuntimeError: it is attached already (its hooks not detached): every step would
                run through it twice.
        """
        if not self.optimizers:
            raise ValueError(
                f"{self.kind}.attach() needs the optimiser: build it with optimizer=opt"
            )
        if self._hooks is not None and self._hooks.attached:
            raise RuntimeError(
                f"this {self.kind} is attached already: call .detach() on the hooks the first "
                "attach() returned before attaching again"
            )
        self._hooks = StepHooks(self._hooked_round, self.optimizers)
        return self._hooks

    def step(
        self, optimizer: torch.optim.Optimizer | None = None
    ) -> contextlib.AbstractContextManager[Measurement | None]:
        """Context manager around one ``optimizer.step()`` (nothing else in the block).

        A block whose step a ``GradScaler`` skipped (non-finite gradients) is no step, as in
        :meth:`attach`'s hooks form: ``t`` stays, FLeRM's rates are put back, a probe due moves
        to the next step (:class:`~fslr_func.training.step_hooks.StepWatch` tells).

        Args:
            optimizer: the optimiser stepped in the block; default: the one(s) given at
                construction (passing that same one is fine too).

        Yields:
            The step's :class:`~fslr_func.training.wrapper.Measurement` (filled in on exit) on
            a probed step, else ``None``.

        Raises:
            ValueError: no optimiser here or at construction, or another one than that.
            RuntimeError: the controller is attached (:meth:`attach`), whose hooks run every
                step through it already, or this block is inside another of its blocks:
                either would count each training step twice.
        """
        if self._hooks is not None and self._hooks.attached:
            raise RuntimeError(
                f"this {self.kind} is attached: its hooks already run every optimizer.step() "
                f"through it, and a `with {self.kind.lower()}.step():` block around the step "
                "would count it twice; use one form (remove the block, or .detach() the hooks)"
            )
        wrapper = self._wrapper or (_stepping_wrapper_of(optimizer) if optimizer else None)
        if wrapper is not None:
            raise ValueError(
                f"a `with {self.kind.lower()}.step():` block measures and scales what the "
                "block moves, from the weights at its start, but the optimiser is a "
                f"{wrapper}, whose step may move the weights outside the step of the optimiser "
                "it wraps (Lookahead's slow weights, SAM's perturbation): use "
                f"{self.kind.lower()}.attach() instead, whose hooks run on the inner "
                "optimiser's own step"
            )
        return self._round(self._stepped(optimizer), watched=True)

    def _hooked_round(self) -> contextlib.AbstractContextManager[Measurement | None]:
        """:meth:`step` for :class:`StepHooks`, which enters it only for steps that ran."""
        return self._round(self.optimizers, watched=False)

    @contextlib.contextmanager
    def _round(
        self, optimizers: list[torch.optim.Optimizer], *, watched: bool
    ) -> Iterator[Measurement | None]:
        """One step, probed or not; ``watched``: a ``with`` block, which is no step if the
        optimiser skipped its step and nothing moved."""
        if self._in_round:
            raise RuntimeError(
                f"{self.kind}.step() blocks cannot be nested: one block is one training step "
                "(put each optimizer.step() in one block, with nothing else in it)"
            )
        self._in_round = True
        try:
            watch = StepWatch(optimizers, self._group) if watched else None
            with watch if watch is not None else contextlib.nullcontext():
                self._prepare(optimizers)
                n = max(self.plan.probes_at(self.t), self._owed)
                if n and not any(
                    v for o in optimizers for v in rates_in_force(self.fm.module, o).values()
                ):
                    self._defer(n, "every learning rate is 0 (a warm-up from 0?)")
                    n = 0
                moved = False
                if n:
                    batches, probe_state = self._take(n), _ProbeState(self.fm)
                    try:
                        with self.fm.measure(optimizers, batches, step=self.t) as m:
                            yield m
                    except BaseException:
                        # nothing measured (an error, Ctrl-C, a step that raised): a retried
                        # or resumed step is probed on these batches, with these omegas
                        self._feed.give_back(batches)
                        probe_state.restore()
                        raise
                    moved = bool(m.moved)
                else:
                    with self._plain():
                        yield None
                skip = not moved and watch is not None and watch.skipped()
            if n and moved:
                self._owed = 0
                self._stalled_since, self._stall_steps, self._stall_noted = None, 0, False
                self._measured(m)
                if self.plan.every is None or self.plan.every >= KEEP_BUFFERS_WITHIN:
                    self.fm.release_buffers()  # two copies of the weights, not needed soon
            elif n:
                # the next step measured is probed on these batches, with these omegas
                self._feed.give_back(batches)
                probe_state.restore()
                self._defer(n, _SKIPPED if skip else _unchanged_reason(m))
            if skip:
                self._abandon()
            else:
                self._finish()
                self.t += 1
        finally:
            self._in_round = False

    # ------------------------------------------------------------------ hooks of a subclass

    def _prepare(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Before every step (default: nothing)."""

    def _plain(self) -> contextlib.AbstractContextManager[None]:
        """The context around an unprobed step (default: nothing)."""
        return contextlib.nullcontext()

    def _measured(self, m: Measurement) -> None:
        """After a probed step that changed the weights (default: nothing)."""

    def _finish(self) -> None:
        """After every step, probed or not (default: nothing)."""

    def _abandon(self) -> None:
        """After a ``with`` block whose step a ``GradScaler`` skipped, in :meth:`_finish`'s
        place: ``t`` is not advanced (default: nothing)."""

    # ------------------------------------------------------------------ shared behaviour

    def _take(self, n: int) -> list[Inputs]:
        """The step's ``n`` probe batches. Under a distributed wrapper every rank learns
        whether one rank's feed ran out, and all raise, instead of the others waiting in the
        probe's collectives for the group's timeout."""
        if not self._distributed:
            return self._feed.take(n)
        batches: list[Inputs] = []
        reason = None
        try:
            batches = self._feed.take(n)
        except ValueError as err:
            reason = str(err)
        raise_if_any_rank_failed(
            reason,
            f"{self.kind}: drawing step {self.t}'s probe batches",
            "hand every rank an endless iterator or a re-iterable (a DataLoader with a "
            "DistributedSampler) with the same number of probe batches",
            self._group,
        )
        return batches

    def _stepped(self, given: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
        """The optimisers of this step: the given one (which must be one of the controller's,
        if it has any), else the controller's."""
        if given is None:
            if not self.optimizers:
                raise ValueError(
                    f"{self.kind}.step() needs the optimiser: build the {self.kind} with "
                    "optimizer=opt or call step(opt)"
                )
            return self.optimizers
        (opt,) = optimizers_of(given)
        if self.optimizers and opt not in self.optimizers:
            raise ValueError(
                f"{self.kind}.step(optimizer) got another optimiser than the one the "
                f"{self.kind} was built with: one {self.kind} per optimiser"
            )
        return [opt]

    @property
    def stall_after(self) -> int:
        """Consecutive steps with probes owed after which a stall warns: the larger of 50
        steps and 5 probe intervals (``every``; 50 steps when there are none).

        A ``GradScaler`` skips a few steps in a row while it backs its scale off (one per
        halving), and a step at rate 0 is a warm-up's first; 50 steps without a measurement
        is none of these. Under a long probe interval a shorter gap costs no probe, so the
        warning waits until 5 probes would have been taken.
        """
        every = self.plan.every or 0
        return max(_STALL_STEPS, _STALL_PROBES * every)

    def _defer(self, n: int, why: str) -> None:
        """Owe ``n`` probes to the next step that changes the weights; warn once per stall.

        Counts steps only: whether the step moved is what :meth:`step` already read, so a
        stall costs no further synchronisation with the device.
        """
        self._owed = n
        self._note(why, self.deferral.format(kind=self.kind, t=self.t, why=why))
        if self._stalled_since is None:
            self._stalled_since = self.t
        self._stall_steps += 1
        length = self._stall_steps
        if length >= self.stall_after and not self._stall_noted:
            self._stall_noted = True
            warnings.warn(
                f"{self.kind}: no step has been measured for {length} steps (since step "
                f"{self._stalled_since}, the latest: {why}); nothing is recorded or updated "
                "until a step changes the weights. Likely causes: an optimiser state that "
                "overflowed after a huge loss or gradient (Adam's second moment at inf freezes "
                "every weight), a GradScaler that skips every step (inf or NaN gradients), a "
                "learning rate of 0, or 16-bit parameters whose updates round to nothing",
                RuntimeWarning,
                stacklevel=4,
            )

    def _note(self, key: str, message: str) -> None:
        """Warn ``message`` the first time ``key`` comes up."""
        if key not in self._noted:
            self._noted.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=5)

    def _note_each(self, names: Sequence[str], message: str) -> None:
        """Warn once per tensor: ``message`` with ``{}`` standing for the newly named ones."""
        new = [n for n in names if n not in self._noted]
        if new:
            self._noted.update(new)
            warnings.warn(message.format(new[:10]), RuntimeWarning, stacklevel=5)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Step, options, owed probes, probe-batch count and the subclass's state (save it with
        the model, the optimiser and ``fm``)."""
        return {
            "version": _STATE_VERSION,
            "config": dict(self._config),
            "t": self.t,
            "owed": self._owed,
            "stalled_since": self._stalled_since,
            "stall_steps": self._stall_steps,
            "stall_noted": self._stall_noted,
            "probes_used": self._feed.used,
            "noted": sorted(self._noted),
            **self._own_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict`; the probe iterable is fast-forwarded past used batches.

        Args:
            state: what :meth:`state_dict` returned.
            strict: refuse a state saved with other options (the first differing one named).

        Raises:
            ValueError: another version's state, or (``strict``) other options.
        """
        check_state(state, self.kind, (1, _STATE_VERSION), self._config, strict)
        # every field is checked before anything changes: a refused state leaves this as it was
        t, used = _count(state, "t", self.kind), _count(state, "probes_used", self.kind)
        owed = _count(state, "owed", self.kind, default=0)
        since = state.get("stalled_since")
        if since is not None:
            since = _count(state, "stalled_since", self.kind)
        # (a state saved without it: the stall's length in counted steps)
        stall_steps = _count(
            state, "stall_steps", self.kind, default=0 if since is None else t - since
        )
        noted = state.get("noted", state.get("warned", ()))
        if isinstance(noted, str) or not all(isinstance(n, str) for n in noted):
            raise ValueError(
                f"this {self.kind} state's 'noted' is {noted!r}, not a list of strings: it is "
                "damaged or edited; load the state as it was saved"
            )
        self._feed.check_skip(used)
        self._load_own_state(state)  # checks its own fields before it changes any
        self.t, self._owed = t, owed
        self._stalled_since, self._stall_steps = since, stall_steps
        self._stall_noted = bool(state.get("stall_noted", False))
        self._noted = set(noted)
        self._feed.skip(used)

    def _own_state(self) -> dict[str, Any]:
        """The subclass's part of :meth:`state_dict`."""
        return {}

    def _load_own_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`_own_state` (checked before anything is changed)."""


def _count(state: Mapping[str, Any], key: str, what: str, default: int | None = None) -> int:
    """``state[key]`` (``default`` where absent), a count (an int ``>= 0``), or a
    ``ValueError`` naming it.

    Examples:
        >>> _count({"t": -3}, "t", "FLeRM")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: this FLeRM state's 't' is -3, not a count (an int >= 0): it is damaged ...
    """
    value = state.get(key, default)
    if not is_integer(value) or value < 0:
        raise ValueError(
            f"this {what} state's {key!r} is {value!r}, not a count (an int >= 0): it is "
            "damaged or edited; load the state as it was saved"
        )
    return int(value)


class _ProbeState:
    """What probing a step that did not move changes in ``fm`` for nothing: its omega
    generators' states and its probe count (the EMAs keep the tensors that did not move)."""

    def __init__(self, fm: FSLRModule) -> None:
        self._fm = fm
        self._probes = fm.probes
        self._generators = {k: g.get_state() for k, g in fm.generators.items()}

    def restore(self) -> None:
        fm = self._fm
        fm.probes = self._probes
        for key in list(fm.generators):
            if key in self._generators:
                fm.generators[key].set_state(self._generators[key])
            else:  # first drawn from at this step: seeded again at the next
                del fm.generators[key]


_SKIPPED = "the optimiser skipped its step (a GradScaler found inf or NaN gradients)"


def _unchanged_reason(m: Measurement) -> str:
    """Why a measured step changed no parameter, for the note that defers its probes."""
    if m.rounded_away:
        return (
            f"no parameter changed: the updates of {short_list(list(m.rounded_away))} rounded "
            "to nothing in their 16-bit dtype (a learning rate below the parameters' "
            "precision: keep float32 parameters under autocast, or raise the rate; or the "
            "optimiser's state overflowed after a huge gradient)"
        )
    return "no parameter changed (a step skipped by a GradScaler?)"
