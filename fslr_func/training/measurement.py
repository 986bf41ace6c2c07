"""A measured optimiser step and the estimates read from it: :class:`Measurement`,
:class:`Reading`, and :func:`read_estimates`, the wrapper's one host synchronisation.

With a sampled estimator a measured step never reads a tensor's value on the host (on a GPU each
read is a synchronisation; ``estimator="exact"`` reads each tensor's there): the EMAs, the counts of
probes folded in or left out and the flags of which tensors moved all stay on the device.
:func:`read_estimates` stacks what a reading needs into one tensor per parameter (:class:`Row`),
reads them all at once, reports the probes left out since the last reading in one warning
(:class:`DropReports`: once per run of readings that leave a tensor's probes out, not at every
reading of a diverged run), and returns a :class:`Reading`.

Examples:
    >>> import torch
    >>> from fslr_func.stats.estimator import EMA
    >>> ema = EMA(0.9)
    >>> ema.update({"w": torch.log(torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64))})
    >>> log_sq = {"w": torch.tensor(4.0, dtype=torch.float64).log()}  # ||Delta f||^2 = 4
    >>> reading = read_estimates(log_sq, ema, folded={}, changed={}, reported=DropReports())
    >>> reading.values, reading.moved
    ({'w': 2.0}, ())
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..probe.functional import Inputs, is_dtensor, stored_entries
from ..probe.names import short_list
from ..stats.estimator import EMA, fslr_from_log
from .rates import ScaledSince, group_rates, rates_in_force
from .update_scaling import Snapshots

__all__ = ["DropReports", "Measurement", "Reading", "Row", "read_estimates"]


@dataclass
class DropReports:
    """What the warnings about left-out probes have said, per tensor (the wrapper's, shared by
    its readings).

    Attributes:
        counts: the drops counted at the last reading.
        dropping: the tensors whose probes a reading found left out: a reading that finds
            them left out again (a diverged run, every probe NaN) does not warn again; once a
            measured step folds a finite probe of them in, the next drop warns.
    """

    counts: dict[str, int] = field(default_factory=dict)
    dropping: set[str] = field(default_factory=set)


@dataclass
class Measurement:
    """One measured optimiser step, filled in when the ``measure`` block exits.

    Attributes:
        before: the trainable tensors before the step (name -> copy; the wrapper's copies are
            buffers it refills at its next measured step).
        lrs: the learning rate each tensor's update was taken at (its group's, times FLeRM's
            factor where FLeRM scaled the update inside the block).
        delta: the unit-learning-rate updates, ``(after - before) / lr``.
        log_sq: the wrapper's log ``||Delta_W f||^2_RMS`` estimates after folding this
            step's probes in, on the device (NaN: nothing valid measured yet); computed when
            first read (:class:`~fslr_func.training.wrapper.LogSqAtStep`).
        folded: per tensor, how many of this step's probes were folded into its EMA (the
            others were left out as not finite, or the tensor did not move), on the device.
        changed: per tensor, whether the step changed it (a 0-d bool on the device). A tensor
            the step left unchanged (no gradient, a step skipped by a ``GradScaler``) keeps
            its EMA; read as :attr:`moved`.
        rounded: per 16-bit tensor (bfloat16, float16), whether the step left it unchanged
            although its gradient is finite and not zero: its update rounded to nothing in
            the parameter's dtype (a rate too small for its precision), which says nothing
            of its FSLR; read as :attr:`rounded_away`.
        ema: the EMA the estimates come from (set when the block exits).
        inputs: the probe batches of this step (set when the block exits).
        reported: the wrapper's drops already warned about (shared).
    """

    before: dict[str, Tensor]
    lrs: dict[str, float]
    delta: dict[str, Tensor] = field(default_factory=dict)
    log_sq: Mapping[str, Tensor] = field(default_factory=dict)
    folded: dict[str, Tensor] = field(default_factory=dict)
    changed: dict[str, Tensor] = field(default_factory=dict)
    rounded: dict[str, Tensor] = field(default_factory=dict)
    ema: EMA | None = None
    inputs: list[Inputs] = field(default_factory=list)
    reported: DropReports = field(default_factory=DropReports)
    _reading: Reading | None = None

    @classmethod
    def before_step(
        cls,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        snapshots: Snapshots | None = None,
    ) -> tuple[Measurement, ScaledSince]:
        """Snapshot the tensors the optimisers will update at a non-zero rate (a zero-size
        tensor moves nothing: it has no FSLR and is not probed), into ``snapshots``' buffers
        where given (reused step to step: :attr:`before` is then valid until the next step).

        A step at which every rate is 0 while a scheduler drives the rates (a group has an
        ``initial_lr`` > 0: a warm-up from 0, as Hugging Face's schedules start) has nothing
        to measure: it is taken, a warning says so, and the measurement is empty.

        Raises:
            ValueError: the optimisers update none of ``module``'s parameters, or every rate
                is 0 at this step and no scheduler drives them.
        """
        current = dict(module.named_parameters())  # one walk of the module for the step
        held: dict[str, float] = {}
        rates: dict[str, float] = {}
        for o in optimizers:
            own = group_rates(module, o, current)
            held.update(own)
            rates.update(rates_in_force(module, o, current, own))
        if not held:
            raise ValueError(
                "the optimiser updates none of the module's trainable parameters: build it "
                "from fm.parameters()"
            )
        lrs = {n: lr for n, lr in held.items() if rates[n] != 0.0 and current[n].numel() > 0}
        if not lrs and _warming_up(optimizers):
            warnings.warn(
                "fm.measure: every learning rate is 0 at this step (a warm-up from 0): there "
                "is no update to measure; the step is taken and the estimates keep their values",
                RuntimeWarning,
                stacklevel=4,
            )
        elif not lrs:
            raise ValueError(
                "every learning rate is 0 at this step (a warm-up from 0?): there is no update "
                "to measure; measure a step with a non-zero rate (Recorder and FLeRM wait for "
                "one by themselves)"
            )
        kept = {n: current[n] for n in lrs}
        before = (
            {n: p.detach().clone() for n, p in kept.items()}
            if snapshots is None
            else snapshots.take(kept)
        )
        # FLeRM may scale this step's update inside the block: then it was taken at its rate
        return cls(before, lrs), ScaledSince(optimizers)

    def after_step(self, module: nn.Module, scaled: ScaledSince, updates: Snapshots) -> None:
        """The unit-rate updates ``(after - before) / lr``, each divided by the rate it was
        taken at, into ``updates``' buffers, reused step to step (:attr:`delta` is valid
        until the next step), and which tensors moved (decided on the device: reading it
        would synchronise every step; an unchanged tensor's probe is computed but not folded
        in)."""
        current = dict(module.named_parameters())
        self.lrs = lrs = {**self.lrs, **scaled.rates(module, self.lrs, current)}
        self.delta = updates.differences(current, self.before, lrs)
        self.changed = _changed_all({n: self.delta[n] for n in lrs})
        self.rounded = {
            n: _rounded_away(current[n], self.changed[n])
            for n in lrs
            if current[n].dtype.itemsize <= 2 and current[n].grad is not None
        }

    def read(self) -> Reading:
        """This step's estimates on the host: one synchronisation (:func:`read_estimates`),
        made once and kept; empty before the block exits."""
        if self._reading is None:
            if self.ema is None:
                return Reading({}, {}, (), ())
            self._reading = read_estimates(
                self.log_sq, self.ema, self.folded, self.changed, self.reported, self.rounded
            )
        return self._reading

    @property
    def fslr(self) -> dict[str, Tensor]:
        """The FSLR estimates after this step (float64 scalars); tensors without a valid
        measurement are left out."""
        return self.read().fslr

    @property
    def moved(self) -> tuple[str, ...]:
        """The tensors the step changed (the others kept their estimates); empty: nothing
        moved, as in a step skipped by a ``GradScaler``."""
        return self.read().moved

    @property
    def left_out(self) -> tuple[str, ...]:
        """Tensors that moved but none of whose probes at this step could be folded in (their
        statistics were not finite)."""
        return self.read().left_out

    @property
    def rounded_away(self) -> tuple[str, ...]:
        """16-bit tensors with a finite, non-zero gradient that the step left unchanged: their
        update rounded to nothing in the parameter's dtype, so the step says nothing of their
        FSLR (not 0: they did not move because of the rate's size, not the function's)."""
        return self.read().rounded


def _warming_up(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether a scheduler drives the rates: some group starts from an ``initial_lr`` > 0."""
    return any(float(g.get("initial_lr") or 0.0) > 0.0 for o in optimizers for g in o.param_groups)


