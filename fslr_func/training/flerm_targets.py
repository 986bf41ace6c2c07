r"""What a base record asks of each tensor of the scaled model: FLeRM's targets :math:`T_W(t)`.

A base tensor ``b`` moved the function by :math:`m_b(t) = \eta_b(t)\,\mathrm{FSLR}^\text{base}_b(t)
= \eta_0\,\mathrm{sched}^\text{base}(t)\,\tilde F_b(t)`, with

.. math::

    \tilde F_b(t) = \mathrm{FSLR}^\text{base}_b(t) \, \frac{\eta_{0,b}}{\eta_0}, \qquad
    \eta_{0,b} = \frac{\eta_b(t)}{\mathrm{sched}^\text{base}(t)},

:math:`\eta_b(t)` the rate in force for ``b`` (``base.lrs_at(t)``), :math:`\eta_0` the base
learning rate (``base.meta["base_lr"]``). The policy (:mod:`fslr_func.training.policies`)
maps :math:`\tilde F` onto the scaled model's tensors: :math:`T_W(t)`. With one base rate for
every tensor, :math:`\tilde F_b = \mathrm{FSLR}^\text{base}_b`, the paper's rule.

:class:`BaseTargets` also owns the names on both sides: the scaled model's (bare, without the
``_orig_mod.`` of ``torch.compile`` or a DDP ``module.``; :mod:`fslr_func.probe.names`) and
the record's, and it checks, once, that the record can drive this model at all (estimator,
grouping, architecture, base rate).

Examples:
    >>> import torch, fslr_func as ff
    >>> base = ff.FSLRRecord(meta={"base_lr": 0.1, "estimator": "kron"})
    >>> base.append(0, {"weight": 0.5, "bias": 0.25})
    >>> fm = ff.with_fslr(torch.nn.Linear(3, 2), samples=2, seed=0)
    >>> targets = BaseTargets(fm, base, "identity")
    >>> targets.check(["weight", "bias"])
    >>> targets.at(0, ["weight", "bias"], lambda names, message: None)
    {'weight': 0.5, 'bias': 0.25}
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

from torch import Tensor

from ..io.record import FSLRRecord, grouping_meta
from ..io.record_meta import is_learning_rate
from ..probe.names import recorded_names
from . import policies
from .wrapper import FSLRModule

__all__ = ["BaseTargets", "Note", "PastEnd", "Unknown"]

Unknown = Literal["error", "nearest", "hold"]
"""What FLeRM does where the base FSLR of a tensor it drives is unknown (the base run could not
measure it): refuse, use the nearest known value, or hold the tensor at its group's rate."""
PastEnd = Literal["warn", "error"]
"""What FLeRM does at a step past the base record's last one: reuse its last values with one
warning, or raise."""

Note = Callable[[Sequence[str], str], None]
"""``note(names, message)``: warn once per tensor; ``{}`` in ``message`` stands for the names."""


