r"""Scheduling a sweep's runs, in this process or in worker processes.

A FLeRM run needs the base record of its learning rate, averaged over the seeds: the
:class:`Scheduler` holds it back until every seed's base recording (the standard run at the
base scale) is done, starts base recordings first since they unlock FLeRM runs, and otherwise
starts the most expensive runs (the largest scale) first. With ``jobs > 1`` the runs go to a
pool of worker processes started with ``spawn``, each given the task and config once. Workers
die with the sweep's process, even when it is killed (``kill -9``): on Linux the kernel sends
them ``SIGKILL`` when it dies (``prctl(PR_SET_PDEATHSIG)``), elsewhere they poll its pid.

Examples:
    >>> import torch
    >>> from fslr_func.experiments import batches
    >>> from fslr_func.experiments.configs import SweepConfig
    >>> from fslr_func.experiments.run import grid
    >>> from fslr_func.experiments.task import Task
    >>> x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    >>> task = Task(name="tiny", build=lambda scale, seed: torch.nn.Linear(6, 3),
    ...             train_batches=lambda seed: batches(x, y, 16, seed),
    ...             probe_batches=lambda seed: (b for b, _ in batches(x, y, 16, seed + 9)))
    >>> config = SweepConfig(scales=(1, 2), lrs=(0.01,), steps=4, seeds=1, last=2,
    ...                      samples=4, warmup_samples=4, every=2, modes=("standard", "flerm"))
    >>> order, records = [], {}
    >>> def finish(spec, result, record):
    ...     order.append(spec.key)
    ...     if record is not None:
    ...         records[spec.lr] = record
    >>> Scheduler(grid(config), base_scale=1.0, seeds=[0], base_for=records.get,
    ...           finish=finish).run(task, config, jobs=1, threads=None)
    >>> print(*order, sep="\n")  # the base recording, then FLeRM runs once it is done
    standard_scale=1_lr=0.01_seed=0
    flerm_scale=2_lr=0.01_seed=0
    standard_scale=2_lr=0.01_seed=0
    flerm_scale=1_lr=0.01_seed=0
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from ..io.record import FSLRRecord
from .configs import SweepConfig
from .run import RunSpec, execute, unusable
from .task import Task

__all__ = ["Finish", "Scheduler", "default_jobs"]

Finish = Callable[[RunSpec, dict[str, Any], FSLRRecord | None], None]
"""``finish(spec, result, record)``: called in this process with each finished run."""

_WORKER: dict[str, Any] = {}

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _watch_parent(parent: int) -> None:
    """Exit this process as soon as ``parent`` is no longer its parent (it died)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _die_with_parent(parent: int) -> None:
    """Make this worker die when the sweep's process ``parent`` does, however it dies.

    A killed parent cannot shut its pool down, and its workers would train on as orphans. On
    Linux the kernel kills the worker (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set here because
    ``exec`` of the spawned interpreter clears it); elsewhere a daemon thread polls the parent
    pid. A parent that died before this ran is caught by the pid check.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:  # pragma: no cover - macOS, BSD: no parent-death signal
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


def _init_worker(task: Task, config: SweepConfig, threads: int, parent: int) -> None:
    _die_with_parent(parent)
    torch.set_num_threads(threads)
    _WORKER["task"], _WORKER["config"] = task, config


def _work(
    spec: RunSpec, base: dict[str, Any] | None, record: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """:func:`~fslr_func.experiments.run.execute` in a worker; records travel as dicts."""
    base_rec = None if base is None else FSLRRecord.from_dict(base)
    result, rec = execute(_WORKER["task"], _WORKER["config"], spec, base_rec, record=record)
    return result, None if rec is None else rec.to_dict()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def default_jobs() -> int:
    """Worker processes used by default: the usable CPU cores, at most 8.

    Examples:
        >>> 1 <= default_jobs() <= 8
        True
    """
    return max(1, min(8, _cpu_count()))


class _Job(NamedTuple):
    """A run ready to train, with the arguments of :func:`execute`."""

    spec: RunSpec
    base: FSLRRecord | None
    record: bool


class Scheduler:
    """Trains runs in the order their base records allow.

    Args:
        specs: the runs to train, base recordings of the FLeRM runs' learning rates included.
        base_scale: the scale whose standard runs record the base FSLRs.
        seeds: the seeds a FLeRM run's base record is averaged over.
        base_for: ``base_for(lr)`` -> the base record of ``lr`` (or ``None`` when no base run
            has an estimate); called once every seed's base recording of ``lr`` is finished.
        finish: called in this process with each finished run, as it finishes.
    """

    def __init__(
        self,
        specs: Iterable[RunSpec],
        *,
        base_scale: float,
        seeds: list[int],
        base_for: Callable[[float], FSLRRecord | None],
        finish: Finish,
    ) -> None:
        self.base_scale = base_scale
        self.seeds = seeds
        self.base_for = base_for
        self.finish = finish
        self._waiting: dict[float, list[RunSpec]] = {}  # FLeRM runs by learning rate
        self._ready: list[RunSpec] = []
        for spec in specs:
            if spec.mode == "flerm":
                self._waiting.setdefault(spec.lr, []).append(spec)
            else:
                self._ready.append(spec)
        # (lr, seed) of the base records still to make
        self._missing = {(s.lr, s.seed) for s in self._ready if self.is_recording(s)}

    def is_recording(self, spec: RunSpec) -> bool:
        """Whether ``spec`` is a base recording: a standard run at the base scale."""
        return spec.mode == "standard" and spec.scale == self.base_scale

    def _release(self) -> None:
        """Make ready the FLeRM runs of every learning rate whose base records all exist."""
        for lr in list(self._waiting):
            if not any((lr, s) in self._missing for s in self.seeds):
                self._ready.extend(self._waiting.pop(lr))

    def _priority(self, spec: RunSpec) -> tuple[int, float]:
        # base recordings first (they unlock FLeRM runs), then the most expensive runs
        return (int(self.is_recording(spec)), spec.scale)

    def _next(self) -> _Job | None:
        """The next ready run that can train (finishing those that cannot), or ``None``."""
        while self._ready:
            self._ready.sort(key=self._priority)
            spec = self._ready.pop()
            if spec.mode != "flerm":
                return _Job(spec, None, self.is_recording(spec))
            base = self.base_for(spec.lr)
            if base is not None:
                return _Job(spec, base, False)
            self._done(spec, unusable(spec), None)
        return None

    def _done(self, spec: RunSpec, result: dict[str, Any], record: FSLRRecord | None) -> None:
        if record is not None:
            self._missing.discard((spec.lr, spec.seed))
        self.finish(spec, result, record)

    def run(self, task: Task, config: SweepConfig, *, jobs: int, threads: int | None) -> None:
        """Train every run: ``jobs`` at a time, on ``threads`` torch threads each.

        Args:
            task: the model family and data.
            config: the sweep.
            jobs: worker processes; ``1`` trains in this process.
            threads: torch threads per run (this process's setting is restored afterwards);
                ``None``: this process's setting, or an equal share of the cores per worker.
        """
        previous_threads = torch.get_num_threads()
        try:
            self._release()
            if threads is not None:
                torch.set_num_threads(threads)
            if jobs == 1 or not self._ready:
                while (job := self._next()) is not None:
                    result, rec = execute(task, config, job.spec, job.base, record=job.record)
                    self._done(job.spec, result, rec)
                    self._release()
            else:
                per_job = threads if threads is not None else max(1, _cpu_count() // jobs)
                self._run_pool(task, config, jobs, per_job)
        finally:
            torch.set_num_threads(previous_threads)

    def _run_pool(self, task: Task, config: SweepConfig, jobs: int, threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(
            jobs,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(task, config, threads, os.getpid()),
        ) as pool:
            flying: dict[cf.Future[Any], RunSpec] = {}
            try:
                while self._ready or flying:
                    while len(flying) < jobs and (job := self._next()) is not None:
                        base = None if job.base is None else job.base.to_dict()
                        flying[pool.submit(_work, job.spec, base, job.record)] = job.spec
                    if not flying:
                        self._release()
                        continue
                    done, _ = cf.wait(flying, return_when=cf.FIRST_COMPLETED)
                    for fut in done:
                        spec = flying.pop(fut)
                        result, rec = fut.result()
                        self._done(spec, result, None if rec is None else FSLRRecord.from_dict(rec))
                    self._release()
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
