r"""The learning-rate transfer sweep behind ``fslr demo`` and ``fslr sweep`` (paper figures 2-4).

For every learning rate ``lr``, scale ``s`` (the smallest is the base model) and seed ``k``:

- ``standard``: plain Adam at ``lr``. The base-scale runs also record the base model's FSLRs
  with a :class:`~fslr_func.recorder.Recorder` (EMA warm-up of ``warmup_samples`` omega samples
  at step 0, then one probe every ``every`` steps); recording does not change training.
- ``flerm``: Adam driven by :class:`~fslr_func.flerm.FLeRM` in the paper's static mode: after the
  warm-up at step 0 the per-tensor rates are set once,
  ``lr_W = lr * FSLR_base_W(0) / FSLR_W(0)``, with the base FSLRs of ``lr`` averaged over the
  seeds (:meth:`~fslr_func.record.FSLRRecord.mean`) and shared over blocks for depth
  (``share_blocks`` policy; ``identity`` for width and init scale). The base scale's FLeRM run
  is the identity check: with one seed its rates are exactly ``lr`` and its losses those of the
  standard run.

A run scores its training loss averaged over its last ``last`` batches (the paper's metric;
diverged: infinity), averaged over seeds; the best learning rate per scale is the grid point
with the lowest score, and its *shift* from the base to the largest scale is measured in
octaves, ``log2(best_lr[largest] / best_lr[base])``.

Every run is a pure function of its config and ``(mode, scale, lr, seed)`` and is cached as one
small JSON file, written atomically::

    <out>/sweep.json                      the config
    <out>/runs/<mode>_scale=<s>_lr=<lr>_seed=<k>.json
    <out>/records/lr=<lr>_seed=<k>.json   base records (FSLRRecord.save), and lr=<lr>_mean.json
    <out>/summary.json                    see :func:`summarise`

so an interrupted sweep resumes where it stopped and a finished one re-summarises instantly.
Cached runs whose config fingerprint differs (another step count, model, data...) are re-run;
adding learning rates, scales or seeds only runs what is new (FLeRM runs are re-run when the
seeds of their base record change).

Sweeping your own model: describe it with a :class:`Task` (model factory, batches, loss,
depth policy) and call :func:`run_sweep` with it. With ``jobs > 1`` the runs go to worker
processes started with ``spawn``: call :func:`run_sweep` under ``if __name__ == "__main__":``
and give the task picklable callables (module-level functions, :func:`functools.partial`).

Example:
    >>> import tempfile, torch
    >>> from fslr_func.experiments import batches
    >>> from fslr_func.experiments.configs import SweepConfig
    >>> x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
    >>> def build(scale, seed):  # the sweep seeds torch before calling it
    ...     w = int(8 * scale)
    ...     return torch.nn.Sequential(torch.nn.Linear(6, w), torch.nn.ReLU(),
    ...                                torch.nn.Linear(w, 3))
    >>> task = Task(name="tiny-mlp", build=build,
    ...             train_batches=lambda seed: batches(x, y, 32, seed),
    ...             probe_batches=lambda seed: (b for b, _ in batches(x, y, 32, seed + 99)))
    >>> cfg = SweepConfig(scales=(1, 2), lrs=(0.01, 0.03), steps=8, seeds=1, last=4,
    ...                   warmup_samples=8, every=4)
    >>> with tempfile.TemporaryDirectory() as out:
    ...     result = run_sweep(cfg, out, task=task, quiet=True)
    ...     again = run_sweep(cfg, out, task=task, quiet=True)  # all cached: nothing runs
    >>> len(result.executed), len(again.executed), sorted(result.summary["modes"])
    (8, 0, ['flerm', 'standard'])
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..atomic import write_json
from ..record import FSLRRecord
from .cache import SweepCache, load_runs, mean_record
from .configs import SweepConfig
from .run import RUN_FORMAT, RunSpec, execute, grid, unusable
from .summary import format_table, summarise
from .task import Task, builtin_task

__all__ = [
    "RUN_FORMAT",
    "RunSpec",
    "SweepResult",
    "Task",
    "builtin_task",
    "default_jobs",
    "execute",
    "format_table",
    "grid",
    "load_runs",
    "mean_record",
    "run_sweep",
    "summarise",
]


# ---------------------------------------------------------------------------------- workers

_WORKER: dict[str, Any] = {}


def _init_worker(task: Task, config: SweepConfig, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER["task"], _WORKER["config"] = task, config


def _work(
    spec: RunSpec, base: dict[str, Any] | None, record: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    base_rec = None if base is None else FSLRRecord.from_dict(base)
    result, rec = execute(_WORKER["task"], _WORKER["config"], spec, base_rec, record=record)
    return result, None if rec is None else rec.to_dict()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def default_jobs() -> int:
    """Worker processes used by default: the usable CPU cores, at most 8."""
    return max(1, min(8, _cpu_count()))


# ---------------------------------------------------------------------------------- the sweep


@dataclass
class SweepResult:
    """What :func:`run_sweep` did.

    Attributes:
        out: the output folder.
        summary: the :func:`summarise` document (also written to ``<out>/summary.json``).
        runs: run key -> cached result, for every run of the grid.
        executed: keys of the runs trained by this call (not found in the cache), including
            base recordings that only re-made a missing record.
        seconds: wall time of this call.
    """

    out: Path
    summary: dict[str, Any]
    runs: dict[str, dict[str, Any]]
    executed: list[str] = field(default_factory=list)
    seconds: float = 0.0


class _Progress:
    """tqdm bar (runs done, time left) when tqdm is installed and enabled; else silent."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.bar: Any = None
        if quiet or total == 0:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is in the demo extra
            return
        # disable=None: off when stderr is not a terminal (CI logs, pipes)
        self.bar = tqdm(total=total, unit="run", desc="runs", disable=None, smoothing=0.1)

    def update(self, key: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(key, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_sweep(
    config: SweepConfig,
    out: str | os.PathLike[str],
    *,
    task: Task | None = None,
    jobs: int = 1,
    quiet: bool = False,
    threads: int | None = 1,
    on_run: Callable[[dict[str, Any]], None] | None = None,
) -> SweepResult:
    """Run (or resume) a learning-rate transfer sweep and write its summary.

    Runs found in ``<out>/runs`` with the same fingerprint are not re-run. Base recordings go
    first; the FLeRM runs of a learning rate start as soon as all its seeds' base records
    exist; the most expensive runs go before cheaper ones. Interrupting (Ctrl-C) loses only
    the runs in flight.

    Args:
        config: the sweep (validated here).
        out: output folder (created).
        task: the model family and data; default: :func:`builtin_task` of ``config``, built
            (its data loaded or generated) only when some run is not cached.
        jobs: worker processes; ``1`` runs in this process.
        quiet: no progress bar (it is also off when stderr is not a terminal).
        threads: torch threads per run (restored afterwards); small models train fastest
            single-threaded, in parallel processes; ``None``: leave torch's setting.
        on_run: called in this process with each newly finished run's result.

    Returns:
        A :class:`SweepResult`.

    Raises:
        ConfigError: for an invalid config.
    """
    t0 = time.perf_counter()
    config.validate(builtin=task is None)
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be None or a positive integer, got {threads!r}")
    task_name = config.task_name if task is None else task.name
    out = Path(out)
    cache = SweepCache.create(out, config, task_name)
    seeds = cache.seeds
    base = config.base_scale

    runs: dict[str, dict[str, Any]] = {}
    todo: list[RunSpec] = []
    for spec in grid(config):
        data = cache.run(spec)
        if data is not None and spec.mode == "standard" and spec.scale == base:
            data = data if cache.has_record(spec.lr, spec.seed) else None
        if data is None:
            todo.append(spec)
        else:
            runs[spec.key] = data
    todo_keys = {s.key for s in todo}
    # base recordings needed by FLeRM runs, when the standard base run is not itself to do
    recordings = [
        RunSpec("standard", base, lr, seed)
        for lr in sorted({s.lr for s in todo if s.mode == "flerm"})
        for seed in seeds
        if not cache.has_record(lr, seed)
    ]
    extra = [s for s in recordings if s.key not in todo_keys]

    waiting: dict[float, list[RunSpec]] = {}
    ready: list[RunSpec] = []
    for spec in todo + extra:
        (waiting.setdefault(spec.lr, []) if spec.mode == "flerm" else ready).append(spec)
    missing_records = {(s.lr, s.seed) for s in ready if s.mode == "standard" and s.scale == base}

    executed: list[str] = []

    def release() -> None:
        for lr in list(waiting):
            if not any((lr, s) in missing_records for s in seeds):
                ready.extend(waiting.pop(lr))

    def priority(spec: RunSpec) -> tuple[int, float]:
        # base recordings first (they unlock FLeRM runs), then the most expensive runs
        return (int(spec.mode == "standard" and spec.scale == base), spec.scale)

    def finish(spec: RunSpec, result: dict[str, Any], rec: FSLRRecord | None) -> None:
        cache.store(spec, result, rec, run=spec.key in todo_keys)
        if rec is not None:
            missing_records.discard((spec.lr, spec.seed))
        if spec.key in todo_keys:
            runs[spec.key] = result
        executed.append(spec.key)
        progress.update(spec.key)
        if on_run is not None:
            on_run(result)

    def args_of(spec: RunSpec) -> tuple[FSLRRecord | None, bool] | None:
        """(base record, record?) of a run, or ``None`` if it cannot run (no base record)."""
        if spec.mode == "flerm":
            mean = cache.mean(spec.lr)
            return None if mean is None else (mean, False)
        return None, spec.scale == base

    if task is None and (todo or extra):
        task = builtin_task(config)
    previous_threads = torch.get_num_threads()
    progress = _Progress(len(todo) + len(extra), quiet)
    try:
        release()
        if threads is not None:
            torch.set_num_threads(threads)
        if jobs == 1 or not ready:
            while ready:
                ready.sort(key=priority)
                spec = ready.pop()
                args = args_of(spec)
                if args is None:
                    finish(spec, unusable(spec), None)
                else:
                    assert task is not None
                    result, rec = execute(task, config, spec, args[0], record=args[1])
                    finish(spec, result, rec)
                release()
        else:
            assert task is not None
            per_job = threads if threads is not None else max(1, _cpu_count() // jobs)
            ctx = multiprocessing.get_context("spawn")
            with cf.ProcessPoolExecutor(
                jobs, mp_context=ctx, initializer=_init_worker, initargs=(task, config, per_job)
            ) as pool:
                flying: dict[cf.Future[Any], RunSpec] = {}
                try:
                    while ready or flying:
                        ready.sort(key=priority)
                        while ready and len(flying) < jobs:
                            spec = ready.pop()
                            args = args_of(spec)
                            if args is None:
                                finish(spec, unusable(spec), None)
                                continue
                            b = None if args[0] is None else args[0].to_dict()
                            flying[pool.submit(_work, spec, b, args[1])] = spec
                        if not flying:
                            release()
                            continue
                        done, _ = cf.wait(flying, return_when=cf.FIRST_COMPLETED)
                        for fut in done:
                            spec = flying.pop(fut)
                            result, rec = fut.result()
                            finish(spec, result, None if rec is None else FSLRRecord.from_dict(rec))
                        release()
                except BaseException:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
    finally:
        progress.close()
        torch.set_num_threads(previous_threads)

    summary = summarise(config, runs, out=out)
    summary["task"] = task_name
    summary["wall_seconds"] = round(time.perf_counter() - t0, 2)
    summary["executed_runs"] = len(executed)
    write_json(out / "summary.json", summary, parents=True)
    return SweepResult(out, summary, runs, executed, time.perf_counter() - t0)