class BaseTargets:
    """The base record's targets for the scaled model's tensors, and the names that link them.

    Args:
        fm: the wrapped scaled model.
        base: the base run's record.
        policy: anything :func:`fslr_func.training.policies.resolve` accepts.
        unknown: what to do with an unknown base FSLR (:data:`Unknown`).
        past_end: what to do past the record's last step (:data:`PastEnd`).

    Attributes:
        params: the scaled model's parameters by name (``fm.module.named_parameters()``).
        late: tensors added to the model after this object was built (late adapters).
        lr0: :math:`\\eta_0`, after :meth:`check`.
        one_to_one: whether the policy maps each tensor to the base tensor of its name.
    """

    def __init__(
        self,
        fm: FSLRModule,
        base: FSLRRecord,
        policy: policies.PolicySpec,
        unknown: Unknown = "error",
        past_end: PastEnd = "warn",
    ) -> None:
        if unknown not in ("error", "nearest", "hold"):
            raise ValueError(f"unknown must be 'error', 'nearest' or 'hold', got {unknown!r}")
        if past_end not in ("warn", "error"):
            raise ValueError(f"past_end must be 'warn' or 'error', got {past_end!r}")
        self.unknown: Unknown = unknown
        self.past_end: PastEnd = past_end
        self.fm = fm
        self.base = base
        self._warned_past: set[str] = set()
        self.policy = policies.resolve(policy)
        self.one_to_one = policies.is_one_to_one(self.policy)
        self.params: dict[str, Tensor] = {}
        self.late: set[str] = set()
        self.lr0 = 0.0
        self.index()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, pickle) holds other parameter objects: ``name_of`` is
        keyed by their ``id``."""
        vars(self).update(state)
        self.name_of = {id(p): n for n, p in self.params.items()}

    def index(self) -> None:
        """Read the model's parameters and their names (bare, and as the record has them)."""
        known = self.params
        self.params = dict(self.fm.module.named_parameters())
        if known:  # parameters added to the model after FLeRM was built
            self.late |= self.params.keys() - known.keys()
        self.name_of = {id(p): n for n, p in self.params.items()}
        prefix = self.fm.name_prefix
        self.bare = {n: n.removeprefix(prefix) for n in self.params}
        self.base_names = recorded_names(self.base.names, self.bare.values())

    def check(self, names: Sequence[str]) -> None:
        """Refuse a record that cannot drive these tensors of this model.

        Raises:
            ValueError: an empty record, one without a positive ``base_lr``, one with ``lrs``
                and a zero schedule ratio, another estimator or grouping than the wrapper's,
                or (one-to-one policy) tensors of another rank; the message names the fix.
        """
        base, fm = self.base, self.fm
        if len(base) == 0:
            raise ValueError("the base record is empty: record a base run first")
        lr0 = base.meta.get("base_lr")
        if lr0 is None:
            raise ValueError(
                "the base record has no meta['base_lr'] (lr_0): record it with a Recorder or "
                "set record.meta['base_lr']"
            )
        if not is_learning_rate(lr0):
            raise ValueError(f"the base record's meta['base_lr'] must be a number > 0, got {lr0!r}")
        self.lr0 = float(lr0)
        stalled = [s for s, r in zip(base.steps, base.sched, strict=True) if r == 0]
        if base.lrs and stalled:
            raise ValueError(
                f"the base record's schedule ratio is 0 at steps {stalled[:10]}: its un-scheduled "
                "rates lrs / sched are undefined there; set record.lrs = {} to run every base "
                "tensor at base_lr"
            )
        estimator = base.meta.get("estimator")
        if estimator is not None and estimator != fm.estimator:
            raise ValueError(
                f"the base record was measured with estimator {estimator!r} but the scaled "
                f"model's wrapper uses {fm.estimator!r}: FSLRs of different estimators "
                f"are not comparable (tensors {list(names[:10])}); use with_fslr(..., "
                f"estimator={estimator!r}) or re-record the base"
            )
        grouping, own = base.meta.get("grouping"), grouping_meta(fm.grouping)
        if grouping is not None and grouping != own and fm.estimator != "exact":
            raise ValueError(
                f"the base record was measured with grouping {grouping!r} but the scaled model's "
                f"wrapper uses {own!r}: FSLRs of tensors of rank 3 or more (conv weights) differ "
                f"between groupings (tensors {list(names[:10])}); use the base run's grouping "
                "in with_fslr(..., grouping=...) or re-record the base"
            )
        if self.one_to_one:
            shapes = self.base_shapes()
            bad = [
                f"{n!r}: base {list(shapes[b])} vs scaled {list(self.params[n].shape)}"
                for n in names
                if (b := self.bare[n]) in shapes and len(shapes[b]) != self.params[n].dim()
            ]
            if bad:
                raise ValueError(
                    "the base record is from another architecture: tensors of different rank "
                    f"under the identity policy: {bad[:10]}"
                )

    def check_unknown(self, names: Sequence[str], first: int, last: int | None) -> None:
        """Refuse a record whose FSLR is unknown, at a row read between steps ``first`` and
        ``last`` (``None``: the end), for a tensor of ``names`` (unless ``unknown="hold"``,
        or ``"nearest"`` and the tensor has a known value somewhere).

        Raises:
            ValueError: naming the tensors and their steps, and the fallbacks.
        """
        rows = self.base.unknown_steps(first, last)
        if self.one_to_one:
            driven = {self.bare[n] for n in names}
            rows = {b: s for b, s in rows.items() if self.base_names.get(b) in driven}
        if self.unknown == "nearest":
            known = self.base.at(0, unknown="nearest")
            rows = {b: s for b, s in rows.items() if b not in known}
        if rows and self.unknown != "hold":
            listed = "; ".join(f"{b!r} at steps {s[:5]}" for b, s in list(rows.items())[:10])
            fallbacks = (
                "they are unknown at every row, so unknown='nearest' has no value to use: "
                "FLeRM(..., unknown='hold') keeps them at their group's rate"
                if self.unknown == "nearest"
                else "choose a fallback: FLeRM(..., unknown='nearest') uses each tensor's "
                "nearest known value, unknown='hold' keeps it at its group's rate"
            )
            raise ValueError(
                f"the base record's FSLR is unknown for tensors FLeRM drives: {listed} (the base "
                "run could not measure them: no finite probe, a 16-bit update that rounded to "
                "nothing, or they never moved, e.g. frozen or at rate 0); "
                f"{fallbacks}; or freeze them in the scaled run too, or "
                "re-record the base"
            )

    def covers(self, step: int, what: str, *, rows: bool = False) -> None:
        """Past the record's last step, or (``rows``: a lookup of its FSLR rows, not of its
        per-step schedule) before the base run's first probed step: warn once per kind of
        lookup, or raise (``past_end="error"``).

        Raises:
            ValueError: ``step`` is outside the record and ``past_end="error"``.
        """
        early = self.base.before_start(step, what) if rows else None
        message = early or self.base.past_end(step, what)
        if message is None:
            return
        if self.past_end == "error":
            fix = (
                "start FLeRM (start_step) where the base's probes start"
                if early
                else "record a base run as long as this one"
            )
            raise ValueError(
                f"FLeRM: {message}; past_end='error' asks for exactness: {fix}, or pass "
                "past_end='warn'"
            )
        if what not in self._warned_past:
            self._warned_past.add(what)
            warnings.warn(
                f"FLeRM: {message} (warned once; past_end='error' makes it an error)",
                RuntimeWarning,
                stacklevel=5,
            )

    def at(self, step: int, names: Sequence[str], note: Note) -> dict[str, float]:
        r"""Targets :math:`T_W` of ``names`` at ``step``; a zero target is allowed (the tensor
        is then held).

        The policy gets :math:`\tilde F_b`, computed as ``fslr * ((lr_b / lr_0) / sched)``: for
        a tensor at the rate the schedule ratio was measured from (``sched = lr_b / lr_0``, as
        the Recorder stores it) the factor is exactly 1, so records with one base rate give
        exactly the base FSLRs. Base tensors without a recorded rate count as running at
        :math:`\eta_0`. The policy maps the whole model (an optimiser may hold a subset: Muon
        + AdamW); under a one-to-one policy a record of a subset is matched on that subset.

        Args:
            step: the training step.
            names: the tensors FLeRM drives.
            note: warns once per tensor (record tensors the model lacks).
        """
        self.covers(step, "set point", rows=True)
        lr0 = self.lr0 or float(self.base.meta["base_lr"])
        fslr = self.base.at(step, unknown="nearest" if self.unknown == "nearest" else "omit")
        rates, sched = self.base.lrs_at(step), self.base.sched_at(step)
        moved = {
            self.base_names[b]: f * (rates[b] / lr0 / sched) if b in rates else f
            for b, f in fslr.items()
        }
        lacking: list[str] = []
        if self.unknown == "hold":  # (with "error", check_unknown left none FLeRM drives)
            lacking = [self.base_names[b] for b in self.base.names if b not in fslr]
            moved.update(dict.fromkeys(lacking, 0.0))  # a zero target: held at the group's rate
        bare, driven = self.bare, set(names)
        if self.one_to_one:
            present = set(bare.values())
            note(
                [b for b in moved if b not in present],
                "FLeRM: the base record has tensors {} that the scaled model does not have "
                "(yet): they are matched once added to the model (adapters added later); "
                "otherwise check that the record is from this architecture",
            )
            moved = {b: f for b, f in moved.items() if b in present}
            # every tensor the record has, frozen ones included (freezing a tensor does not
            # change the architecture); tensors added late and absent from the record are held
            model = [
                bare[n]
                for n in self.params
                if bare[n] in moved or (n in driven and n not in self.late)
            ]
        else:
            model = self._mapped(driven)
        try:
            targets = policies.apply(self.policy, moved, model, allow_zero=True)
        except ValueError:
            # tensors that joined late (gradual unfreezing) of a role the record lacks: held
            # at their group's rate, as under a one-to-one policy, not an error mid-run
            late = {bare[n] for n in self.late}
            if self.one_to_one or not late & set(model):
                raise
            model = [b for b in model if b not in late]
            targets = policies.apply(self.policy, moved, model, allow_zero=True)
            note(
                [n for n in names if bare[n] in late and bare[n] not in targets],
                f"FLeRM step {step}: {{}} joined after FLeRM was built, and the base record "
                "has no tensor of their role: they keep their group's learning rate",
            )
        if lacking:
            # held: every tensor that answers to an unknown base tensor (a policy summing
            # blocks, L < B, would add the zero in as a smaller target)
            unknown = set(lacking)
            links = policies.counterparts(self.policy, list(moved), model)
            held = [n for n in names if unknown & set(links.get(bare[n], ()))]
            targets.update(dict.fromkeys((bare[n] for n in held), 0.0))
            note(
                held,
                f"FLeRM step {step}: {{}} answer to base tensors whose FSLR the base record "
                "does not know; they keep their group's learning rate (unknown='hold')",
            )
        return {n: targets[bare[n]] for n in names if bare[n] in targets}

    def base_shapes(self) -> dict[str, tuple[int, ...]]:
        """The base record's shapes under this model's names (a record made under
        ``module.`` or a checkpoint wrapper's names reads as this model's)."""
        return {self.base_names.get(n, n): tuple(s) for n, s in self.base.shapes.items()}

    def _mapped(self, driven: set[str]) -> list[str]:
        """The bare names a policy that is not one-to-one maps: the trainable tensors, those
        driven, and, in a model of the base's tensors (every trainable name recorded: the
        same depth), the frozen ones the record has (trained in the base run, frozen in this
        one: freezing a tensor does not change the architecture). A tensor frozen in both
        runs is in neither stack, as the frozen weights under adapters are not: counting it
        (a frozen first block, a frozen ``fc2`` beside a trained ``fc1``) would shift the
        blocks' mapping against the record's. In a deeper or shallower model names do not
        tell which blocks correspond, so the trainable stacks are mapped onto each other."""
        recorded = set(self.base_names.values())
        trainable = {n for n, p in self.params.items() if p.requires_grad or n in driven}
        same = all(self.bare[n] in recorded for n in trainable)
        return [
            self.bare[n]
            for n in self.params
            if n in trainable or (same and self.bare[n] in recorded)
        ]

    def counterparts(self, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """For each tensor of ``names`` (bare name), the base tensors (bare names) whose
        targets the policy maps onto it (:func:`fslr_func.training.policies.counterparts`):
        the tensor of its name under a one-to-one policy, the base block it answers to under
        ``share_blocks``.

        Examples:
            >>> import torch, fslr_func as ff
            >>> base = ff.FSLRRecord(meta={"base_lr": 0.1})
            >>> base.append(0, {"weight": 0.5, "bias": 0.25})
            >>> fm = ff.with_fslr(torch.nn.Linear(3, 2), samples=2, seed=0)
            >>> BaseTargets(fm, base, "identity").counterparts(["weight"])
            {'weight': ('weight',)}
        """
        recorded = list(self.base_names.values())
        links = policies.counterparts(self.policy, recorded, self._mapped(set(names)))
        return {self.bare[n]: links[self.bare[n]] for n in names if self.bare[n] in links}
