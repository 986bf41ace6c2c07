r"""A sweep's cache: one small JSON file per run and per base record, valid for one fingerprint.

Every run is a pure function of its config and ``(mode, scale, lr, seed)``, so its result is
cached as one file, written atomically (:func:`fslr_func.io.atomic.write_json`)::

    <out>/sweep.json                      the config, task name and fingerprint
    <out>/runs/<mode>_scale=<s>_lr=<lr>_seed=<k>.json
    <out>/records/lr=<lr>_seed=<k>.json   base records (FSLRRecord.save), and lr=<lr>_mean.json
    <out>/summary.json                    see :func:`~fslr_func.experiments.summary.summarise`

Every file a run reads is checked: a cached run counts only when it is a complete result of
that very run (format, key, mode, scale, learning rate, seed, finite or ``null`` losses) with
the sweep's config fingerprint (and, for a FLeRM run, a base record averaged over the sweep's
seeds), and a base record only when it carries the sweep's fingerprint; a missing, damaged or
stale file is re-run and rewritten. A base record is read (or made) once per sweep and kept,
so another sweep writing into the same folder cannot swap it under a running one.

Examples:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from fslr_func.experiments.configs import SweepConfig
    >>> from fslr_func.experiments.run import RUN_FORMAT, grid
    >>> config = SweepConfig(scales=(1, 2), lrs=(0.5,), seeds=1)
    >>> spec = grid(config)[0]
    >>> result = {"format": RUN_FORMAT, "version": 1, "key": spec.key, "mode": spec.mode,
    ...           "scale": spec.scale, "lr": spec.lr, "seed": spec.seed, "loss": 0.25,
    ...           "test_loss": None, "losses": [0.5, 0.25]}
    >>> with tempfile.TemporaryDirectory() as out:
    ...     cache = SweepCache.create(Path(out), config, "my-task")
    ...     cache.store(spec, result, None, run=True)
    ...     config_again, runs = load_runs(out)
    >>> config_again == config, list(runs), runs[spec.key]["fingerprint"] == cache.fingerprint
    (True, ['standard_scale=1_lr=0.5_seed=0'], True)
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..io.atomic import write_json
from ..io.record import FSLRRecord
from .configs import SweepConfig, lr_key
from .run import RUN_FORMAT, RUN_VERSION, RunSpec, grid

__all__ = ["SweepCache", "load_runs", "mean_record"]


def _read_json(path: Path) -> Any:
    """The JSON document at ``path``, or ``None`` if missing or unreadable (a damaged cache
    entry is simply re-run)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _load_record(path: Path) -> FSLRRecord | None:
    try:
        return FSLRRecord.load(path)
    except (OSError, ValueError):
        return None


def _number_or_none(x: object) -> bool:
    """Whether ``x`` is a finite JSON number or ``null``: what a run stores for a loss."""
    return x is None or (
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    )


def _is_result(data: Any, spec: RunSpec) -> bool:
    """Whether ``data`` is a complete result of ``spec`` (what the summary and plots read).

    Examples:
        >>> spec = RunSpec("standard", 1.0, 0.5, 0)
        >>> run = {"format": RUN_FORMAT, "version": RUN_VERSION, "key": spec.key,
        ...        "mode": "standard", "scale": 1.0, "lr": 0.5, "seed": 0,
        ...        "loss": 0.25, "test_loss": None, "losses": [0.5, None]}
        >>> _is_result(run, spec), _is_result({**run, "loss": "abc"}, spec)
        (True, False)
    """
    if not isinstance(data, dict):
        return False
    head = (data.get("format"), data.get("version"), data.get("key"), data.get("mode"))
    if head != (RUN_FORMAT, RUN_VERSION, spec.key, spec.mode):
        return False
    if (data.get("scale"), data.get("lr"), data.get("seed")) != spec[1:]:
        return False
    losses = data.get("losses")
    if not (isinstance(losses, list) and all(_number_or_none(v) for v in losses)):
        return False
    if not (_number_or_none(data.get("loss")) and _number_or_none(data.get("test_loss"))):
        return False
    flerm = data.get("flerm", {})
    rates = flerm.get("lrs") if isinstance(flerm, dict) else None
    return flerm == {} or (
        isinstance(rates, dict)
        and all(isinstance(v, (int, float)) and math.isfinite(v) for v in rates.values())
    )


