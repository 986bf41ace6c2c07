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
    >>> probes = [torch.randn(16, 4) for _ in range(4)]  # a re-iterable is cycled if need be
    >>> rec = Recorder(fm, probes, optimizer=opt, warmup_samples=8, every=5)
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

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .functional import Inputs
from .probe_schedule import ProbeFeed, ProbePlan
from .record import FSLRRecord, grouping_meta, optimizer_meta
from .record_meta import is_learning_rate
from .transform import FSLRModule, Measurement

__all__ = ["Recorder", "schedule_ratio"]

_STATE_VERSION = 1


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

    Use ``with recorder.step(): optimizer.step()`` on *every* training step (or
    ``around_step=lambda t: recorder.step()`` with :func:`fslr_func.experiments.train`), with
    the optimiser given at construction as for :class:`~fslr_func.flerm.FLeRM`; passing it to
    each ``step(optimizer)`` instead works too. On a
    probed step the block yields the :class:`~fslr_func.transform.Measurement` and a row
    :math:`(t, \mathrm{FSLR}_W(t), \eta_W(t), \mathrm{sched}(t))` is appended to
    :attr:`record`; on other steps it yields ``None`` and does nothing else.

    Args:
        fm: the wrapped base model (:func:`fslr_func.with_fslr`).
        probe_batches: probe inputs (a tensor, a tuple of positional arguments or a dict of
            keyword arguments per item), separate from the training batches: an endless
            iterator, or a re-iterable such as a ``DataLoader`` (cycled,
            :class:`~fslr_func.probe_schedule.ProbeFeed`).
        optimizer: the optimiser whose steps are recorded; ``None``: given to each
            :meth:`step` instead.
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
        optimizer: torch.optim.Optimizer | None = None,
        warmup_samples: int = 40,
        every: int | None = 100,
        start_step: int = 0,
        base_lr: float | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if base_lr is not None and not is_learning_rate(base_lr):
            raise ValueError(f"base_lr must be None or a finite number > 0, got {base_lr!r}")
        self.fm = fm
        self.optimizer = optimizer
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
    def step(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[Measurement | None]:
        """Context manager around one ``optimizer.step()``; records on probed steps.

        Args:
            optimizer: the optimiser stepped in the block; default: the one given at
                construction (passing that same one is fine too).

        Raises:
            ValueError: no optimiser here or at construction, or another one than that.

        Yields:
            The step's :class:`~fslr_func.transform.Measurement` (filled in on exit) on a
            probed step, else ``None``.
        """
        optimizer = self._optimizer(optimizer)
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
        with self.fm.measure(optimizer, self._feed.take(n), step=self.t) as m:
            yield m
        self._append(self.t, m, sched)
        self.t += 1

    def _optimizer(self, given: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
        if given is None:
            given = self.optimizer
        if given is None:
            raise ValueError(
                "Recorder.step() needs the optimiser: build the Recorder with optimizer=opt "
                "or call recorder.step(opt)"
            )
        if self.optimizer is not None and given is not self.optimizer:
            raise ValueError(
                "Recorder.step(optimizer) got another optimiser than the one the Recorder was "
                "built with: record one optimiser per Recorder"
            )
        return given

    def _append(self, step: int, m: Measurement, sched: float) -> None:
        fslr = {n: v for n, v in m.read().values.items() if n in m.lrs}  # one sync
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
