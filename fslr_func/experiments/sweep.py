r"""The learning-rate transfer sweep behind ``fslr demo`` and ``fslr sweep`` (paper figures 2-4).

For every learning rate ``lr``, scale ``s`` (the smallest is the base model) and seed ``k``:

- ``standard``: plain Adam at ``lr``. The base-scale runs also record the base model's FSLRs
  with a :class:`~fslr_func.training.recorder.Recorder` (EMA warm-up of ``warmup_samples`` omega
  samples at step 0, then one probe every ``every`` steps); recording does not change training.
- ``flerm``: Adam driven by :class:`~fslr_func.training.flerm.FLeRM` in the paper's static mode:
  after the warm-up at step 0 the per-tensor rates are set once,
  ``lr_W = lr * FSLR_base_W(0) / FSLR_W(0)``, with the base FSLRs of ``lr`` averaged over the
  seeds (:meth:`~fslr_func.io.record.FSLRRecord.mean`) and shared over blocks for depth
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

This module is the orchestrator; the pieces, all re-exported here, are
:mod:`~fslr_func.experiments.task` (what a sweep trains), :mod:`~fslr_func.experiments.run`
(one run), :mod:`~fslr_func.experiments.cache` (the files above),
:mod:`~fslr_func.experiments.schedule` (the order of the runs, the worker processes) and
:mod:`~fslr_func.experiments.summary` (best learning rates, shifts, the table).

Examples:
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
    (12, 0, ['flerm', 'mup', 'standard'])
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io.atomic import write_json
from ..io.record import FSLRRecord
from .cache import SweepCache, load_runs, mean_record
from .configs import SweepConfig
from .run import RUN_FORMAT, RunSpec, execute, grid
from .schedule import Scheduler, default_jobs
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


class _Sweep:
    """One call of :func:`run_sweep`: the runs found in the cache, those to train, those done.

    Args:
        config: the sweep.
        cache: its folder.
        quiet: no progress bar.
        on_run: called with each newly finished run's result.
    """

    def __init__(
        self,
        config: SweepConfig,
        cache: SweepCache,
        *,
        quiet: bool,
        on_run: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.on_run = on_run
        self.runs: dict[str, dict[str, Any]] = {}
        self.executed: list[str] = []
        self.runs, todo, pending = cache.plan(grid(config), config.base_scale)
        self.todo_keys = {s.key for s in todo}
        #: every run to train: the grid's missing runs, then the extra base recordings
        self.pending = pending
        self.progress = _Progress(len(self.pending), quiet)

    def finish(self, spec: RunSpec, result: dict[str, Any], record: FSLRRecord | None) -> None:
        """Cache a finished run (an extra base recording: only its record), report it."""
        in_grid = spec.key in self.todo_keys
        self.cache.store(spec, result, record, run=in_grid)
        if in_grid:
            self.runs[spec.key] = result
        self.executed.append(spec.key)
        self.progress.update(spec.key)
        if self.on_run is not None:
            self.on_run(result)

    def train(self, task: Task, *, jobs: int, threads: int | None) -> None:
        """Train the pending runs (see :class:`~fslr_func.experiments.schedule.Scheduler`)."""
        scheduler = Scheduler(
            self.pending,
            base_scale=self.config.base_scale,
            seeds=self.cache.seeds,
            base_for=self.cache.mean,
            finish=self.finish,
        )
        try:
            scheduler.run(task, self.config, jobs=jobs, threads=threads)
        finally:
            self.progress.close()


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
    the runs in flight; killing the process (``kill -9``) also ends its worker processes.

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
    sweep = _Sweep(config, SweepCache.create(out, config, task_name), quiet=quiet, on_run=on_run)
    if sweep.pending:
        task = builtin_task(config) if task is None else task
        sweep.train(task, jobs=jobs, threads=threads)
    summary = summarise(config, sweep.runs, out=out)
    summary["task"] = task_name
    summary["wall_seconds"] = round(time.perf_counter() - t0, 2)
    summary["executed_runs"] = len(sweep.executed)
    write_json(out / "summary.json", summary, parents=True)
    return SweepResult(out, summary, sweep.runs, sweep.executed, time.perf_counter() - t0)