def _common_rows(record: FSLRRecord, steps: set[int]) -> FSLRRecord:
    """The rows of ``record`` at ``steps``."""
    rows = [i for i, s in enumerate(record.steps) if s in steps]
    return FSLRRecord(
        steps=[record.steps[i] for i in rows],
        fslr={n: [v[i] for i in rows] for n, v in record.fslr.items()},
        lrs={n: [v[i] for i in rows] for n, v in record.lrs.items()},
        sched=[record.sched[i] for i in rows],
        meta=record.meta,
    )


def mean_record(records: Iterable[FSLRRecord]) -> FSLRRecord | None:
    """Mean over seeds of the base records of one learning rate, on their common steps.

    A diverged base run stops early (fewer rows) and one without a finite estimate has none;
    the mean uses the steps all non-empty records share. ``None`` if no record has a row.

    Examples:
        >>> a = FSLRRecord(steps=[0, 5], fslr={"w": [1.0, 2.0]}, meta={"seed": 0})
        >>> b = FSLRRecord(steps=[0], fslr={"w": [3.0]}, meta={"seed": 1})
        >>> m = mean_record([a, b])
        >>> m.steps, m.fslr, m.meta["seed"]
        ([0], {'w': [2.0]}, [0, 1])
    """
    recs = [r for r in records if len(r)]
    if not recs:
        return None
    common = set(recs[0].steps)
    for r in recs[1:]:
        common &= set(r.steps)
    if not common:
        return None
    with warnings.catch_warnings():  # runs stopped at divergence: their rows are cut above
        warnings.filterwarnings("ignore", "FSLRRecord.mean: the seeds' runs lasted")
        return FSLRRecord.mean(_common_rows(r, common) for r in recs)


