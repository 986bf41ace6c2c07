"""What a trainer callback holds: the wrapper, a Recorder or FLeRM attached to the optimiser.

A trainer builds the model's optimiser and scheduler itself, and restores a checkpoint before
or after the callback sees them; :class:`Session` takes the callback's options at
construction (checked then), builds ``with_fslr(model)`` and the controller once the trainer
has its optimiser (:meth:`Session.start`), attaches it through the optimiser's step hooks,
keeps a state loaded before that until it can apply it, and buffers the scalars to log.

Examples:
    >>> import torch, fslr_func as ff
    >>> from fslr_func.integrations.session import Session
    >>> net = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> s = Session(None, fslr_options={"samples": 2, "seed": 0}, options={"every": 1,
    ...             "warmup_samples": 2})
    >>> s.start(net, opt, None, [torch.randn(8, 4)])
    >>> for _ in range(2):
    ...     net(torch.randn(8, 4)).square().mean().backward()
    ...     opt.step()
    >>> s.stop()
    >>> s.record().steps, sorted(s.pop_scalars())
    ([0, 1], ['fslr/bias', 'fslr/weight'])
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from difflib import get_close_matches
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

from ..io.record import FSLRRecord
from ..probe.functional import Inputs
from ..probe.names import unwrapped
from ..probe.options import ProbeOptions
from ..stats.estimator import EMA, check_estimator
from ..training import policies
from ..training.distributed import DistributedFSLRModule
from ..training.flerm import FLeRM
from ..training.probe_schedule import ProbePlan, length_of
from ..training.recorder import Recorder
from ..training.step_hooks import StepHooks
from ..training.wrap import with_fslr
from ..training.wrapper import FSLRModule

__all__ = [
    "FLERM_STATE_FILE",
    "RECORD_FILE",
    "STATE_FILE",
    "DrivingCallback",
    "RecordingCallback",
    "Session",
    "load_base",
]

RECORD_FILE = "fslr_record.json"
"""Name of the base record a recording callback writes into the trainer's output folder."""

STATE_FILE = "fslr_state.pt"
"""Name of a recording callback's state file in a Hugging Face checkpoint folder (a driving
callback's in earlier versions, which a resume still reads)."""

FLERM_STATE_FILE = "flerm_state.pt"
"""Name of a driving callback's state file in a Hugging Face checkpoint folder: its own, so
that a Trainer with both callbacks (FLeRM driving, a Recorder recording the scaled run)
saves and resumes both."""

_PROBE_OPTIONS = frozenset(f.name for f in dataclasses.fields(ProbeOptions))
"""The probe's options, which ``with_fslr`` takes as keywords."""

_RESERVED = ("fm", "probe_batches", "optimizer", "scheduler", "log_fn")


def load_base(base: FSLRRecord | str | os.PathLike[str]) -> FSLRRecord:
    """``base`` itself, or the record saved at that path.

    Raises:
        TypeError: neither a record nor a path.
    """
    if isinstance(base, FSLRRecord):
        return base
    if isinstance(base, (str, os.PathLike)):
        return FSLRRecord.load(base)
    raise TypeError(f"base must be an FSLRRecord or a path to one, got {type(base).__name__}")


def _check_names(options: Mapping[str, Any], target: Any, what: str) -> None:
    """Refuse option names that ``target`` (a controller class, or :func:`with_fslr` with the
    probe's options) does not take, with the close matches: a typo otherwise surfaced only
    when training started."""
    known = set(inspect.signature(target).parameters) - {"self", "options", "model", "fm"}
    known -= {"base", "probe_batches", *_RESERVED}  # the callback's own
    if target is with_fslr:  # its **options: the probe's and the distributed wrapper's
        known |= _PROBE_OPTIONS
        known |= set(inspect.signature(DistributedFSLRModule).parameters) - {"model", "kwargs"}
    unknown = [k for k in options if k not in known]
    if unknown:
        hints = [
            f"{k!r}"
            + (f" (did you mean {close}?)" if (close := get_close_matches(k, known)) else "")
            for k in unknown
        ]
        raise TypeError(
            f"the callback's {what} has {', '.join(hints)}, which "
            f"{getattr(target, '__name__', target)} does not take; it takes {sorted(known)}"
        )


