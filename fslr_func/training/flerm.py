r"""FLeRM: function-space learning rate matching (paper section 3.3, Algorithm 1 in blue).

A base run's FSLRs are recorded (:class:`~fslr_func.training.recorder.Recorder`);
:class:`FLeRM` then drives a scaled model (wider, deeper, re-initialised, higher LoRA rank) so
that each tensor moves the function as its base counterpart did. The base record gives each
scaled tensor a target :math:`T_W(t)` (:mod:`fslr_func.training.flerm_targets`: the base
tensors' FSLRs, mapped by the depth policy). At a *set point* ``t`` FLeRM measures the scaled
model's unit-learning-rate FSLRs and sets, per tensor (:mod:`fslr_func.training.flerm_rule`),

.. math::

    \eta_W(t) = \eta_0 \, \mathrm{sched}(t) \, r_W, \qquad r_W = \frac{T_W(t)}{\mathrm{FSLR}_W(t)},

:math:`\eta_0` the base learning rate and :math:`\mathrm{sched}(t)` the schedule ratio
:math:`\eta(t)/\eta(0)`; with one base rate this is the paper's rule
:math:`\eta_W = \eta_0 \, \mathrm{sched}(t) \, \mathrm{FSLR}^\text{base}_W / \mathrm{FSLR}_W`.
The step ``t`` is taken at the new rates, as in the paper; :math:`r_W` is kept until the next
set point, so :math:`\eta_W` follows the schedule in between.

Set points: ``mode="static"`` (the paper's main results): once, at ``start_step``, after the
EMA warm-up (``ceil(warmup_samples / fm.samples)`` probes of that step's update on fresh probe
batches); ``mode="periodic"``: also every ``every`` steps after it, with one probe each.

Per-tensor rates without touching your param groups (:mod:`fslr_func.training.update_scaling`):
the optimiser steps once, at its own groups' rates :math:`\eta_g`, and FLeRM then scales each
tensor's update by :math:`\eta_W / \eta_g`, which is the step at :math:`\eta_W` for every
optimiser whose update is proportional to its rate (SGD, Adam, AdamW, fused or not...; the
others are refused at construction). The optimiser stays an ordinary optimiser: every
scheduler, ``GradScaler``, ``state_dict``, group state and ``ZeroRedundancyOptimizer`` sees
your own groups; at a set point the step is measured and then scaled, never re-taken.

Schedules: ``scheduler=None``: :math:`\mathrm{sched}(t)` is the base run's ratio
``base.schedule_at(t)`` (the paper's cosine-annealing appendix), recorded at every step by the
Recorder. ``scheduler=`` a scheduler of the scaled run's optimiser: :math:`\mathrm{sched}(t)`
is that scheduler's ratio, per param group, ``group["lr"] / group["initial_lr"]``, so every
scheduler (a plateau's cuts included) acts on FLeRM's rates through the group.

Examples:
    >>> import torch, fslr_func as ff
    >>> def run(width, lr, flerm_base=None):
    ...     torch.manual_seed(0)
    ...     net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
    ...                               torch.nn.Linear(width, 3))
    ...     fm = ff.with_fslr(net, samples=4, seed=0)
    ...     opt = torch.optim.Adam(fm.parameters(), lr=lr)
    ...     probes = (torch.randn(16, 4) for _ in range(100))
    ...     ctl = (ff.Recorder(fm, probes, optimizer=opt, warmup_samples=8)
    ...            if flerm_base is None
    ...            else FLeRM(fm, opt, flerm_base, probe_batches=probes, warmup_samples=8))
    ...     for t in range(3):
    ...         opt.zero_grad()
    ...         fm(torch.randn(16, 4)).square().mean().backward()
    ...         with ctl.step():
    ...             opt.step()
    ...     return ctl
    >>> base = run(8, lr=1e-2).record
    >>> flerm = run(32, lr=1e-2, flerm_base=base)
    >>> [p.step for p in flerm.history], sorted(flerm.lrs()) == sorted(base.names)
    ([0], True)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import numbers
import statistics
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from ..io.record import FSLRRecord
from ..probe.functional import Inputs
from ..probe.names import short_list
from ..stats.checks import integer, real
from . import policies
from .controller import LogFn, StepController
from .feature_gains import hidden_fan_in, require_one_process, require_readout, step_gains
from .flerm_rule import Match, match, rate
from .flerm_targets import BaseTargets, Note, PastEnd, Unknown
from .probe_schedule import ProbePlan
from .rates import group_lr
from .update_scaling import UpdateScaler, update_rule
from .wrapper import FSLRModule, Measurement

__all__ = ["FLeRM", "SetPoint"]

Mode = Literal["static", "periodic"]
Matched = Literal["output", "features", "features_all"]
"""What FLeRM matches for the tensors of a wider model: the base's output movement (the
paper's rule), or its movement of the features (the readout's input) for the hidden tensors
or for every tensor upstream of the readout."""
Rates = dict[str, tuple[float, float]]
"""Per tensor: its group's rate and FLeRM's rate at a step."""


@dataclass(frozen=True)
class SetPoint:
    r"""What FLeRM measured and set at one set point.

    Attributes:
        step: the training step (taken at the new rates).
        lrs: tensor name -> learning rate applied at ``step``, after the set point.
        fslr: tensor name -> the scaled model's FSLR estimate at unit learning rate.
        targets: tensor name -> the policy's target :math:`T_W` at ``step``: the base FSLRs,
            each times its base tensor's un-scheduled rate over :math:`\eta_0`, mapped by the
            policy (the base FSLRs themselves when all base rates are :math:`\eta_0`).
        held: tensors whose rate was kept (zero, tiny or non-finite FSLR or target).
    """

    step: int
    lrs: dict[str, float]
    fslr: dict[str, float]
    targets: dict[str, float]
    held: tuple[str, ...]


def _warn_if_per_process(fm: FSLRModule) -> None:
    """Warn where FLeRM's probe is per process while ``torch.distributed`` runs several: each
    rank would set its own rates from its own probe batches, and data-parallel replicas would
    drift apart (nothing here can see a ``DDP`` wrapped around ``fm``)."""
    if fm.reduction is not None or not torch.distributed.is_available():
        return
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        fix = (
            "give every rank the same probe batches (estimator='exact' is then the same on "
            "every rank), or wrap with a sampled estimator and distributed=True"
            if fm.estimator == "exact"
            else "wrap with ff.with_fslr(model, distributed=True)"
        )
        warnings.warn(
            f"FLeRM drives a wrapper whose probe is per process, in one of "
            f"{torch.distributed.get_world_size()} processes: each rank sets its own rates "
            f"from its own probe batches, so data-parallel (DDP) replicas drift apart; {fix} "
            "(docs/distributed.md). Independent runs per process can ignore this.",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_one_base_schedule(base: FSLRRecord, scheduler: Any) -> None:
    """Refuse to follow the base record's one schedule ratio per step where the base run's
    param groups followed different schedules (its Recorder saw their ratios split)."""
    split = base.meta.get("sched_groups_differ_at")
    if scheduler is None and split is not None:
        raise ValueError(
            f"the base run's param groups followed different schedules from step {split} on "
            "(record.meta['sched_groups_differ_at']), but a record keeps one schedule ratio "
            "per step, its first group's, which FLeRM without a scheduler would apply to "
            "every tensor: give the scaled run the base run's schedulers and pass the one "
            "that drives this optimiser as FLeRM(..., scheduler=...), whose ratio FLeRM "
            "follows per param group"
        )


def _warn_if_other_optimizer(base: FSLRRecord, optimizer: torch.optim.Optimizer) -> None:
    """Warn where the base record names an optimiser class other than ``optimizer``'s: FSLRs
    at learning rate 1 depend on the update rule, so an Adam record driving SGD sets rates that
    transfer nothing (``meta["optimizer"]``; ``"A+B"`` for a Recorder over several)."""
    recorded = base.meta.get("optimizer")
    name = type(update_rule(optimizer)).__name__
    names = {name, type(optimizer).__name__}  # a ZeRO record of an earlier version: its name
    if isinstance(recorded, str) and not names & set(recorded.split("+")):
        warnings.warn(
            f"FLeRM's base record was made with {recorded} and this optimiser is {name}: "
            "FSLRs at learning rate 1 depend on the optimiser's update rule, so the rates set "
            f"here do not transfer the base run's; record the base run with {name} (or, if "
            f"the two are the same rule, set base.meta['optimizer'] = {name!r})",
            RuntimeWarning,
            stacklevel=3,
        )


class FLeRM(StepController):
    r"""Sets per-tensor learning rates of a scaled model so its FSLRs match a base record.

    Either attach it once, ``flerm.attach()`` (the optimiser's step hooks: every
    ``optimizer.step()`` from then on, in any loop or framework), or use ``with flerm.step():
    optimizer.step()`` on *every* training step, with nothing else in the block (on exit the
    step's update is scaled to FLeRM's rates). Call ``scheduler.step()`` after the step.

    A set point at which every rate is 0 (a warm-up from 0) or at which no parameter changed (a
    step skipped by a ``GradScaler``) waits for the next step, with a note the first time.
    Several optimisers over one model (Muon on the matrices, AdamW on the rest): one FLeRM per
    optimiser from the same base record. Param groups added with ``add_param_group`` and
    parameters added to the model (late LoRA adapters) are adopted at the next step.

    Args:
        fm: the wrapped scaled model (:func:`fslr_func.with_fslr`, also under ``torch.compile``
            or ``DDP``); its estimator and grouping must be the base record's.
        optimizer: a ``torch.optim`` optimiser over (some of) ``fm``'s parameters, any param
            groups, whose step is proportional to its rate (SGD, Adam, AdamW for-loop, foreach
            or fused, Adagrad, Adamax, RMSprop, Adafactor at a fixed rate...; the others are
            refused with the reason); ``accelerate``'s and Lightning's wrappers are unwrapped.
        base: the base run's :class:`~fslr_func.io.record.FSLRRecord` (mean over seeds or not);
            ``base.meta["base_lr"]`` is :math:`\eta_0`; ``base.lrs`` (if recorded) gives each
            base tensor's own rate.
        probe_batches: probe inputs, separate from the training batches: an endless iterator
            or a re-iterable such as a ``DataLoader`` (cycled).
        policy: maps base FSLRs to the scaled tensors: ``"identity"`` (width, init scale, LoRA
            rank), ``"share_blocks"`` (depth), ``"equal"``, ``"equal_all"`` or any
            :class:`~fslr_func.training.policies.Policy`.
        mode: ``"static"`` (set once at ``start_step``) or ``"periodic"`` (and every
            ``every`` steps after it).
        every: period of the periodic set points.
        warmup_samples: omega samples of the EMA warm-up at ``start_step``.
        start_step: first set point; earlier steps run at the optimiser's own rates (LoRA:
            start at step 5, once ``B`` is non-zero).
        scheduler: the scaled run's own scheduler (its ratio is used instead of the base
            record's); built before or after FLeRM.
        min_fslr: FSLRs or targets ``<= min_fslr`` count as zero: the tensor keeps its current
            rate (one warning per tensor).
        unknown: what to do where the base record's FSLR of a tensor FLeRM drives is unknown
            (the base run could not measure it: no finite probe, or it never moved):
            ``"error"`` (refuse at construction, naming the tensors and steps),
            ``"nearest"`` (use its nearest known value in the record) or ``"hold"`` (keep it
            at its group's rate, with a note).
        past_end: set points and base-schedule lookups past the record's last step
            (:meth:`~fslr_func.io.record.FSLRRecord.past_end`) reuse its last values, and
            those before the base run's first probed step
            (:meth:`~fslr_func.io.record.FSLRRecord.before_start`) its first ones, with one
            warning (``"warn"``) or raise (``"error"``, for exactness).
        log_fn: called after every step as ``log_fn(step, {"flerm_lr/<tensor>": rate, ...})``,
            with ``fslr/<tensor>`` (the scaled model's FSLRs) added at set points.
        match: ``"output"`` (each tensor's output movement is the base's, the paper's rule)
            or ``"features"``: each *hidden* tensor's (fan-out and fan-in both wider than the
            base's) ratio is multiplied by :math:`(G^\text{scaled}_W / G^\text{base}_W)^p`,
            the ratio of the feature gains (output movement per movement of the features,
            the readout's input, :mod:`fslr_func.training.feature_gains`) of the first
            updates, measured once at the first set point and kept; the base's come from
            ``Recorder(..., feature_gains=True)``. One process only; it needs the readout
            layer (refused with ``with_fslr(..., readout=None)``) and warns where the model
            differs from the base but no tensor is hidden. A factor that would push a rate
            past its dtype's range holds the tensor, as a non-finite FSLR does.
            ``"features_all"``: the same factor on *every* tensor whose update moves the
            features (a feature gain in the base record: the input layer, embeddings, biases,
            norms and hidden matrices; the readout's own tensors stay output-matched). Made
            for a model given muP's readout by :func:`~fslr_func.scale_readout`, whose small
            readout would otherwise ask every upstream tensor to move the features further
            than the base's (docs/flerm.md).
        feature_power: :math:`p` of ``match="features"``. At the default :math:`p = 1` each
            hidden tensor moves the features as far as the base's did: on the transfer
            matrix within 2% of re-tuned standard training, or better, on 12 of its 13
            cells, against 5 for ``"output"``. Longer runs at a constant rate want the hidden
            tensors to move further: :math:`p = 1.5` was within 2% on all 13 cells (the
            600-step ResMLP included) but loses the 60-step example of docs/flerm.md by a
            factor 2 (docs/reproduction.md, "Candidate fixes measured on the matrix"); under
            a cosine decay it lost to :math:`p = 1` on every cell it ran on ("What the
            budget changes").

    Attributes:
        names: the tensors FLeRM sets, in ``named_parameters()`` order.
        ratios: tensor name -> :math:`r_W` from the latest set point (absent before its first).
        feature_factors: with ``match="features"`` or ``"features_all"``, tensor name -> the
            factor on its ratio (``None`` before the first set point).
        history: the :class:`SetPoint` of every set point so far.
        t: index of the next training step.
        lr0: :math:`\eta_0`.

    Raises:
        TypeError: ``fm``, ``optimizer``, ``base``, ``scheduler`` or ``log_fn`` of the wrong kind.
        ValueError: a base record that cannot drive this model (named: estimator, grouping,
            architecture, ``base_lr``), parameters in the optimiser that are not ``fm``'s, an
            optimiser whose step is not proportional to its rate, or invalid options.

    Warns:
        RuntimeWarning: the base record names another optimiser class
            (``base.meta["optimizer"]``): FSLRs at learning rate 1 depend on the update rule.
    """

    kind = "FLeRM"
    deferral = (
        "FLeRM: the set point at step {t} waits: {why}; it is taken at the next step that "
        "changes the weights"
    )

    def __init__(
        self,
        fm: FSLRModule,
        optimizer: torch.optim.Optimizer,
        base: FSLRRecord,
        *,
        probe_batches: Iterable[Inputs],
        policy: policies.PolicySpec = "identity",
        mode: Mode = "static",
        every: int = 100,
        warmup_samples: int = 40,
        start_step: int = 0,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        min_fslr: float = 1e-12,
        unknown: Unknown = "error",
        past_end: PastEnd = "warn",
        log_fn: LogFn | None = None,
        match: Matched = "output",
        feature_power: float = 1.0,
    ) -> None:
        if not isinstance(base, FSLRRecord):
            raise TypeError(
                f"base must be an FSLRRecord (FSLRRecord.load(path)), got {type(base).__name__}"
            )
        if mode not in ("static", "periodic"):
            raise ValueError(f"mode must be 'static' or 'periodic', got {mode!r}")
        min_fslr = real(min_fslr, "min_fslr", low=0.0)
        feature_power = real(feature_power, "feature_power", above=0.0)
        if feature_power != 1.0 and match == "output":
            raise ValueError(
                f"feature_power={feature_power:g} applies to the feature gains of "
                "match='features' or 'features_all'; with match='output' it would change "
                "nothing: pass one of those, or leave feature_power out"
            )
        if mode == "periodic" and every is None:
            raise ValueError(
                "mode='periodic' sets the rates every `every` steps: pass every=N (an int >= 1), "
                "or mode='static' for one set point"
            )
        # plain ints from here on (np.int64 too): they go into the saved state's config
        warmup_samples = integer(warmup_samples, "warmup_samples", low=1)
        every = None if every is None else integer(every, "every", low=1, optional=True)
        start_step = integer(start_step, "start_step", low=0)
        resolved = policies.resolve(policy)
        super().__init__(
            fm,
            probe_batches,
            optimizer,
            warmup_samples=warmup_samples,
            every=every if mode == "periodic" else None,
            start_step=start_step,
            scheduler=scheduler,
            log_fn=log_fn,
            config={
                "mode": mode,
                "every": every,
                "policy": policies.describe(resolved),
                "min_fslr": float(min_fslr),
                "unknown": unknown,
                "past_end": past_end,
                "match": match,
                "feature_power": float(feature_power),
                "base": hashlib.sha256(
                    json.dumps(base.to_dict(), sort_keys=True).encode()
                ).hexdigest()[:16],
            },
        )
        fm = self.fm  # the wrapper under a torch.compile or DDP layer given as fm
        ProbePlan.of(warmup_samples, fm.samples, every, start_step)  # `every`, in any mode
        if len(self.optimizers) != 1:
            got = "none" if not self.optimizers else f"{len(self.optimizers)}"
            raise TypeError(
                f"FLeRM drives one optimiser (given: {got}): pass the scaled model's optimiser, "
                "and build one FLeRM per optimiser"
            )
        (self.optimizer,) = self.optimizers
        self.scaler = UpdateScaler(self.optimizer)
        _check_one_base_schedule(base, scheduler)
        # without a scheduler the groups' rates stay as they are: a change is warned of, once
        self._unscheduled_lrs = (
            None if scheduler is not None else [group_lr(g) for g in self.optimizer.param_groups]
        )
        self.targets = BaseTargets(fm, base, resolved, unknown, past_end)
        self.min_fslr = float(min_fslr)
        self.base = base
        self.names: list[str] = []
        self.history: list[SetPoint] = []
        self._late_pending: set[str] = set()  # static: joined after the set point, unmatched
        self._nonfinite: set[str] = set()  # held as not finite at the last set point
        self._adopt()
        self.targets.check(self.names)
        self.targets.check_unknown(
            self.names, start_step, None if mode == "periodic" else start_step
        )
        self.lr0 = self.targets.lr0
        self.ratios: dict[str, float] = {}
        self._rates: Rates = {}
        self._before: dict[str, Tensor] = {}
        self._point: SetPoint | None = None
        self._check_targets(start_step)  # fail now, not at the set point
        self.match: Matched = match
        self.feature_power = float(feature_power)
        self.feature_factors: dict[str, float] | None = None
        recorded = _base_gains(fm, base, match)
        links = self.targets.counterparts(self.names) if recorded else {}
        self.base_gains = self._answering_gains(recorded, links)
        if match == "features":
            self._warn_if_nothing_hidden()
        if match == "features_all":
            self._warn_if_new_tensors(links)
        _warn_if_per_process(fm)
        _warn_if_other_optimizer(base, self.optimizer)

    def _check_targets(self, step: int) -> None:
        """The targets at ``step`` exist for every tensor driven (else the policy's error).

        A one-to-one policy's error over tensors the base record lacks adds how to resume a
        run in which they joined after FLeRM was built (late adapters, ``add_param_group``):
        that run held them at their group's rate, and a resumed one rebuilt with them in the
        optimiser from the start would be refused here.
        """
        try:
            self.targets.at(step, self.names, self._note_each)
        except ValueError as err:
            recorded = set(self.targets.base_names.values())
            lacking = [n for n in self.names if self.targets.bare[n] not in recorded]
            if not (self.targets.one_to_one and lacking):
                raise
            raise ValueError(
                f"{err} Resuming a run in which {short_list(lacking)} joined the optimiser or "
                "the model after FLeRM was built (late adapters, add_param_group)? Build FLeRM "
                "as that run did, before adding them, then load the states: they are held at "
                "their group's rate again"
            ) from err

    # ------------------------------------------------------------------ rates

    def _adopt(self) -> None:
        """Take up the trainable tensors the optimiser holds (again after ``add_param_group``,
        after parameters were added to the model, e.g. late LoRA adapters, or frozen)."""
        held = self.scaler.held(scheduled=self.scheduler is not None)
        if any(i not in self.targets.name_of for i in held):
            self.targets.index()
        foreign = sum(1 for i in held if i not in self.targets.name_of)
        if foreign:
            raise ValueError(
                f"the optimizer holds {foreign} parameter(s) that are not the wrapped model's: "
                "FLeRM sets the rates of fm's parameters only; build the optimizer (and "
                "add_param_group) from fm.parameters()"
            )
        params = self.targets.params
        names = [n for n, p in params.items() if p.requires_grad and id(p) in held]
        if self.names:  # tensors that joined the optimiser since (add_param_group) are late:
            # matched if the record has them, else held at their group's rate with a note
            joined = [n for n in names if n not in self.names]
            self.targets.late.update(joined)
            if joined and self.history and self.plan.every is None:
                # static mode past its set point: a set point of their own, now (warm-up
                # probes included); the other tensors keep their ratios
                self._late_pending.update(joined)
                self._owed = max(self._owed, self.plan.warmup_probes)
        if names != self.names:
            self.names = names + [n for n in self.names if n not in names]

    def _rates_at(self, step: int, *, stepping: bool = True) -> Rates:
        r"""Per tensor: its group's rate :math:`\eta_g` at ``step`` and FLeRM's rate
        :math:`\eta_W = \eta_0 \, \mathrm{sched}(t) \, r_W` (the group's for a tensor without a
        ratio yet, or in a group at rate 0, which has no update to scale). With the run's own
        scheduler :math:`\mathrm{sched}(t)` is the group's ``lr / initial_lr``, else the base
        record's ratio."""
        base_ratio = None
        if self.scheduler is None:
            if stepping:  # a step is taken at these rates (not a query of lrs())
                self.targets.covers(step, "the base schedule at step")
                self._note_unscheduled_change(step)
            base_ratio = self.base.schedule_at(step)
        driven = set(self.names)
        out: Rates = {}
        too_large: list[str] = []
        for name, (lr, sched) in self.scaler.schedules(self.targets.name_of).items():
            if name not in driven:
                continue
            ratio = self.ratios.get(name)
            if ratio is None or not lr:
                out[name] = (lr, lr)
                continue
            wanted = rate(self.lr0, sched if base_ratio is None else base_ratio, ratio)
            if wanted <= self._rate_limit(name):
                out[name] = (lr, wanted)
            else:  # an absurd schedule ratio (1e30): the optimiser would overflow
                out[name] = (lr, lr)
                too_large.append(name)
        if too_large and stepping:
            self._note(
                "schedule-overflow",
                f"FLeRM step {step}: the schedule ratio times the matched ratio would set rates "
                f"past the square root of the dtype's maximum for {too_large[:10]} (the base "
                "record's schedule ratio is absurd, or the run's own scheduler's); at this step "
                "they take their group's rate",
            )
        return out

    def _rate_limit(self, name: str) -> float:
        """The largest rate for tensor ``name`` (:func:`_dtype_rate_limit` of its dtype)."""
        return _dtype_rate_limit(self.targets.params[name].dtype)

    def lrs(self) -> dict[str, float]:
        """Learning rate of each tensor at the next step (``t``), FLeRM and schedule applied."""
        return self._lrs_at(self.t, stepping=False)

    def _lrs_at(self, step: int, *, stepping: bool = True) -> dict[str, float]:
        """FLeRM's rate of each driven tensor at ``step`` (:meth:`_rates_at`'s second)."""
        rates = self._rates_at(step, stepping=stepping)
        return {n: rates[n][1] for n in self.names if n in rates}

    # ------------------------------------------------------------------ the step

    def _prepare(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._adopt()
        self._rates = self._rates_at(self.t)
        self._before, self._point = {}, None
        self.scaler.begin(self.targets.params, self._rates)

    @contextlib.contextmanager
    def _plain(self) -> Iterator[None]:
        self._before = self.scaler.snapshot(self.targets.params, self._rates)
        yield

    def _measured(self, m: Measurement) -> None:
        if self.match != "output" and self.feature_factors is None:
            self.feature_factors = self._feature_factors(m)
        reading = m.read()  # the set point's one synchronisation
        # tensors whose every probe was left out (not finite), or whose 16-bit update rounded
        # to nothing (no FSLR to divide by: not 0), are held
        unknown = reading.left_out + tuple(n for n in reading.rounded if n not in reading.values)
        measured = {**reading.values, **dict.fromkeys(unknown, math.nan)}
        self._point = self._set_point(self.t, measured)
        self._rates = self._rates_at(self.t)
        self._before = dict(m.before)

    def _finish(self) -> None:
        self._end_scaling()
        if self._point is not None:
            self.history.append(self._point)
        if self.log_fn is not None:
            scalars = {f"flerm_lr/{n}": self._rates[n][1] for n in self.names if n in self._rates}
            if self._point is not None:
                scalars.update({f"fslr/{k}": v for k, v in self._point.fslr.items()})
            self.log_fn(self.t, scalars)

    def _end_scaling(self) -> None:
        """Scale the step's update to FLeRM's rates and close the step."""
        self.scaler.end(self.targets.params, self._rates, self._before)
        self._before = {}

    def _abandon(self) -> None:
        self._end_scaling()  # a skipped step's update is zero; nothing is logged

    def _note_unscheduled_change(self, step: int) -> None:
        """Warn, once, where a group's rate moved although no scheduler was passed: a
        ``ReduceLROnPlateau`` (which sets no ``initial_lr``) or a rate set by hand, which
        FLeRM's rates (the base record's schedule) would silently undo."""
        if self._unscheduled_lrs is None:
            return
        groups = self.optimizer.param_groups  # groups added later are left out: strict=False
        for i, (group, was) in enumerate(zip(groups, self._unscheduled_lrs, strict=False)):
            now = group_lr(group)
            if now != was:
                self._unscheduled_lrs = None
                warnings.warn(
                    f"FLeRM step {step}: param group {i}'s rate changed from {was:.4g} to "
                    f"{now:.4g}, but no scheduler was passed (scheduler=...): FLeRM's rates "
                    "follow the base record's schedule, so this change has no effect. Pass the "
                    "scheduler that changes it (a ReduceLROnPlateau too) as scheduler=...",
                    RuntimeWarning,
                    stacklevel=6,
                )
                return

    def _gone(self, step: int) -> tuple[str, ...]:
        """The driven tensors the model no longer holds under their name (renamed since, as
        ``torch.nn.utils.prune`` renames ``weight`` to ``weight_orig``, or removed): their
        FSLR under that name is no longer measured, so they keep their ratio, said once."""
        current = dict(self.fm.module.named_parameters())
        known = self.targets.params
        gone = tuple(n for n in self.names if n not in current or current[n] is not known.get(n))
        if gone:
            self._note(
                f"gone {gone}",
                f"FLeRM set point {step}: {list(gone)[:10]} are no longer the model's tensors "
                "of those names (renamed, as torch.nn.utils.prune renames weight to "
                "weight_orig, or removed), so their FSLR under the base record's names is not "
                "measured any more: they keep their current rates",
            )
        return gone

    def _set_point(self, step: int, fslr: Mapping[str, float]) -> SetPoint:
        gone = self._gone(step)
        names = [n for n in self.names if n not in gone]
        targets = self.targets.at(step, names, self._note_each)
        measured = {n: float(fslr[n]) if n in fslr else 0.0 for n in names}
        limits = {n: self._rate_limit(n) for n in names}
        # the feature factors scale the targets before matching, so that a rate they push past
        # the dtype's limit (a huge feature_power) is held like any other, not applied
        factors = self.feature_factors or {}
        wanted = {n: t * factors.get(n, 1.0) for n, t in targets.items()}
        matched = match(wanted, measured, lr0=self.lr0, min_fslr=self.min_fslr, max_rate=limits)
        if self._late_pending:  # static: the set point of tensors that joined since
            self.ratios.update({n: r for n, r in matched.ratios.items() if n in self._late_pending})
            self._late_pending.clear()
        else:
            self.ratios.update(matched.ratios)
        if self.scheduler is None and "initial_lr" in self.optimizer.param_groups[0]:
            warnings.warn(
                "FLeRM: a scheduler is attached to the optimizer but was not passed as "
                "scheduler=...: FLeRM applies the base record's schedule ratio instead of it",
                RuntimeWarning,
                stacklevel=5,
            )
        idle = {n for n, (lr, _) in self._rates.items() if not lr}
        _report(matched, step, self.min_fslr, self._note_each, idle, self._nonfinite)
        self._nonfinite = set(matched.nonfinite)
        return SetPoint(
            step=step,
            lrs=self._lrs_at(step),
            fslr=measured,
            targets=targets,
            held=matched.zero + matched.nonfinite + matched.unmatched + gone,
        )

    def _answering_gains(
        self, recorded: Mapping[str, float], links: Mapping[str, tuple[str, ...]]
    ) -> dict[str, float]:
        """Per driven tensor (bare name), the base feature gain its own is compared with: that
        of the base tensor its target answers to under the policy (the tensor of its name, or
        under ``share_blocks`` the base block it replaces; the geometric mean where it answers
        to several, a shallower model's block), so an added block's feature movement is
        matched to its base block's. ``links``: :meth:`BaseTargets.counterparts` of the
        driven tensors."""
        gains = {self.targets.base_names.get(b, b): g for b, g in recorded.items()}
        out: dict[str, float] = {}
        for name, bases in links.items():
            if bases and all(b in gains for b in bases):
                out[name] = math.exp(statistics.fmean(math.log(gains[b]) for b in bases))
        return out

    def _hidden(self) -> dict[str, float]:
        """The hidden tensors against the base record (bare names -> fan-in multipliers,
        :func:`~fslr_func.training.feature_gains.hidden_fan_in`)."""
        prefix = self.fm.name_prefix
        shapes = {n.removeprefix(prefix): tuple(self.targets.params[n].shape) for n in self.names}
        base = self.targets.base_shapes()
        return hidden_fan_in(shapes, base, self.targets.counterparts(self.names))

    def _warn_if_nothing_hidden(self) -> None:
        """Warn where ``match="features"`` cannot act: the model differs from the base (a
        tensor of another shape) but none of its tensors is hidden (wider in both dims), so
        every tensor matches output movement. A model of the base's shapes is silent: there
        the factors are 1 by construction."""
        if self._hidden():
            return
        prefix, shapes = self.fm.name_prefix, self.targets.base_shapes()
        resized = [
            n
            for n in self.names
            if tuple(self.targets.params[n].shape) != shapes.get(n.removeprefix(prefix))
        ]
        if resized:
            warnings.warn(
                f"FLeRM: match='features' changes nothing here: {resized[:5]} differ from the "
                "base record's shapes (or it has none), but no tensor FLeRM drives is hidden "
                "(fan-out and fan-in both different from the base's, as in a wider model), so "
                "every tensor matches output movement, as with match='output'",
                RuntimeWarning,
                stacklevel=3,
            )

    def _warn_if_new_tensors(self, known: Mapping[str, tuple[str, ...]]) -> None:
        """Warn, for ``match="features_all"``, about driven tensors with no base tensor to
        compare their feature gain with (a policy without ``counterparts`` over a model that
        adds tensors the base lacks): they match output movement while the others match
        feature movement, a mixed allocation never measured. ``known``: the driven tensors'
        counterparts (:meth:`BaseTargets.counterparts`)."""
        new = [b for n in self.names if (b := n.removeprefix(self.fm.name_prefix)) not in known]
        if new:
            warnings.warn(
                f"FLeRM: match='features_all' has no base tensor to compare the feature gain of "
                f"{new[:5]}{' and more' if len(new) > 5 else ''} with (the policy "
                f"{policies.describe(self.targets.policy)} names no counterpart for them): they "
                "match output movement, the others feature movement. Use a policy that names "
                "its counterparts (identity, share_blocks, equal; or give yours a "
                "counterparts(base, scaled) attribute) or match='output' (docs/flerm.md)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _feature_matched(self) -> list[str]:
        """The tensors whose feature movement is matched, by bare name: the hidden ones
        (``match="features"``), or every driven tensor with a base feature gain, the readout's
        own having none (``"features_all"``)."""
        if self.match != "features_all":
            return list(self._hidden())
        bare = (n.removeprefix(self.fm.name_prefix) for n in self.names)
        return [n for n in bare if n in self.base_gains]

    def _feature_factors(self, m: Measurement) -> dict[str, float]:
        """Per tensor whose feature movement is matched, its scaled feature gain over the
        base's (both measured), to the power ``feature_power``."""
        prefix = self.fm.name_prefix
        hidden = self._feature_matched()
        gains = step_gains(self.fm, m, names={n for n in hidden if n in self.base_gains})
        power = self.feature_power
        factors = {prefix + n: _power(g / self.base_gains[n], power) for n, g in gains.items()}
        missing = sorted(set(hidden) - {n.removeprefix(prefix) for n in factors})
        self._note_each(
            missing,
            "FLeRM: {} have no feature gain here or in the base record (their update moves no "
            "features); they match output movement",
        )
        return factors

    # ------------------------------------------------------------------ checkpoints

    def _own_state(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "ratios": dict(self.ratios),
            "history": [asdict(p) for p in self.history],
            "feature_factors": self.feature_factors,
            "late": sorted(self.targets.late),
            "late_pending": sorted(self._late_pending),
        }

    def _load_own_state(self, state: Mapping[str, Any]) -> None:
        # tensors added since construction (a resumed run rebuilt as it was built, its late
        # groups added again) are taken up first, as the saved run took them up at a step
        self._adopt()
        missing = [k for k in ("names", "ratios", "history") if k not in state]
        if missing:
            raise ValueError(f"this FLeRM state lacks {missing}: it is damaged or edited")
        if list(state["names"]) != self.names:
            raise ValueError(
                "this FLeRM state is for other tensors: "
                f"{sorted(set(state['names']) ^ set(self.names))[:10]} differ"
            )
        ratios = _saved_numbers(state["ratios"], "ratios", lambda v: 0 < v < math.inf)
        factors = state.get("feature_factors")
        # a factor may be 0 or inf (a huge feature_power): the tensor is then held, by design
        feature_factors = (
            None if factors is None else _saved_numbers(factors, "factors", lambda v: v >= 0)
        )
        try:
            history = [SetPoint(**{**p, "held": tuple(p["held"])}) for p in state["history"]]
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"this FLeRM state's history is damaged or edited ({type(e).__name__}: {e}); "
                "load the state as it was saved"
            ) from e
        late = {str(n) for n in state.get("late", ())}
        late_pending = {str(n) for n in state.get("late_pending", ())}
        self.feature_factors, self.ratios, self.history = feature_factors, ratios, history
        self.targets.late |= late
        self._late_pending = late_pending


@functools.cache
def _dtype_rate_limit(dtype: torch.dtype) -> float:
    """``sqrt`` of ``dtype``'s maximum, past which an optimiser's update overflows (a 1e300
    base FSLR or schedule ratio); once per dtype, as every step asks for every tensor.

    Examples:
        >>> _dtype_rate_limit(torch.bfloat16) == torch.finfo(torch.bfloat16).max ** 0.5
        True
    """
    return float(torch.finfo(dtype).max ** 0.5)


def _saved_numbers(values: Any, what: str, valid: Callable[[float], bool]) -> dict[str, float]:
    """A saved ``{tensor: number}`` (FLeRM's ratios, feature factors) whose numbers are all
    ``valid`` as the rule makes them, or a ``ValueError`` naming the first that is not (a
    negative ratio would train that tensor by gradient ascent).

    Examples:
        >>> _saved_numbers({"w": -1.0}, "ratios", lambda v: v > 0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: this FLeRM state's ratios['w'] is -1.0, which the rule never makes: ...
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"this FLeRM state's {what} is not a dict: it is damaged or edited")
    for name, v in values.items():
        number = isinstance(v, numbers.Real) and not isinstance(v, bool)
        if not (number and valid(float(v))):  # NaN fails every comparison
            raise ValueError(
                f"this FLeRM state's {what}[{name!r}] is {v!r}, which the rule never makes: it "
                "is damaged or edited; load the state as it was saved"
            )
    return {str(k): float(v) for k, v in values.items()}


def _power(x: float, p: float) -> float:
    """``x ** p`` for ``x > 0``, ``inf`` where it overflows (``math.pow`` raises instead).

    Examples:
        >>> _power(4.0, 0.5), _power(10.0, 1e3), _power(0.1, 1e3)
        (2.0, inf, 0.0)
    """
    try:
        return math.pow(x, p)
    except OverflowError:
        return math.inf


def _base_gains(fm: FSLRModule, base: FSLRRecord, matched: Matched) -> dict[str, float]:
    """The base record's feature gains, checked, for ``match="features"`` or
    ``"features_all"`` (else empty)."""
    if matched not in ("output", "features", "features_all"):
        raise ValueError(f"match must be 'output', 'features' or 'features_all', got {matched!r}")
    if matched == "output":
        return {}
    require_readout(fm, "match='features'")
    require_one_process(fm, f"match={matched!r}", "use match='output'")
    gains = base.meta.get("feature_gain")
    if not isinstance(gains, Mapping) or not gains:
        raise ValueError(
            "match='features' needs the base run's feature gains, and this record has none: "
            "record the base with Recorder(..., feature_gains=True)"
        )
    bad = [n for n, g in gains.items() if not (isinstance(g, (int, float)) and 0 < g < math.inf)]
    if bad:
        raise ValueError(
            f"the base record's feature gains of {bad[:10]} are not finite numbers > 0"
        )
    return {str(n): float(g) for n, g in gains.items()}


def _report(
    matched: Match,
    step: int,
    min_fslr: float,
    note: Note,
    idle: Collection[str] = (),
    still: Collection[str] = (),
) -> None:
    """Warn about the tensors a set point could not match (each named once, the non-finite
    ones again each time they become so: ``still``, those held as not finite at the previous
    set point, are not named again, so a diverged run does not warn at every set point);
    ``idle``: those in param groups at rate 0, which did not move."""
    note(
        matched.unmatched,
        f"FLeRM step {step}: {{}} have no base tensor to match (parameters added to the "
        "model after FLeRM was built and absent from the base record); they keep their "
        "group's learning rate (record a base run with them to match them)",
    )
    newly = [n for n in matched.nonfinite if n not in still]
    if newly:
        warnings.warn(
            f"FLeRM step {step}: no finite FSLR estimate or rate, or a rate too large for "
            f"the parameter's dtype, for {newly[:10]} (every probe of this "
            "set point was left out as not finite, the estimate overflowed, a bfloat16/float16 "
            "update rounded to nothing at a rate below the parameters' precision, or the base "
            "record's FSLR is absurd); they keep their previous learning rate (and are not "
            "named again while they stay so)",
            RuntimeWarning,
            stacklevel=6,
        )
    note(
        [n for n in matched.zero if n in idle],
        f"FLeRM step {step}: {{}} are in param groups at learning rate 0, so their update "
        "could not be measured; they get no FLeRM rate and follow their group's rate "
        "(start FLeRM, start_step=..., once every group's rate is above 0)",
    )
    note(
        [n for n in matched.zero if n not in idle],
        f"FLeRM step {step}: the FSLR or base target of {{}} is zero or below "
        f"min_fslr={min_fslr:g} (e.g. LoRA A while B is still zero); they keep "
        "their current learning rate (start FLeRM later with start_step=...)",
    )