def _changed(delta: Tensor) -> Tensor:
    """Whether an update is non-zero anywhere: a 0-d bool on the device (a NaN counts as a
    change). An FSDP2 shard's answer is reduced over the ranks (a DTensor's
    ``full_tensor``), so every rank agrees."""
    if is_dtensor(delta):
        flag: Tensor = delta.any().full_tensor()  # type: ignore[attr-defined]
        return flag
    # two vectorised reductions: 5x faster than any() on a CPU, which is not vectorised
    return (delta.amax() != 0) | (delta.amin() != 0)


FOREACH_CHANGED_NUMEL = 2**14
"""Updates up to this many elements are checked for a change together, on a CPU
(:func:`_changed_all`); larger ones each by their own two vectorised reductions."""


def _changed_all(deltas: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """:func:`_changed` of every update. On a CPU the small updates (up to
    :data:`FOREACH_CHANGED_NUMEL` elements, where the per-tensor cost is the dispatch of four
    operations) go through one multi-tensor 1-norm, which is non-zero exactly where
    :func:`_changed` is true (a sum of magnitudes neither underflows nor cancels, and a NaN
    propagates); the large ones, whose 1-norm is slower than ``amax`` and ``amin`` (on the
    ResMLP of width 512: 0.55 ms against 0.18 ms), and every update on other devices (a
    GPU's multi-tensor kernels need not propagate a NaN) and FSDP2 shards, tensor by
    tensor."""
    small = [
        n
        for n, d in deltas.items()
        if d.device.type == "cpu" and not is_dtensor(d) and d.numel() <= FOREACH_CHANGED_NUMEL
    ]
    flags: dict[str, Tensor] = {}
    if len(small) > 1:
        norms = torch._foreach_norm([deltas[n] for n in small], 1)
        flags = dict(zip(small, torch.stack(norms).ne(0).unbind(0), strict=True))
    return {n: flags[n] if n in flags else _changed(d) for n, d in deltas.items()}


def _rounded_away(param: Tensor, changed: Tensor) -> Tensor:
    """Whether ``param`` has a finite, non-zero gradient but the step left it unchanged: a
    0-d bool on the device (its update rounded to nothing in the parameter's dtype)."""
    assert param.grad is not None
    grad = param.grad.detach()
    sharded = is_dtensor(grad)  # an FSDP2 shard, which may be empty on this rank
    entries = grad.to_local() if sharded else stored_entries(grad)  # type: ignore[attr-defined]
    largest = entries.abs().amax() if entries.numel() else entries.new_zeros(())
    if sharded:
        for group in grad.device_mesh.get_all_groups():  # type: ignore[attr-defined]
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return ~changed & (largest > 0) & largest.isfinite()


@dataclass(frozen=True)
class Reading:
    """Estimates read on the host.

    Attributes:
        fslr: tensor name -> FSLR (float64 scalar), for the tensors with a valid measurement.
        values: the same as Python floats (read in the same synchronisation).
        moved: the tensors the step read changed (every tensor, outside a step).
        left_out: tensors that moved but none of whose probes could be folded in.
        rounded: 16-bit tensors whose update rounded to nothing although their gradient was
            finite and not zero (:attr:`Measurement.rounded_away`).
    """

    fslr: dict[str, Tensor]
    values: dict[str, float]
    moved: tuple[str, ...]
    left_out: tuple[str, ...]
    rounded: tuple[str, ...] = ()


@dataclass(frozen=True)
class Row:
    """What one reading learns of one tensor, read from the device in one stacked tensor.

    Attributes:
        unknown: no valid measurement yet (the estimate is NaN).
        dropped: probes of this tensor left out so far (not finite).
        last_dropped: the step label of the latest of them.
        folded: probes folded into its EMA at this step (or in all, outside a step).
        fslr: the FSLR estimate.
        changed: whether the step changed the tensor.
        rounded: whether its update rounded to nothing (:attr:`Measurement.rounded`).
    """

    unknown: bool
    dropped: int
    last_dropped: int
    folded: int
    fslr: float
    changed: bool
    rounded: bool = False

    @classmethod
    def stack(
        cls,
        log_sq: Tensor,
        ema: EMA,
        name: str,
        folded: Tensor | None,
        changed: Tensor | None,
        rounded: Tensor | None = None,
    ) -> Tensor:
        """The row's fields as one float64 tensor on the device, in field order."""
        dropped = ema.dropped[name]
        return torch.stack(
            [
                torch.isnan(log_sq),
                dropped,
                ema.last_dropped[name],
                ema.counts[name] if folded is None else folded,
                fslr_from_log(log_sq),
                torch.ones_like(dropped) if changed is None else changed,
                torch.zeros_like(dropped) if rounded is None else rounded,
            ]
        ).to(torch.float64)

    @classmethod
    def of(cls, values: list[float]) -> Row:
        """The row from its fields read on the host."""
        unknown, dropped, last_dropped, folded, fslr, changed, rounded = values
        return cls(
            bool(unknown),
            int(dropped),
            int(last_dropped),
            int(folded),
            float(fslr),
            bool(changed),
            bool(rounded),
        )


def read_estimates(
    log_sq: Mapping[str, Tensor],
    ema: EMA,
    folded: Mapping[str, Tensor],
    changed: Mapping[str, Tensor],
    reported: DropReports,
    rounded: Mapping[str, Tensor] | None = None,
) -> Reading:
    """``log_sq`` as FSLRs, after one synchronisation that finds and reports the drops.

    Args:
        log_sq: tensor name -> log ``||Delta_W f||^2_RMS`` estimate, on the device.
        ema: the EMA the estimates come from (its drop counts and probe counts).
        folded: per tensor, the probes folded in at this step (default: the EMA's counts).
        changed: per tensor, whether the step changed it (default: every tensor).
        reported: the drops already reported; updated here.
        rounded: per 16-bit tensor, whether its update rounded to nothing (default: none).

    Returns:
        The :class:`Reading`; tensors without a valid measurement are left out of its
        estimates.
    """
    names = list(log_sq)
    if not names:
        return Reading({}, {}, tuple(changed), ())
    rounded = rounded or {}
    stacked = [
        Row.stack(log_sq[n], ema, n, folded.get(n), changed.get(n), rounded.get(n)) for n in names
    ]
    rows = {
        n: Row.of(values)
        for n, values in zip(
            names, torch.stack([r.to(stacked[0].device) for r in stacked]).tolist(), strict=True
        )
    }
    by_step: dict[int, list[str]] = {}
    for n, row in rows.items():
        if row.dropped > reported.counts.get(n, 0):
            if n not in reported.dropping:
                by_step.setdefault(row.last_dropped, []).append(n)
            reported.dropping.add(n)
        elif n in folded and row.folded > 0:  # a measured step folded finite probes in
            reported.dropping.discard(n)
        reported.counts[n] = row.dropped
    if by_step:
        listed = "; ".join(f"step {k}: {short_list(v)}" for k, v in sorted(by_step.items()))
        warnings.warn(
            f"fslr_func: probe statistics that were not finite (NaN or Inf: a NaN in the "
            f"probe batch, an output that overflowed, or a diverged update) were left out "
            f"of the FSLR averages ({listed}); those averages kept their previous values",
            RuntimeWarning,
            stacklevel=3,
        )
    valid = [n for n, row in rows.items() if not row.unknown]
    moved = tuple(n for n in changed if rows[n].changed)
    return Reading(
        fslr={n: fslr_from_log(log_sq[n]) for n in valid},
        values={n: rows[n].fslr for n in valid},
        moved=moved,
        left_out=tuple(n for n in moved if rows[n].folded == 0),
        rounded=tuple(n for n in rounded if n in rows and rows[n].rounded),
    )
