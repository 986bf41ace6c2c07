r"""Record the FSLRs of a (base) run inside any training loop: :class:`Recorder`.

Algorithm 1 of the paper (red): around step ``t`` of the optimiser, the unit-learning-rate update
``dW = (W_after - W_before) / lr_W`` of every tensor is probed on a *fresh* probe batch (not the
training batch) and folded into the wrapper's EMAs, and

.. math::

    \mathrm{FSLR}_W(t) = \|\Delta_W f\|_\mathrm{RMS} \text{ at learning rate } 1

is appended to an :class:`~fslr_func.record.FSLRRecord` with the learning rates in force and the
scheduler ratio :math:`\mathrm{sched}(t) = \eta(t) / \eta_0`. The EMAs are warmed up at the first
recorded step with :math:`\lceil \text{warmup\_samples} / S \rceil` probes of the same update on
fresh batches (``S`` omega samples per probe; the paper uses 40 samples), then one probe every
``every`` steps (the paper: 100). Other steps cost nothing: no snapshot, no probe.

Example:
    >>> import torch, fslr_func as ff
    >>> from fslr_func.recorder import Recorder
    >>> _ = torch.manual_seed(0)
    >>> fm = ff.with_fslr(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
    ...                                       torch.nn.Linear(8, 3)), samples=4, seed=0)
    >>> opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    >>> rec = Recorder(fm, (torch.randn(16, 4) for _ in range(100)), warmup_samples=8, every=5)
    >>> for t in range(11):
    ...     opt.zero_grad()
    ...     fm(torch.randn(16, 4)).square().mean().backward()
    ...     with rec.step(opt):
    ...         opt.step()
    >>> rec.record.steps, rec.probes_used  # 2 warm-up probes at step 0, then one per 5 steps
    ([0, 5, 10], 4)
    >>> rec.record.meta["base_lr"], rec.record.sched
    (0.01, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .estimator import Grouping
from .functional import Inputs
from .record import FSLRRecord, optimizer_meta
from .transform import FSLRModule, Measurement

__all__ = ["ProbeFeed", "ProbePlan", "Recorder", "grouping_meta"]

_STATE_VERSION = 1


@dataclass(frozen=True)
class ProbePlan:
    """When to probe: a warm-up at ``start_step``, then one probe every ``every`` steps.

    Attributes:
        warmup_probes: probes (fresh batches, same update) at ``start_step``.
        every: period of the single probes after the warm-up; ``None``: warm-up only.
        start_step: the first probed step; earlier steps are not probed.

    Example:
        >>> plan = ProbePlan.of(warmup_samples=40, samples=8, every=100, start_step=5)
        >>> [plan.probes_at(t) for t in (0, 5, 6, 105, 205, 206)]
        [0, 5, 0, 1, 1, 0]
    """

    warmup_probes: int
    every: int | None
    start_step: int

    @classmethod
    def of(cls, warmup_samples: int, samples: int, every: int | None, start_step: int) -> ProbePlan:
        """Validate the options; ``warmup_probes = ceil(warmup_samples / samples)``."""
        if not isinstance(warmup_samples, int) or warmup_samples < 1:
            raise ValueError(f"warmup_samples must be a positive integer, got {warmup_samples!r}")
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be None or a positive integer, got {every!r}")
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative integer, got {start_step!r}")
        return cls(math.ceil(warmup_samples / samples), every, start_step)

    def probes_at(self, step: int) -> int:
        """Number of probe batches at ``step`` (0 on steps that are not probed)."""
        if step == self.start_step:
            return self.warmup_probes
        after = step - self.start_step
        return int(self.every is not None and after > 0 and after % self.every == 0)


class ProbeFeed:
    """Draws probe batches from an iterable, counting them so that a resumed run can skip them.

    The iterator is created at the first draw; after :meth:`skip` (a resume) it first discards
    the batches the interrupted run used, so a deterministic iterable re-created from scratch
    (e.g. ``experiments.batches(..., generator=seed)``) yields the same batches as an
    uninterrupted run.

    Example:
        >>> feed = ProbeFeed(range(10))
        >>> feed.take(2), feed.take(1), feed.used
        ([0, 1], [2], 3)
        >>> again = ProbeFeed(range(10))
        >>> again.skip(3)
        >>> again.take(2)
        [3, 4]
    """

    def __init__(self, batches: Iterable[Inputs]) -> None:
        self._source = batches
        self._it: Iterator[Inputs] | None = None
        self._pending = 0
        self.used = 0

    def skip(self, used: int) -> None:
        """Resume after ``used`` batches: they are discarded from a fresh iterator at next draw."""
        self._it = None
        self._pending = used
        self.used = used

    def take(self, n: int) -> list[Inputs]:
        """The next ``n`` probe batches."""
        if self._it is None:
            self._it = iter(self._source)
            if len(self._draw(self._pending)) < self._pending:
                raise ValueError(
                    f"probe_batches has fewer than the {self._pending} batches the checkpointed "
                    "run used: hand in the same (re-created) iterable"
                )
        out = self._draw(n)
        if len(out) < n:
            raise ValueError(
                f"probe_batches ran out after {self.used + len(out)} batches: hand in an endless "
                "iterable of probe inputs (e.g. a generator over shuffled batches)"
            )
        self.used += n
        return out

    def _draw(self, n: int) -> list[Inputs]:
        assert self._it is not None
        return list(itertools.islice(self._it, n))


def grouping_meta(grouping: Grouping) -> str:
    """``grouping`` as stored in ``record.meta["grouping"]``: a name as is, a callable marked.

    A callable grouping cannot be saved, so it is stored as ``"callable:"`` and its qualified
    name; FLeRM compares groupings by these strings.

    Example:
        >>> def by_kernel(name, shape):
        ...     return None
        >>> grouping_meta("auto"), grouping_meta(by_kernel)
        ('auto', 'callable:by_kernel')
    """
    if isinstance(grouping, str):
        return grouping
    name = getattr(grouping, "__qualname__", None) or type(grouping).__qualname__
    return f"callable:{name}"


def schedule_ratio(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    base_lr: float,
) -> float:
    """``lr(t) / lr(0)`` of the first param group: the scheduler's, else relative to ``base_lr``.

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        >>> schedule_ratio(opt, None, 1.0)
        0.5
    """
    if scheduler is not None:
        return float(scheduler.get_last_lr()[0]) / float(scheduler.base_lrs[0])
    return float(optimizer.param_groups[0]["lr"]) / base_lr


class Recorder:
    r"""Records a run's FSLRs into :attr:`record` from inside any training loop.

    Use ``with recorder.step(optimizer): optimizer.step()`` on *every* training step (or
    ``around_step=lambda t: recorder.step(opt)`` with :func:`fslr_func.experiments.train`). On a
    probed step the block yields the :class:`~fslr_func.transform.Measurement` and a row
    :math:`(t, \mathrm{FSLR}_W(t), \eta_W(t), \mathrm{sched}(t))` is appended to
    :attr:`record`; on other steps it yields ``None`` and does nothing else.

    Args:
        fm: the wrapped base model (:func:`fslr_func.with_fslr`).
        probe_batches: endless iterable of probe inputs (a tensor, a tuple of positional
            arguments or a dict of keyword arguments per item), separate from the training
            batches.
        warmup_samples: omega samples of the EMA warm-up at ``start_step``:
            ``ceil(warmup_samples / fm.samples)`` probes of that step's update on fresh batches.
        every: probe once every ``every`` steps after the warm-up; ``None``: warm-up only.
        start_step: first recorded step (LoRA: 5, when ``B`` has left zero).
        base_lr: ``lr_0`` stored in ``record.meta["base_lr"]``; default: the first param
            group's ``initial_lr`` (set by schedulers) or ``lr`` at the first recorded step.
        scheduler: the run's ``torch.optim.lr_scheduler`` scheduler: ``sched(t)`` is its
            ``get_last_lr()[0] / base_lrs[0]``; without one, ``sched(t) = lr(t) / base_lr``
            for the first param group.
        meta: extra JSON-able metadata (e.g. ``{"seed": 0, "width": 128}``), merged over the
            recorded ``estimator``, ``grouping`` (:func:`grouping_meta`), ``beta``,
            ``samples``, ``shapes``, ``model``, ``every``, ``warmup_samples`` and
            ``start_step``.

    Attributes:
        record: the :class:`~fslr_func.record.FSLRRecord` being filled.
        t: index of the next training step.
    """

    def __init__(
        self,
        fm: FSLRModule,
        probe_batches: Iterable[Inputs],
        *,
        warmup_samples: int = 40,
        every: int | None = 100,
        start_step: int = 0,
        base_lr: float | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.fm = fm
        self.plan = ProbePlan.of(warmup_samples, fm.samples, every, start_step)
        self.scheduler = scheduler
        self._feed = ProbeFeed(probe_batches)
        self.t = 0
        shapes = {n: list(p.shape) for n, p in fm.module.named_parameters() if p.requires_grad}
        self.record = FSLRRecord(
            meta={
                "estimator": fm.estimator,
                "grouping": grouping_meta(fm.grouping),
                "beta": fm.beta,
                "samples": fm.samples,
                "shapes": shapes,
                "model": type(fm.module).__name__,
                "base_lr": base_lr,
                "schedule": None if scheduler is None else type(scheduler).__name__,
                "warmup_samples": warmup_samples,
                "every": every,
                "start_step": start_step,
                **(meta or {}),
            }
        )

    @property
    def probes_used(self) -> int:
        """Probe batches drawn so far."""
        return self._feed.used

    @contextlib.contextmanager
    def step(self, optimizer: torch.optim.Optimizer) -> Iterator[Measurement | None]:
        """Context manager around one ``optimizer.step()``; records on probed steps.

        Yields:
            The step's :class:`~fslr_func.transform.Measurement` (filled in on exit) on a
            probed step, else ``None``.
        """
        n = self.plan.probes_at(self.t)
        if n == 0:
            yield None
            self.t += 1
            return
        meta = self.record.meta
        if meta["optimizer"] is None:
            described = optimizer_meta(optimizer)
            meta["optimizer"] = described["optimizer"]
            meta["optimizer_hparams"] = described["optimizer_hparams"]
            if meta["base_lr"] is None:
                meta["base_lr"] = described["base_lr"]
        sched = schedule_ratio(optimizer, self.scheduler, float(meta["base_lr"]))
        with self.fm.measure(optimizer, self._feed.take(n)) as m:
            yield m
        self._append(self.t, m, sched)
        self.t += 1

    def _append(self, step: int, m: Measurement, sched: float) -> None:
        fslr = {n: float(v) for n, v in m.fslr.items() if n in m.lrs}
        bad = [n for n, v in fslr.items() if not math.isfinite(v)]
        if bad:
            warnings.warn(
                f"Recorder: step {step} has non-finite FSLRs for {bad[:10]} (a diverged run?); "
                "the row is not recorded",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        self.record.append(step, fslr, lrs=m.lrs, sched=sched)

    def state_dict(self) -> dict[str, Any]:
        """Step, record and probe-batch count, for checkpoints (with ``fm.state_dict()``)."""
        return {
            "version": _STATE_VERSION,
            "t": self.t,
            "record": self.record.to_dict(),
            "probes_used": self._feed.used,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the probe iterable is fast-forwarded past used batches."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError("this Recorder state was saved by an incompatible fslr_func version")
        self.t = int(state["t"])
        self.record = FSLRRecord.from_dict(state["record"], source="the Recorder state")
        self._feed.skip(int(state["probes_used"]))
