r"""FLeRM: function-space learning rate matching (paper section 3.3, Algorithm 1 in blue).

A base run's FSLRs are recorded (:class:`~fslr_func.recorder.Recorder`); :class:`FLeRM` then
drives a scaled model (wider, deeper, re-initialised, higher LoRA rank) so that each tensor moves
the function as its base counterpart did. What is matched is each base tensor's function-space
movement per step, its unit-rate FSLR times its learning rate,

.. math::

    m_b(t) = \eta_b(t) \, \mathrm{FSLR}^\text{base}_b(t)
           = \eta_0 \, \mathrm{sched}^\text{base}(t) \, \tilde F_b(t), \qquad
    \tilde F_b(t) = \mathrm{FSLR}^\text{base}_b(t) \, \frac{\eta_{0,b}}{\eta_0}, \qquad
    \eta_{0,b} = \frac{\eta_b(t)}{\mathrm{sched}^\text{base}(t)},

with :math:`\eta_b(t)` the rate in force for base tensor ``b`` (``base.lrs_at(t)``),
:math:`\eta_{0,b}` its un-scheduled rate, :math:`\eta_0` the base learning rate
(``base.meta["base_lr"]``) and :math:`\mathrm{sched}^\text{base}(t)` the base run's schedule
ratio ``base.sched_at(t)``. The policy (depth: :func:`fslr_func.policies.share_blocks`) maps
:math:`\tilde F` to a target :math:`T_W(t)` for every scaled tensor, sharing each base tensor's
movement among the tensors that replace it. At a *set point* ``t`` FLeRM measures the scaled
model's unit-learning-rate FSLRs and sets, per tensor,

.. math::

    \eta_W(t) = \eta_0 \, \mathrm{sched}(t) \, \frac{T_W(t)}{\mathrm{FSLR}_W(t)},

:math:`\mathrm{sched}(t)` being the schedule ratio :math:`\eta(t)/\eta(0)`. With one base rate
for all tensors (:math:`\eta_{0,b} = \eta_0`) or a record without ``lrs``,
:math:`\tilde F_b = \mathrm{FSLR}^\text{base}_b` and this is the paper's rule
:math:`\eta_W = \eta_0 \, \mathrm{sched}(t) \, \mathrm{FSLR}^\text{base}_W / \mathrm{FSLR}_W`.
With per-tensor base rates (LoRA: ``A`` and ``B`` at their own rates), the identity policy gives
each tensor its own base rate times the FSLR ratio,
:math:`\eta_W = \mathrm{sched}(t) \, \eta_{0,W} \, \mathrm{FSLR}^\text{base}_W / \mathrm{FSLR}_W`,
and under a depth policy the scaled tensors answering to ``b`` move the function by
:math:`\sum_W \eta_W \mathrm{FSLR}_W = m_b` in all (with the base schedule). The step ``t`` is
then taken at the new rates, as in the paper (its update scaled, below). The ratio
:math:`r_W = T_W / \mathrm{FSLR}_W` is kept until the next set point, so
:math:`\eta_W(t') = \eta_0 \, \mathrm{sched}(t') \, r_W` follows the schedule in between.

Set points: ``mode="static"`` (the paper's main results): once, at ``start_step``, after the
EMA warm-up (``ceil(warmup_samples / fm.samples)`` probes of that step's update on fresh probe
batches); ``mode="periodic"``: also every ``every`` steps after it, with one probe each.

Per-tensor rates without touching your param groups (:mod:`fslr_func.update_scaling`): the
optimiser steps once, at its own groups' rates :math:`\eta_g`, and FLeRM then scales each
tensor's update by :math:`\eta_W / \eta_g`, which is the step at :math:`\eta_W` for every
optimiser whose update is proportional to its rate (SGD, Adam, AdamW, fused or not...; the
others are refused at construction). The optimiser stays an ordinary optimiser: every
scheduler, ``GradScaler``, ``state_dict``, group state and ``ZeroRedundancyOptimizer`` sees
your own groups; at a set point the step is measured and then scaled, never re-taken.

Schedules: ``scheduler=None``: :math:`\mathrm{sched}(t)` is the base run's ratio
``base.schedule_at(t)`` (the paper's cosine-annealing appendix): recorded at every step by the
:class:`~fslr_func.recorder.Recorder`, interpolated for older records, never a staircase.
``scheduler=`` a scheduler of the scaled run's optimiser: :math:`\mathrm{sched}(t)` is that
scheduler's ratio, per param group, ``group["lr"] / group["initial_lr"]``.

Example:
    >>> import torch, fslr_func as ff
    >>> from fslr_func.recorder import Recorder
    >>> def run(width, lr, flerm_base=None):
    ...     torch.manual_seed(0)
    ...     net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
    ...                               torch.nn.Linear(width, 3))
    ...     fm = ff.with_fslr(net, samples=4, seed=0)
    ...     opt = torch.optim.Adam(fm.parameters(), lr=lr)
    ...     probes = (torch.randn(16, 4) for _ in range(100))
    ...     ctl = (Recorder(fm, probes, optimizer=opt, warmup_samples=8) if flerm_base is None
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
import hashlib
import json
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from . import policies
from .control_options import check_log_fn, check_scheduler, check_state, optimizers_of
from .flerm_rule import match, rate
from .functional import Inputs
from .names import recorded_names
from .probe_schedule import ProbeFeed, ProbePlan
from .record import FSLRRecord, grouping_meta
from .record_meta import is_learning_rate
from .recorder import LogFn
from .step_hooks import StepHooks
from .transform import FSLRModule
from .update_scaling import check_scalable, group_lr, scale_updates, snapshot

__all__ = ["FLeRM", "SetPoint"]

_STATE_VERSION = 2
Mode = Literal["static", "periodic"]


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


class FLeRM:
    r"""Sets per-tensor learning rates of a scaled model so its FSLRs match a base record.

    Either attach it once, ``flerm.attach()`` (the optimiser's step hooks: every
    ``optimizer.step()`` from then on, in any loop or framework), or use ``with flerm.step():
    optimizer.step()`` on *every* training step, with nothing else in the block (on exit the
    step's update is scaled to FLeRM's rates).
    Call ``scheduler.step()`` after the step, as usual.

    A set point at which every rate is 0 (a warm-up from 0) or at which no parameter changed (a
    step skipped by a ``GradScaler``) waits for the next step, with a note the first time.
    Several optimisers over one model (Muon on the matrices, AdamW on the rest): one FLeRM per
    optimiser from the same base record, each setting the rates of the tensors its optimiser
    holds. Param groups added with ``add_param_group`` are adopted at the next step.

    Args:
        fm: the wrapped scaled model (:func:`fslr_func.with_fslr`); its estimator and grouping
            must be the base record's.
        optimizer: any ``torch.optim`` optimiser over (some of) ``fm``'s parameters, any param
            groups (SGD, Adam, AdamW, Adagrad, Adamax, RMSprop, sign-SGD...: any optimiser
            whose step only reads the gradients and its per-parameter state; not LBFGS, which
            allows one param group and needs a closure); ``accelerate``'s and Lightning's
            wrappers are unwrapped.
        base: the base run's :class:`~fslr_func.record.FSLRRecord` (mean over seeds or not);
            ``base.meta["base_lr"]`` is :math:`\eta_0`; ``base.lrs`` (if recorded) gives each
            base tensor's own rate :math:`\eta_{0,b}`.
        probe_batches: probe inputs, separate from the training batches: an endless iterator
            or a re-iterable such as a ``DataLoader`` (cycled).
        policy: maps base FSLRs to the scaled tensors: ``"identity"`` (width, init scale, LoRA
            rank), ``"share_blocks"`` (depth), ``"equal"``, ``"equal_all"`` or any
            :class:`~fslr_func.policies.Policy`.
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
            (:meth:`~fslr_func.record.FSLRRecord.past_end`) reuse its last values with one
            warning (``"warn"``) or raise (``"error"``, for exactness).
        log_fn: called after every step as ``log_fn(step, {"flerm_lr/<tensor>": rate, ...})``,
            with ``fslr/<tensor>`` (the scaled model's FSLRs) added at set points.

    Attributes:
        names: the tensors FLeRM sets, in ``named_parameters()`` order.
        ratios: tensor name -> :math:`r_W = T_W / \mathrm{FSLR}_W` from the latest set point
            (absent before its first successful set point).
        history: the :class:`SetPoint` of every set point so far.
        t: index of the next training step.
        lr0: :math:`\eta_0`.

    Raises:
        TypeError: ``fm``, ``optimizer``, ``base``, ``scheduler`` or ``log_fn`` of the wrong kind.
        ValueError: for a base record of another estimator, grouping (callables compared by
            qualified name) or architecture (tensors named), an empty record, one without a
            positive ``base_lr``, one with ``lrs`` and a zero schedule ratio, parameters in the
            optimiser that are not ``fm``'s, an LBFGS optimiser, or invalid options.
    """

    def __init__(
        self,
        fm: FSLRModule,
        optimizer: torch.optim.Optimizer,
        base: FSLRRecord,
        *,
        probe_batches: Iterable[Inputs],
        policy: str | policies.Policy | None = "identity",
        mode: Mode = "static",
        every: int = 100,
        warmup_samples: int = 40,
        start_step: int = 0,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        min_fslr: float = 1e-12,
        unknown: Literal["error", "nearest", "hold"] = "error",
        past_end: Literal["warn", "error"] = "warn",
        log_fn: LogFn | None = None,
    ) -> None:
        if not isinstance(fm, FSLRModule):
            raise TypeError(f"fm must be a with_fslr(model) wrapper, got {type(fm).__name__}")
        if not isinstance(base, FSLRRecord):
            raise TypeError(
                f"base must be an FSLRRecord (FSLRRecord.load(path)), got {type(base).__name__}"
            )
        if mode not in ("static", "periodic"):
            raise ValueError(f"mode must be 'static' or 'periodic', got {mode!r}")
        if not (isinstance(min_fslr, (int, float)) and math.isfinite(min_fslr) and min_fslr >= 0):
            raise ValueError(f"min_fslr must be a finite number >= 0, got {min_fslr!r}")
        if unknown not in ("error", "nearest", "hold"):
            raise ValueError(f"unknown must be 'error', 'nearest' or 'hold', got {unknown!r}")
        if past_end not in ("warn", "error"):
            raise ValueError(f"past_end must be 'warn' or 'error', got {past_end!r}")
        self.unknown, self.past_end = unknown, past_end
        if not isinstance(probe_batches, Iterable):
            raise TypeError(
                "probe_batches must be an iterable of probe inputs (a DataLoader, a list, a "
                f"generator), got {type(probe_batches).__name__}"
            )
        (self.optimizer,) = optimizers_of(optimizer)
        check_scalable(self.optimizer)
        self.fm = fm
        self.base = base
        self.scheduler = check_scheduler(scheduler, [self.optimizer])
        self.log_fn = check_log_fn(log_fn)
        self.min_fslr = float(min_fslr)
        ProbePlan.of(warmup_samples, fm.samples, every, start_step)  # validates every, always
        self.plan = ProbePlan.of(
            warmup_samples, fm.samples, every if mode == "periodic" else None, start_step
        )
        self._feed = ProbeFeed(probe_batches)
        self._policy = policies.resolve(policy)
        self.names: list[str] = []
        self._params: dict[str, Tensor] = {}
        self._late: set[str] = set()
        self._before: dict[str, Tensor] = {}  # the driven tensors before a step (reused)
        self._index_params()
        self._adopt_groups()
        self._check_base()
        self.lr0 = float(base.meta["base_lr"])
        self.ratios: dict[str, float] = {}
        self.history: list[SetPoint] = []
        self.t = 0
        self._owed = 0
        self._warned: set[str] = set()
        base_json = json.dumps(base.to_dict(), sort_keys=True).encode()
        self._config = {
            "mode": mode,
            "every": every,
            "warmup_samples": warmup_samples,
            "start_step": start_step,
            "policy": getattr(self._policy, "__qualname__", repr(self._policy)),
            "min_fslr": self.min_fslr,
            "scheduler": None if scheduler is None else type(self.scheduler).__name__,
            "base": hashlib.sha256(base_json).hexdigest()[:16],
        }
        self._base_end = base.last_step
        self._check_unknown(start_step, periodic=mode == "periodic")
        self._targets(start_step)  # fail now, not at the set point, on a mismatched record

    def _adopt_groups(self) -> None:
        """Take up the trainable tensors the optimiser holds (again after ``add_param_group``,
        after parameters were added to the model, e.g. late LoRA adapters, or frozen)."""
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if any(i not in self._name_of for i in held):
            self._index_params()
        foreign = sum(1 for i in held if i not in self._name_of)
        if foreign:
            raise ValueError(
                f"the optimizer holds {foreign} parameter(s) that are not the wrapped model's: "
                "FLeRM sets the rates of fm's parameters only; build the optimizer (and "
                "add_param_group) from fm.parameters()"
            )
        if self.scheduler is not None:  # the scaled run's schedule: lr / initial_lr per group
            for g in self.optimizer.param_groups:
                g.setdefault("initial_lr", g["lr"])  # ReduceLROnPlateau sets none
        names = [n for n, p in self._params.items() if p.requires_grad and id(p) in held]
        if names != self.names:
            self.names = names + [n for n in self.names if n not in names]

    def _index_params(self) -> None:
        """Read the model's parameters and their names (bare, and as the base record has them)."""
        known = self._params
        self._params = dict(self.fm.module.named_parameters())
        if known:  # parameters added to the model after FLeRM was built
            self._late |= self._params.keys() - known.keys()
        self._name_of = {id(p): n for n, p in self._params.items()}
        # policies see bare names on both sides (fslr_func.names): the scaled model's without
        # its wrappers' prefixes, the record's read by recorded_names
        prefix = self.fm.name_prefix
        self._bare = {n: n.removeprefix(prefix) for n in self._params}
        self._base_names = recorded_names(self.base.names, self._bare.values())

    # ------------------------------------------------------------------ validation

    def _check_base(self) -> None:
        base = self.base
        if len(base) == 0:
            raise ValueError("the base record is empty: record a base run first")
        if base.meta.get("base_lr") is None:
            raise ValueError(
                "the base record has no meta['base_lr'] (lr_0): record it with a Recorder or "
                "set record.meta['base_lr']"
            )
        lr0 = base.meta["base_lr"]
        if not is_learning_rate(lr0):
            raise ValueError(f"the base record's meta['base_lr'] must be a number > 0, got {lr0!r}")
        stalled = [s for s, r in zip(base.steps, base.sched, strict=True) if r == 0]
        if base.lrs and stalled:
            raise ValueError(
                f"the base record's schedule ratio is 0 at steps {stalled[:10]}: its un-scheduled "
                "rates lrs / sched are undefined there; set record.lrs = {} to run every base "
                "tensor at base_lr"
            )
        estimator = base.meta.get("estimator")
        if estimator is not None and estimator != self.fm.estimator:
            raise ValueError(
                f"the base record was measured with estimator {estimator!r} but the scaled "
                f"model's wrapper uses {self.fm.estimator!r}: FSLRs of different estimators "
                f"are not comparable (tensors {self.names[:10]}); use with_fslr(..., "
                f"estimator={estimator!r}) or re-record the base"
            )
        grouping, own = base.meta.get("grouping"), grouping_meta(self.fm.grouping)
        if grouping is not None and grouping != own:
            raise ValueError(
                f"the base record was measured with grouping {grouping!r} but the scaled model's "
                f"wrapper uses {own!r}: FSLRs of tensors of rank 3 or more (conv weights) differ "
                f"between groupings (tensors {self.names[:10]}); use the base run's grouping in "
                "with_fslr(..., grouping=...) or re-record the base"
            )
        if policies.is_one_to_one(self._policy):
            shapes = {self._base_names.get(n, n): s for n, s in base.shapes.items()}
            bad = [
                f"{n!r}: base {list(shapes[b])} vs scaled {list(self._params[n].shape)}"
                for n in self.names
                if (b := self._bare[n]) in shapes and len(shapes[b]) != self._params[n].dim()
            ]
            if bad:
                raise ValueError(
                    "the base record is from another architecture: tensors of different rank "
                    f"under the identity policy: {bad[:10]}"
                )

    def _check_unknown(self, start_step: int, periodic: bool) -> None:
        """Refuse a base record whose FSLR is unknown, at a row FLeRM will read, for a tensor
        it drives (unless ``unknown="hold"``, or ``"nearest"`` and the tensor has a known
        value somewhere); the tensors and their steps are named."""
        rows = self.base.unknown_steps(start_step, None if periodic else start_step)
        if policies.is_one_to_one(self._policy):
            driven = {self._bare[n] for n in self.names}
            rows = {b: s for b, s in rows.items() if self._base_names.get(b) in driven}
        if self.unknown == "nearest":
            rows = {b: s for b, s in rows.items() if b not in self.base.at(0, unknown="nearest")}
        if rows and self.unknown != "hold":
            listed = "; ".join(f"{b!r} at steps {s[:5]}" for b, s in list(rows.items())[:10])
            raise ValueError(
                f"the base record's FSLR is unknown for tensors FLeRM drives: {listed} (the base "
                "run could not measure them: no finite probe, or they never moved, e.g. frozen "
                "or at rate 0); choose a fallback: FLeRM(..., unknown='nearest') uses each "
                "tensor's nearest known value, unknown='hold' keeps it at its group's rate; or "
                "freeze it in the scaled run too, or re-record the base"
            )

    def _check_covers(self, step: int, what: str) -> None:
        """Past the record's last step: warn once per kind of lookup, or raise (``past_end``)."""
        if step <= self._base_end:
            return
        message = self.base.past_end(step, what)
        if self.past_end == "error":
            raise ValueError(
                f"FLeRM: {message}; past_end='error' asks for exactness: record a base run as "
                "long as this one, or pass past_end='warn'"
            )
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(
                f"FLeRM: {message} (warned once; past_end='error' makes it an error)",
                RuntimeWarning,
                stacklevel=5,
            )

    def _targets(self, step: int) -> dict[str, float]:
        r"""Policy targets :math:`T_W` at ``step``; a zero target is allowed (the tensor is held).

        The policy gets :math:`\tilde F_b = \mathrm{FSLR}^\text{base}_b \, \eta_{0,b} / \eta_0`,
        computed as ``fslr * ((lr_b / lr_0) / sched)``: for a tensor at the rate the schedule
        ratio was measured from (``sched = lr_b / lr_0``, as the Recorder stores it) the factor
        is exactly 1, so records with one base rate give exactly the base FSLRs. Base tensors
        without a recorded rate count as running at :math:`\eta_0`.
        """
        self._check_covers(step, "set point")
        fslr = self.base.at(step, unknown="nearest" if self.unknown == "nearest" else "omit")
        rates = self.base.lrs_at(step)
        sched = self.base.sched_at(step)
        moved = {
            self._base_names[b]: f * (rates[b] / self.lr0 / sched) if b in rates else f
            for b, f in fslr.items()
        }
        if self.unknown == "hold":  # (with "error", _check_unknown left none FLeRM drives)
            lacking = [self._base_names[b] for b in self.base.names if b not in fslr]
            moved.update(dict.fromkeys(lacking, 0.0))  # a zero target: held at the group's rate
            self._note(
                lacking,
                f"FLeRM step {step}: the base record's FSLR of {{}} is unknown; they keep "
                "their group's learning rate (unknown='hold')",
            )
        # the policy maps the whole model (an optimiser may hold a subset: Muon + AdamW); under
        # the identity policy a base record of a subset is matched on that subset
        bare = self._bare
        if policies.is_one_to_one(self._policy):
            present = set(bare.values())
            self._note(
                [b for b in moved if b not in present],
                "FLeRM: the base record has tensors {} that the scaled model does not have "
                "(yet): they are matched once added to the model (adapters added later); "
                "otherwise check that the record is from this architecture",
            )
            moved = {b: f for b, f in moved.items() if b in present}
            # every tensor of the scaled model the record has, frozen ones included (freezing
            # a tensor does not change the architecture); a record of a subset (Muon + AdamW)
            # is matched on that subset
            # tensors added to the model after FLeRM was built and absent from the record are
            # held at their group's rate (_set_point)
            model = [
                bare[n]
                for n in self._params
                if bare[n] in moved or (n in self.names and n not in self._late)
            ]
        else:
            model = [bare[n] for n, p in self._params.items() if p.requires_grad or n in self.names]
        targets = policies.apply(self._policy, moved, model, allow_zero=True)
        return {n: targets[bare[n]] for n in self.names if bare[n] in targets}

    # ------------------------------------------------------------------ rates

    def _rates_at(self, step: int) -> dict[str, tuple[float, float]]:
        r"""Per tensor: its group's rate :math:`\eta_g` at ``step`` and FLeRM's rate
        :math:`\eta_W` (the group's for a tensor without a ratio yet, or in a group at rate 0,
        which has no update to scale).

        With the run's own scheduler, :math:`\eta_W = \eta_0 \, (\eta_g /
        \eta_{g,\text{initial}}) \, r_W`: every scheduler (a plateau's cuts included) acts
        on FLeRM's rates through the group; without one, :math:`\eta_W = \eta_0 \,
        \mathrm{sched}^\text{base}(t) \, r_W`. The update is scaled by
        :math:`\eta_W / \eta_g`.
        """
        base_ratio = None if self.scheduler is not None else self.base.schedule_at(step)
        driven = set(self.names)
        out: dict[str, tuple[float, float]] = {}
        for g in self.optimizer.param_groups:
            lr = group_lr(g)
            if base_ratio is None:
                initial = g["initial_lr"]
                initial = float(initial.item() if isinstance(initial, Tensor) else initial)
                sched = lr / initial if initial else 0.0
            else:
                sched = base_ratio
            for p in g["params"]:
                name = self._name_of[id(p)]
                ratio = self.ratios.get(name)
                if name in driven:
                    out[name] = (
                        lr,
                        lr if ratio is None or not lr else rate(self.lr0, sched, ratio),
                    )
        return out

    def lrs(self) -> dict[str, float]:
        """Learning rate of each tensor at the next step (``t``), FLeRM and schedule applied."""
        return self._rates(self._rates_at(self.t))

    def _rates(self, rates: Mapping[str, tuple[float, float]]) -> dict[str, float]:
        return {n: rates[n][1] for n in self.names if n in rates}

    # ------------------------------------------------------------------ the step

    def attach(self) -> StepHooks:
        """Drive every ``optimizer.step()`` from now on, through the optimiser's step hooks.

        Returns:
            The :class:`~fslr_func.step_hooks.StepHooks`; ``.detach()`` (or a ``with`` block
            over it) removes them.
        """
        return StepHooks(self.step, [self.optimizer])

    @contextlib.contextmanager
    def step(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """Context manager around one ``optimizer.step()``: FLeRM rates, set points.

        The optimiser steps once, at its own groups' rates; on exit each tensor's update is
        scaled to FLeRM's rate (:mod:`fslr_func.update_scaling`), at a set point after the
        step was measured and the new rates set.

        Args:
            optimizer: optional, as for :meth:`fslr_func.recorder.Recorder.step`: the
                optimiser FLeRM was built with (FLeRM drives that one only).

        Raises:
            ValueError: another optimiser than the one FLeRM was built with.
        """
        if optimizer is not None and optimizers_of(optimizer) != [self.optimizer]:
            raise ValueError(
                "FLeRM.step(optimizer) got another optimiser than the one FLeRM was built "
                "with: FLeRM sets the rates of that one only"
            )
        self._adopt_groups()
        n = max(self.plan.probes_at(self.t), self._owed)
        if self.scheduler is None:
            self._check_covers(self.t, "the base schedule at step")
        rates = self._rates_at(self.t)
        if n and not any(lr for lr, _ in rates.values()):
            self._defer(n, "every learning rate is 0 (a warm-up from 0?)")
            n = 0
        point = None
        if n == 0:
            scaled = [k for k, (lr, rate) in rates.items() if rate != lr]
            before = dict(zip(scaled, self._snapshot(scaled), strict=True))
            yield
        else:
            with self.fm.measure(self.optimizer, self._feed.take(n), step=self.t) as m:
                yield
            reading = m.read()  # the set point's one synchronisation
            if reading.moved:
                # Tensors whose every probe was left out (not finite) are held.
                measured = {**reading.values, **dict.fromkeys(reading.left_out, math.nan)}
                point = self._set_point(self.t, measured)
                rates = self._rates_at(self.t)
            else:
                self._defer(n, "no parameter changed (a step skipped by a GradScaler?)")
            before = {
                k: w for k, w in m.before.items() if k in rates and rates[k][1] != rates[k][0]
            }
        scale_updates(
            [self._params[k] for k in before],
            list(before.values()),
            [rates[k][1] / rates[k][0] for k in before],
        )
        if point is not None:
            self._owed = 0
            self.history.append(point)
        if self.log_fn is not None:
            scalars = {f"flerm_lr/{k}": v for k, v in self._rates(rates).items()}
            if point is not None:
                scalars.update({f"fslr/{k}": v for k, v in point.fslr.items()})
            self.log_fn(self.t, scalars)
        self.t += 1

    def _snapshot(self, names: list[str]) -> list[Tensor]:
        """The tensors ``names`` before the step, copied into buffers kept from step to step."""
        params = [self._params[n].detach() for n in names]
        for n, p in zip(names, params, strict=True):
            kept = self._before.get(n)
            if kept is None or (kept.shape, kept.dtype, kept.device) != (
                p.shape,
                p.dtype,
                p.device,
            ):
                self._before[n] = torch.empty_like(p)
        return snapshot(params, into=[self._before[n] for n in names])

    def _defer(self, n: int, why: str) -> None:
        self._owed = n
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(
                f"FLeRM: the set point at step {self.t} waits: {why}; it is taken at the next "
                "step that changes the weights",
                RuntimeWarning,
                stacklevel=4,
            )

    def _set_point(self, step: int, fslr: Mapping[str, float]) -> SetPoint:
        targets = self._targets(step)
        measured = {n: float(fslr[n]) if n in fslr else 0.0 for n in self.names}
        # a rate past sqrt(dtype max) overflows inside the optimiser (a 1e300 base FSLR)
        limits = {n: torch.finfo(self._params[n].dtype).max ** 0.5 for n in self.names}
        matched = match(targets, measured, lr0=self.lr0, min_fslr=self.min_fslr, max_rate=limits)
        self.ratios.update(matched.ratios)
        zero, nonfinite, unmatched = matched.zero, matched.nonfinite, matched.unmatched
        if self.scheduler is None and "initial_lr" in self.optimizer.param_groups[0]:
            warnings.warn(
                "FLeRM: a scheduler is attached to the optimizer but was not passed as "
                "scheduler=...: FLeRM applies the base record's schedule ratio instead of it",
                RuntimeWarning,
                stacklevel=4,
            )
        self._note(
            unmatched,
            f"FLeRM step {step}: {{}} have no base tensor to match (parameters added to the model "
            "after FLeRM was built and absent from the base record); they keep their group's "
            "learning rate (record a base run with them to match them)",
        )
        if nonfinite:
            warnings.warn(
                f"FLeRM step {step}: no finite FSLR estimate or rate, or a rate too large for "
                f"the parameter's dtype, for {list(nonfinite[:10])} (every probe of this set point "
                "was left out as not finite, the estimate overflowed, or the base record's "
                "FSLR is absurd); they keep their previous learning rate",
                RuntimeWarning,
                stacklevel=4,
            )
        self._note(
            zero,
            f"FLeRM step {step}: the FSLR or base target of {{}} is zero or below "
            f"min_fslr={self.min_fslr:g} (e.g. LoRA A while B is still zero); they keep "
            "their current learning rate (start FLeRM later with start_step=...)",
        )
        return SetPoint(
            step=step,
            lrs=self._rates(self._rates_at(step)),
            fslr=measured,
            targets=targets,
            held=zero + nonfinite + unmatched,
        )

    def _note(self, names: Sequence[str], message: str) -> None:
        """Warn once per tensor: ``message`` with ``{}`` standing for the newly named ones."""
        new = [n for n in names if n not in self._warned]
        if new:
            self._warned.update(new)
            warnings.warn(message.format(new[:10]), RuntimeWarning, stacklevel=5)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Ratios, history, step and probe-batch count (save with model, optimiser, ``fm``)."""
        return {
            "version": _STATE_VERSION,
            "config": dict(self._config),
            "names": list(self.names),
            "t": self.t,
            "owed": self._owed,
            "ratios": dict(self.ratios),
            "history": [asdict(p) for p in self.history],
            "warned": sorted(self._warned),
            "probes_used": self._feed.used,
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict`; the probe iterable is fast-forwarded past used batches.

        Args:
            state: what :meth:`state_dict` returned.
            strict: refuse a state saved with other options (``mode``, ``every``,
                ``start_step``, ``warmup_samples``, ``policy``, ``min_fslr``, ``scheduler``
                or another base record).

        Raises:
            ValueError: for another version's state, another model's tensors or (``strict``)
                other options, the first differing one named.
        """
        check_state(state, "FLeRM", (1, _STATE_VERSION), self._config, strict)
        if list(state["names"]) != self.names:
            raise ValueError(
                "this FLeRM state is for other tensors: "
                f"{sorted(set(state['names']) ^ set(self.names))[:10]} differ"
            )
        self.t = int(state["t"])
        self._owed = int(state.get("owed", 0))
        self.ratios = {str(k): float(v) for k, v in state["ratios"].items()}
        self.history = [SetPoint(**{**p, "held": tuple(p["held"])}) for p in state["history"]]
        self._warned = set(state["warned"])
        self._feed.skip(int(state["probes_used"]))