class Session:
    """A Recorder (``base=None``) or a FLeRM (``base`` a record) for one training run.

    Args:
        base: ``None`` to record; else the base :class:`~fslr_func.io.record.FSLRRecord` (or a
            path to one) that FLeRM matches.
        fslr_options: options of :func:`fslr_func.with_fslr` (``samples``, ``seed``,
            ``output_fn``...).
        options: options of :class:`~fslr_func.training.recorder.Recorder` or
            :class:`~fslr_func.training.flerm.FLeRM` (``every``, ``warmup_samples``, ``mode``...).

    Raises:
        TypeError, ValueError: an option the callback sets itself (``optimizer``,
            ``scheduler``, ``probe_batches``, ``log_fn``) or a bad base.
    """

    def __init__(
        self,
        base: FSLRRecord | str | os.PathLike[str] | None,
        *,
        fslr_options: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.base = None if base is None else load_base(base)
        self.fslr_options = dict(fslr_options or {})
        self.options = dict(options or {})
        taken = [k for k in _RESERVED if k in self.options]
        if taken:
            raise ValueError(
                f"the callback sets {taken} itself from the trainer: leave them out of its options"
            )
        _check_names(self.options, Recorder if self.base is None else FLeRM, "options")
        _check_names(self.fslr_options, with_fslr, "fslr_options")
        ProbeOptions(**{k: v for k, v in self.fslr_options.items() if k in _PROBE_OPTIONS})
        check_estimator(
            self.fslr_options.get("estimator", "kron"),
            distributed=bool(self.fslr_options.get("distributed")),
        )
        EMA(self.fslr_options.get("beta", 0.9))  # beta's range
        every = self.options.get("every", 100)
        if self.base is not None:
            mode = self.options.get("mode", "static")
            if mode not in ("static", "periodic"):
                raise ValueError(f"mode must be 'static' or 'periodic', got {mode!r}")
            if mode == "periodic" and every is None:
                raise ValueError("mode='periodic' needs every=N (an int >= 1)")
            policies.resolve(self.options.get("policy", "identity"))
        ProbePlan.of(  # the ranges, now rather than when training starts
            self.options.get("warmup_samples", 40),
            self.fslr_options.get("samples", 8),
            every,
            self.options.get("start_step", 0),
        )
        self.fm: FSLRModule | None = None
        self.controller: Recorder | FLeRM | None = None
        self._hooks: StepHooks | None = None
        self._pending: Mapping[str, Any] | None = None
        self._scalars: dict[str, float] = {}

    def start(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        probe_batches: Iterable[Inputs],
        step: int | None = None,
    ) -> None:
        """Wrap ``model``, build the controller over the trainer's optimiser and attach it.

        Started again (a second ``trainer.fit``/``trainer.train``), it continues where it
        stopped when the trainer does: on the same model at or past the step it had reached
        (``step``, the trainer's optimiser steps so far, which count the steps a
        ``GradScaler`` skipped where the controller's do not; ``None``: not known, taken as
        continuing), the record keeps its rows and its step count and FLeRM its set points.
        A checkpoint's state loaded in between (``fit(ckpt_path=...)``) is applied instead.
        Otherwise (another model, or training started over from step 0) it starts afresh,
        with a warning that what it had is replaced.
        """
        carried = None
        if self.controller is not None and self.fm is not None and self._pending is None:
            same = unwrapped(self.fm.module)[0] is unwrapped(model)[0]
            if same and (step is None or step >= self.controller.t):
                carried = self.state_dict()
            else:
                warnings.warn(
                    f"the callback was started again on {'the same' if same else 'another'} "
                    f"model at step {step}, where it had stopped at step {self.controller.t}: "
                    f"it starts a new {'record' if self.base is None else 'FLeRM run'}, and a "
                    "record saved at the end replaces the previous one; use one callback per "
                    "run",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self.stop()
        self.fm = with_fslr(model, **self.fslr_options)
        common = {"log_fn": self._log, "scheduler": scheduler, **self.options}
        if self.base is None:
            self.controller = Recorder(self.fm, probe_batches, optimizer=optimizer, **common)
        else:
            self.controller = FLeRM(
                self.fm, optimizer, self.base, probe_batches=probe_batches, **common
            )
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None
        elif carried is not None:
            self._apply(carried)
        self._hooks = self.controller.attach()

    def stop(self) -> None:
        """Detach from the optimiser (hooks removed, param groups back)."""
        if self._hooks is not None:
            self._hooks.detach()
            self._hooks = None

    def record(self) -> FSLRRecord:
        """The base record being filled (recording sessions only).

        Raises:
            RuntimeError: not a recording session, or not started.
        """
        if not isinstance(self.controller, Recorder):
            raise RuntimeError("no base run is being recorded (start a recording session first)")
        return self.controller.record

    def save_record(self, directory: str | os.PathLike[str], *, final: bool = False) -> None:
        """Write the record so far to ``directory/fslr_record.json`` (nothing before a row;
        ``final``, at the end of training: a warning says that no file was written)."""
        record = self.record()
        if len(record):
            os.makedirs(directory, exist_ok=True)
            record.save(os.path.join(directory, RECORD_FILE))
        elif final:
            warnings.warn(
                f"training ended before any FSLR was recorded, so no {RECORD_FILE} was written "
                f"to {os.fspath(directory)!r}: every probed step had a learning rate of 0 (a "
                "warm-up from 0 longer than the run) or none was reached (start_step); train "
                "for more steps, or record from a later step",
                RuntimeWarning,
                stacklevel=3,
            )

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        self._scalars.update(scalars)

    def pop_scalars(self) -> dict[str, float]:
        """The latest value of every scalar logged since the last call."""
        out, self._scalars = self._scalars, {}
        return out

    def state_dict(self) -> dict[str, Any]:
        """The controller's and the wrapper's state (EMAs, omega generator)."""
        if self.controller is None or self.fm is None:
            return dict(self._pending or {})
        return {"controller": self.controller.state_dict(), "fm": self.fm.get_extra_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: now into a running controller, else when :meth:`start`
        builds the next one (a checkpoint loaded between two fits is the next fit's, whatever
        model it trains)."""
        if self.controller is not None:
            self._apply(state)  # what state_dict() and record() read from now on
        if self._hooks is None:  # and the next start's
            self._pending = state

    def _apply(self, state: Mapping[str, Any]) -> None:
        assert self.controller is not None and self.fm is not None
        if state:
            self.controller.load_state_dict(state["controller"])
            self.fm.set_extra_state(state["fm"])


class _SessionCallback:
    """What both frameworks' callbacks hold: the probe dataset and a :class:`Session`. A
    framework's callback class may set ``default_fslr_options``: options of
    :func:`fslr_func.with_fslr` it sets by default (the user's win)."""

    def _open(
        self,
        base: FSLRRecord | str | os.PathLike[str] | None,
        probe_dataset: Iterable[Any],
        fslr_options: Mapping[str, Any] | None,
        options: Mapping[str, Any],
    ) -> None:
        indexed = hasattr(probe_dataset, "__getitem__") and hasattr(probe_dataset, "__len__")
        one_shot = isinstance(probe_dataset, Iterator) and not isinstance(
            probe_dataset, IterableDataset
        )  # an IterableDataset that is its own iterator starts again at each __iter__
        if one_shot or not (indexed or isinstance(probe_dataset, Iterable)):
            # a map-style dataset has no __iter__ of its own
            given = "a one-shot iterator" if one_shot else type(probe_dataset).__name__
            raise TypeError(
                "probe_dataset must be held-out model inputs the callback can go through again "
                f"and again: a dataset, a list or a DataLoader, not {given}"
            )
        if length_of(probe_dataset) == 0:
            raise ValueError(
                "probe_dataset is empty: pass held-out model inputs (examples like the "
                "training set's, without the training examples)"
            )
        self.probe_dataset = probe_dataset
        self.session = Session(
            base,
            fslr_options={**getattr(self, "default_fslr_options", {}), **(fslr_options or {})},
            options=options,
        )


class RecordingCallback(_SessionCallback):
    """The constructor of the ``FSLRCallback`` of every framework: a recording session.

    Args:
        probe_dataset: model inputs (a dataset or a ``DataLoader``), separate from training.
        fslr_options: options of :func:`fslr_func.with_fslr` (``samples``, ``seed``...).
        **recorder_options: options of :class:`fslr_func.Recorder` (``every``,
            ``warmup_samples``, ``start_step``, ``base_lr``, ``meta``).
    """

    def __init__(
        self,
        probe_dataset: Iterable[Any],
        *,
        fslr_options: Mapping[str, Any] | None = None,
        **recorder_options: Any,
    ) -> None:
        self._open(None, probe_dataset, fslr_options, recorder_options)


class DrivingCallback(_SessionCallback):
    """The constructor of the ``FLeRMCallback`` of every framework: a FLeRM session.

    Args:
        base: the base run's :class:`~fslr_func.io.record.FSLRRecord`, or a path to one (the
            ``fslr_record.json`` an ``FSLRCallback`` wrote).
        probe_dataset: model inputs (a dataset or a ``DataLoader``), separate from training.
        fslr_options: options of :func:`fslr_func.with_fslr`; use the base run's estimator and
            grouping.
        **flerm_options: options of :class:`fslr_func.FLeRM` (``policy``, ``mode``, ``every``,
            ``warmup_samples``, ``start_step``, ``min_fslr``).
    """

    def __init__(
        self,
        base: FSLRRecord | str | os.PathLike[str],
        probe_dataset: Iterable[Any],
        *,
        fslr_options: Mapping[str, Any] | None = None,
        **flerm_options: Any,
    ) -> None:
        self._open(base, probe_dataset, fslr_options, flerm_options)