class SweepCache:
    """The cached runs and base records of a sweep folder, for one fingerprint.

    Args:
        out: the sweep folder.
        fingerprint: the config fingerprint cached files must carry.
        seeds: the sweep's seeds: FLeRM runs are valid only for a base record averaged over
            exactly these.
    """

    def __init__(self, out: Path, fingerprint: str, seeds: list[int]) -> None:
        self.out = out
        self.fingerprint = fingerprint
        self.seeds = seeds
        self._means: dict[float, FSLRRecord | None] = {}
        self._records: dict[tuple[float, int], FSLRRecord | None] = {}

    @classmethod
    def create(cls, out: Path, config: SweepConfig, task_name: str) -> SweepCache:
        """Make the folders of ``out`` and write its ``sweep.json`` for ``config`` and a task."""
        (out / "records").mkdir(parents=True, exist_ok=True)
        (out / "runs").mkdir(parents=True, exist_ok=True)
        fingerprint = config.fingerprint({"task": task_name})
        write_json(
            out / "sweep.json",
            {"config": config.to_dict(), "task": task_name, "fingerprint": fingerprint},
        )
        return cls(out, fingerprint, list(range(config.seeds)))

    def _run_path(self, spec: RunSpec) -> Path:
        return self.out / "runs" / f"{spec.key}.json"

    def _record_path(self, lr: float, seed: int) -> Path:
        return self.out / "records" / f"lr={lr_key(lr)}_seed={seed}.json"

    def _mean_path(self, lr: float) -> Path:
        return self.out / "records" / f"lr={lr_key(lr)}_mean.json"

    def run(self, spec: RunSpec) -> dict[str, Any] | None:
        """The cached result of ``spec``, or ``None`` if missing, damaged or stale."""
        data = _read_json(self._run_path(spec))
        if not _is_result(data, spec) or data.get("fingerprint") != self.fingerprint:
            return None
        if spec.mode == "flerm" and data.get("base_seeds") != self.seeds:
            return None
        return data  # type: ignore[no-any-return]  # a dict: checked by _is_result

    def record(self, lr: float, seed: int) -> FSLRRecord | None:
        """The base record of ``lr`` and ``seed`` if cached with this fingerprint, else ``None``.

        Read once, then kept: the record this sweep stored or first found stays the one its
        FLeRM runs use, whatever another process writes to the file afterwards.
        """
        if (lr, seed) not in self._records:
            rec = _load_record(self._record_path(lr, seed))
            # the record of this rate and seed: one copied under another file name is not
            ok = (
                rec is not None
                and rec.meta.get("fingerprint") == self.fingerprint
                and rec.meta.get("base_lr") == lr
                and rec.meta.get("seed") == seed
            )
            self._records[lr, seed] = rec if ok else None
        return self._records[lr, seed]

    def has_record(self, lr: float, seed: int) -> bool:
        """Whether the base record of ``lr`` and ``seed`` is cached with this fingerprint."""
        return self.record(lr, seed) is not None

    def plan(
        self, specs: Iterable[RunSpec], base_scale: float
    ) -> tuple[dict[str, dict[str, Any]], list[RunSpec], list[RunSpec]]:
        """What of ``specs`` is cached, what is left to train, and what must train with it.

        A standard run at ``base_scale`` counts as cached only with its base record (FLeRM
        needs it); every FLeRM run to train needs the base records of its learning rate, so
        those missing and not among the runs to train are added as extra recordings.

        Returns:
            ``(done, todo, pending)``: run key -> cached result; the runs of ``specs`` to
            train; ``todo`` followed by the extra base recordings.
        """
        done: dict[str, dict[str, Any]] = {}
        todo: list[RunSpec] = []
        for spec in dict.fromkeys(specs):
            data = self.run(spec)
            if data is not None and spec.mode == "standard" and spec.scale == base_scale:
                data = data if self.has_record(spec.lr, spec.seed) else None
            if data is None:
                todo.append(spec)
            else:
                done[spec.key] = data
        keys = {s.key for s in todo}
        recordings = [
            RunSpec("standard", base_scale, lr, seed)
            for lr in sorted({s.lr for s in todo if s.mode == "flerm"})
            for seed in self.seeds
            if not self.has_record(lr, seed)
        ]
        return done, todo, todo + [s for s in recordings if s.key not in keys]

    def mean(self, lr: float) -> FSLRRecord | None:
        """The seed mean of the base records of ``lr`` (:func:`mean_record`), also saved.

        Made once per :class:`SweepCache`, on first use, from the records of :meth:`record`,
        so call it only once every seed's base record of ``lr`` is stored.
        """
        if lr not in self._means:
            recs = [self.record(lr, s) for s in self.seeds]
            mean = mean_record(r for r in recs if r is not None)
            if mean is not None:
                mean.save(self._mean_path(lr))
            self._means[lr] = mean
        return self._means[lr]

    def store(
        self, spec: RunSpec, result: dict[str, Any], record: FSLRRecord | None, *, run: bool
    ) -> None:
        """Stamp a new run's result (in place) and base record with the fingerprint; save them.

        Args:
            spec: the run.
            result: its result; a FLeRM run's also gets the seeds of its base record.
            record: its base record, or ``None``.
            run: write the result too (``False`` for a run that only re-made its record).
        """
        result["fingerprint"] = self.fingerprint
        if spec.mode == "flerm":
            result["base_seeds"] = self.seeds
        if record is not None:
            record.meta["fingerprint"] = self.fingerprint
            record.save(self._record_path(spec.lr, spec.seed))
            self._records[spec.lr, spec.seed] = record
        if run:
            write_json(self._run_path(spec), result, parents=True)


def load_runs(out: str | os.PathLike[str]) -> tuple[SweepConfig, dict[str, dict[str, Any]]]:
    """The config and cached runs of a sweep folder (runs of other fingerprints left out).

    Raises:
        FileNotFoundError: if ``out`` has no readable ``sweep.json``.
        ValueError: if its config is damaged.
    """
    out = Path(out)
    meta = _read_json(out / "sweep.json")
    if not isinstance(meta, dict) or "config" not in meta:
        raise FileNotFoundError(f"{out} is not a sweep folder: it has no readable sweep.json")
    try:
        config = SweepConfig.from_dict(meta["config"]).validate(builtin=False)
    except (TypeError, ValueError, AttributeError) as err:
        raise ValueError(
            f"{out / 'sweep.json'} is damaged: its config is invalid ({err}); run the sweep "
            "again to rewrite it"
        ) from err
    cache = SweepCache(out, str(meta.get("fingerprint")), list(range(config.seeds)))
    runs = {}
    for spec in grid(config):
        data = cache.run(spec)
        if data is not None:
            runs[spec.key] = data
    return config, runs
