r"""Record the FSLRs of a (base) run inside any training loop: :class:`Recorder`.

Algorithm 1 of the paper (red): around step ``t`` of the optimiser, the unit-learning-rate update
``dW = (W_after - W_before) / lr_W`` of every tensor is probed on a *fresh* probe batch (not the
training batch) and folded into the wrapper's EMAs, and

.. math::

    \mathrm{FSLR}_W(t) = \|\Delta_W f\|_\mathrm{RMS} \text{ at learning rate } 1

is appended to an :class:`~fslr_func.io.record.FSLRRecord` with the learning rates in force and the
scheduler ratio :math:`\mathrm{sched}(t) = \eta(t) / \eta_0`. The EMAs are warmed up at the first
recorded step with :math:`\lceil \text{warmup\_samples} / S \rceil` probes of the same update on
fresh batches (``S`` omega samples per probe; the paper uses 40 samples), then one probe every
``every`` steps (the paper: 100). Other steps cost nothing: no snapshot, no probe.

Examples:
    >>> import torch, fslr_func as ff
    >>> _ = torch.manual_seed(0)
    >>> fm = ff.with_fslr(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
    ...                                       torch.nn.Linear(8, 3)), samples=4, seed=0)
    >>> opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    >>> probes = [torch.randn(16, 4) for _ in range(4)]  # a re-iterable is cycled if need be
    >>> rec = ff.Recorder(fm, probes, optimizer=opt, warmup_samples=8, every=5)
    >>> for t in range(11):
    ...     opt.zero_grad()
    ...     fm(torch.randn(16, 4)).square().mean().backward()
    ...     with rec.step():
    ...         opt.step()
    >>> rec.record.steps, rec.probes_used  # 2 warm-up probes at step 0, then one per 5 steps
    ([0, 5, 10], 4)
    >>> rec.record.meta["base_lr"], rec.record.sched
    (0.01, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..io.record import FSLRRecord, grouping_meta, optimizer_meta
from ..io.record_meta import is_learning_rate
from ..probe.functional import Inputs
from ..probe.names import unwrapped
from .controller import LogFn, StepController, trainable_shapes
from .feature_gains import require_one_process, require_readout, step_gains
from .rates import group_lr, initial_lr, rates_in_force, when_final
from .update_scaling import update_rule
from .wrapper import FSLRModule, Measurement

__all__ = ["LogFn", "Recorder", "schedule_ratio"]


def schedule_ratio(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    base_lr: float,
) -> float:
    """``lr(t) / lr(0)`` of the first param group whose rate is not 0: relative to its
    ``initial_lr`` with a scheduler (set to its first rate if the scheduler sets none), else
    to ``base_lr``. A group frozen at rate 0 (an embedding) is not the run's schedule.

    Examples:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        >>> schedule_ratio(opt, None, 1.0)
        0.5
        >>> opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": 0.25})
        >>> opt.param_groups[0]["lr"] = 0.0  # the first group frozen
        >>> schedule_ratio(opt, None, 0.5)
        0.5
    """
    groups = optimizer.param_groups
    if scheduler is not None:
        # every scheduler acts on the group's rate; ReduceLROnPlateau, SequentialLR and
        # ChainedScheduler have no base_lrs of their own, and a plateau sets no initial_lr
        initial = [group_lr({"lr": initial_lr(g)}) for g in groups]
        k = next((k for k, lr in enumerate(initial) if lr), 0)
        return group_lr(groups[k]) / (initial[k] or base_lr)
    return next((lr for g in groups if (lr := group_lr(g))), 0.0) / base_lr


class Recorder(StepController):
    r"""Records a run's FSLRs into :attr:`record` from inside any training loop.

    Either attach it to the optimiser once, ``recorder.attach()`` (step hooks: every
    ``optimizer.step()`` from then on is covered, in any loop or framework), or wrap each
    step, ``with recorder.step(): optimizer.step()`` (or ``around_step=lambda t:
    recorder.step()`` with :func:`fslr_func.experiments.train`); passing the optimiser to
    each ``step(optimizer)`` instead of at construction works too. On a probed step the block
    yields the :class:`~fslr_func.training.wrapper.Measurement` and a row
    :math:`(t, \mathrm{FSLR}_W(t), \eta_W(t), \mathrm{sched}(t))` is appended to
    :attr:`record`; on other steps it yields ``None``. The schedule ratio is stored at *every*
    step (``record.meta["sched_per_step"]``), so FLeRM follows the base schedule exactly.

    Under FLeRM (any nesting, or both attached) the rates recorded are FLeRM's, as applied
    (:func:`~fslr_func.training.update_scaling.rates_in_force`). Steps that cannot be measured
    are waited out: a probed step at which every learning rate
    is 0 (a warm-up from 0) or at which no parameter changed (a step skipped by a
    ``GradScaler``) moves its probes to the next step, with a note the first time. A tensor
    frozen, without a gradient or in a group at rate 0 at a probe keeps its previous estimate
    in that row, with a note; the run goes on. A tensor without any valid estimate yet is 0
    if it did not move the function (a zero update at a rate > 0: LoRA ``A`` while ``B = 0``)
    and *unknown* (``None``, ``null`` in JSON), never 0, if the run could not measure it
    (every probe of it was not finite, its rate was 0, or its bfloat16/float16 update
    rounded to nothing although its gradient was not zero): FLeRM refuses to drive a tensor
    from an unknown value unless told how.

    Args:
        fm: the wrapped base model (:func:`fslr_func.with_fslr`), also under
            ``torch.compile`` or ``DDP`` (:func:`~fslr_func.training.controller.fslr_module_of`).
        probe_batches: probe inputs (a tensor, a tuple of positional arguments or a dict of
            keyword arguments per item), separate from the training batches: an endless
            iterator, or a re-iterable such as a ``DataLoader`` (cycled,
            :class:`~fslr_func.training.probe_schedule.ProbeFeed`).
        optimizer: the optimiser whose steps are recorded, or several stepped together
            (Muon on the matrices, AdamW on the rest: one record of the whole model);
            framework wrappers (``accelerate``, Lightning) are unwrapped. ``None``: given to
            each :meth:`step` instead.
        warmup_samples: omega samples of the EMA warm-up at ``start_step``:
            ``ceil(warmup_samples / fm.samples)`` probes of that step's update on fresh batches.
        every: probe once every ``every`` steps after the warm-up; ``None``: warm-up only.
        start_step: first recorded step (LoRA: 5, when ``B`` has left zero).
        base_lr: ``lr_0`` stored in ``record.meta["base_lr"]``; default: the ``initial_lr``
            (set by schedulers) or ``lr`` at the first step of the first param group whose
            rate is not 0.
        scheduler: the run's ``torch.optim.lr_scheduler`` scheduler: ``sched(t)`` is
            ``lr(t) / initial_lr`` of the first param group whose rate is not 0; without one,
            ``sched(t) = lr(t) / base_lr`` for that group (:func:`schedule_ratio`).
        meta: extra JSON-able metadata (e.g. ``{"seed": 0, "width": 128}``), merged over the
            recorded ``estimator``, ``grouping`` (:func:`grouping_meta`), ``beta``,
            ``samples``, ``shapes``, ``model``, ``every``, ``warmup_samples`` and
            ``start_step``.
        log_fn: called as ``log_fn(step, {"fslr/<tensor>": value, ...})`` (unknown values
            left out) after every recorded row (TensorBoard:
            ``lambda t, s: writer.add_scalars("fslr", s, t)``).
        feature_gains: also store, in ``record.meta["feature_gain"]``, the feature gain of
            each tensor's first recorded update
            (:func:`~fslr_func.training.feature_gains.step_gains`: two forward-mode passes
            per tensor, once), which ``FLeRM(..., match="features")`` needs.

    Attributes:
        record: the :class:`~fslr_func.io.record.FSLRRecord` being filled.
        t: index of the next training step.

    Raises:
        TypeError: ``fm``, an optimiser, ``scheduler`` or ``log_fn`` of the wrong kind.
        ValueError: an invalid option (named).
    """

    kind = "Recorder"

    def __init__(
        self,
        fm: FSLRModule,
        probe_batches: Iterable[Inputs],
        *,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        warmup_samples: int = 40,
        every: int | None = 100,
        start_step: int = 0,
        base_lr: float | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        meta: Mapping[str, Any] | None = None,
        log_fn: LogFn | None = None,
        feature_gains: bool = False,
    ) -> None:
        if base_lr is not None and not is_learning_rate(base_lr):
            raise ValueError(f"base_lr must be None or a finite number > 0, got {base_lr!r}")
        base_lr = None if base_lr is None else float(base_lr)  # plain, for the record's JSON
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a dict of JSON-able entries, got {type(meta).__name__}")
        super().__init__(
            fm,
            probe_batches,
            optimizer,
            warmup_samples=warmup_samples,
            every=every,
            start_step=start_step,
            scheduler=scheduler,
            log_fn=log_fn,
            config={"base_lr": base_lr, "feature_gains": bool(feature_gains)},
        )
        fm = self.fm  # the wrapper under a torch.compile or DDP layer given as fm
        self.feature_gains = bool(feature_gains)
        if self.feature_gains:
            require_readout(fm, "Recorder(..., feature_gains=True)")
            require_one_process(
                fm,
                "Recorder(..., feature_gains=True)",
                "record the base run's gains in one process, or leave feature_gains off",
            )
        self._prefix = fm.name_prefix  # records hold the bare model's names (fslr_func.names)
        shapes = trainable_shapes(fm)
        self.record = FSLRRecord(
            meta={
                "estimator": fm.estimator,
                "grouping": grouping_meta(fm.grouping),
                "beta": fm.beta,
                "samples": fm.samples,
                "shapes": shapes,
                "model": type(unwrapped(fm.module)[0]).__name__,
                "base_lr": base_lr,
                "schedule": self._config["scheduler"],
                "warmup_samples": self._config["warmup_samples"],
                "every": self._config["every"],
                "start_step": self._config["start_step"],
                "sched_per_step": [],
                **(meta or {}),
            }
        )
        self._sched = 1.0
        self._stepping: list[torch.optim.Optimizer] = []
        self._first_lrs: dict[tuple[int, int], float] = {}  # (optimiser, group) without initial_lr
        self._stepped_optimizers: list[torch.optim.Optimizer] = []  # given to step() only

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The (first) optimiser given at construction, or ``None``."""
        return self.optimizers[0] if self.optimizers else None

    def _prepare(self, optimizers: list[torch.optim.Optimizer]) -> None:
        meta = self.record.meta
        if meta["optimizer"] is None:
            described = optimizer_meta(optimizers[0])
            # one class name per optimiser ("Muon+AdamW"): FLeRM checks its own against them
            # the update rule's (ZeroRedundancyOptimizer's optimizer_class)
            rules = (type(update_rule(o)).__name__ for o in optimizers)
            meta["optimizer"] = "+".join(dict.fromkeys(rules))
            meta["optimizer_hparams"] = described["optimizer_hparams"]
            if meta["base_lr"] is None:
                meta["base_lr"] = self._first_lr(described["base_lr"])
        self._sched = schedule_ratio(optimizers[0], self.scheduler, float(meta["base_lr"]))
        meta["sched_per_step"][self.t :] = [self._sched]
        if meta.get("sched_groups_differ_at") is None and not self._one_schedule(optimizers):
            meta["sched_groups_differ_at"] = self.t
        self._stepping = optimizers

    def _one_schedule(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether every param group's rate is at one ratio to its initial rate (its
        ``initial_lr``, else its rate when first seen): one schedule for the whole run, the
        one ratio per step that :attr:`record` keeps and FLeRM follows without a scheduler."""
        ratios = []
        for o in optimizers:
            for j, g in enumerate(o.param_groups):
                lr = group_lr(g)
                key = (self._optimizer_index(o), j)
                first = (
                    group_lr({"lr": g["initial_lr"]})
                    if "initial_lr" in g
                    else self._first_lrs.setdefault(key, lr)
                )
                if first:
                    ratios.append(lr / first)
        return not ratios or max(ratios) - min(ratios) <= 1e-6 * max(ratios)

    def _measured(self, m: Measurement) -> None:
        if self.feature_gains and "feature_gain" not in self.record.meta:
            self.record.meta["feature_gain"] = step_gains(self.fm, m)
        step, sched, optimizers = self.t, self._sched, self._stepping
        # the rates in force are final once FLeRM, if it drives this step, has finished it
        when_final(optimizers, lambda: self._append(step, m, optimizers, sched))

    def _first_lr(self, lr: float | None) -> float:
        if lr is None or not is_learning_rate(lr):
            raise ValueError(
                f"the first param group's learning rate is {lr!r} at the first step and no "
                "scheduler set its initial_lr: pass Recorder(..., base_lr=lr_0)"
            )
        return lr

    def _append(
        self,
        step: int,
        m: Measurement,
        optimizers: Sequence[torch.optim.Optimizer],
        sched: float,
    ) -> None:
        bare = self._prefix
        lrs = {
            n.removeprefix(bare): lr
            for o in optimizers
            for n, lr in rates_in_force(self.fm.module, o).items()
        }
        names = self.record.names or list(lrs)
        reading = m.read()  # the row's one synchronisation
        values = {n.removeprefix(bare): v for n, v in reading.values.items()}
        moved = [n.removeprefix(bare) for n in reading.moved]
        # Without a valid estimate, a tensor whose probes were folded in (0/0: Z = 0) or whose
        # update at a rate > 0 was zero (LoRA A while B = 0) did not move the function: 0.
        # One that never had a finite probe, or only ever rate 0, is unknown (None), never 0.
        # One whose update rounded to nothing in its 16-bit dtype did not move because of the
        # rate's size, not the function's: unknown too.
        measured = set(moved) - {n.removeprefix(bare) for n in reading.left_out}
        rounded = [n.removeprefix(bare) for n in reading.rounded]
        fslr: dict[str, float | None] = {
            n: values[n]
            if n in values
            else (
                0.0
                if n in measured or (n not in moved and n not in rounded and lrs.get(n, 0.0) > 0)
                else None
            )
            for n in names
        }
        bad = [n for n, v in fslr.items() if v is not None and not math.isfinite(v)]
        if bad:
            warnings.warn(
                f"Recorder: step {step} has non-finite FSLRs for {bad[:10]} (a diverged run?); "
                "the row is not recorded",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        moved_set = set(moved)
        notes = {
            "did not move (frozen, no gradient or rate 0): their row keeps the previous "
            "estimate (unknown, None, if they have none and their rate is 0)": [
                n for n in names if n not in moved_set and n not in rounded
            ],
            "had a finite non-zero gradient but did not change in their 16-bit dtype (an "
            "update that rounded to nothing at a rate below the parameters' precision, or an "
            "optimiser state that overflowed after a huge gradient): their row keeps the "
            "previous estimate (unknown, None, if they have none); keep float32 parameters "
            "(autocast) or raise the rate": rounded,
            "were not trainable at the first recorded step and are not in the record": [
                n for n in moved if n not in fslr
            ],
        }
        for what, which in notes.items():
            if which:
                self._note(f"{what} {which}", f"Recorder: step {step}: {which[:10]} {what}")
        self.record.append(step, fslr, lrs={n: lrs.get(n, 0.0) for n in names}, sched=sched)
        if self.log_fn is not None:
            self.log_fn(step, {f"fslr/{n}": v for n, v in fslr.items() if v is not None})

    def _optimizer_index(self, optimizer: torch.optim.Optimizer) -> int:
        """The optimiser's place among those given at construction, or, for a Recorder given
        its optimisers at each step, in the order they were first stepped."""
        if optimizer in self.optimizers:
            return self.optimizers.index(optimizer)
        if optimizer not in self._stepped_optimizers:
            self._stepped_optimizers.append(optimizer)
        return len(self.optimizers) + self._stepped_optimizers.index(optimizer)

    def _own_state(self) -> dict[str, Any]:
        # the first rates of groups without an initial_lr: a cut by hand after a resume is
        # still a split of the groups' schedules
        first = [[i, j, lr] for (i, j), lr in self._first_lrs.items()]
        return {"record": self.record.to_dict(), "first_lrs": first}

    def _load_own_state(self, state: Mapping[str, Any]) -> None:
        if "record" not in state:
            raise ValueError("this Recorder state lacks 'record': it is damaged or edited")
        record = FSLRRecord.from_dict(state["record"], source="the Recorder state")
        record.meta.setdefault("sched_per_step", [])
        try:  # absent from states saved before it was kept
            first = {(int(i), int(j)): float(lr) for i, j, lr in state.get("first_lrs", [])}
        except (TypeError, ValueError) as e:
            raise ValueError(f"this Recorder state's 'first_lrs' is damaged or edited ({e})") from e
        self.record = record
        self._first_lrs = first
