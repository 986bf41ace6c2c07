"""The learning-rate transfer sweep: caching, resume, identity check, summary, configs."""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fslr_func.experiments.configs import DEMO, ConfigError, SweepConfig, octaves
from fslr_func.experiments.plot import _scale_label
from fslr_func.experiments.summary import format_table
from fslr_func.experiments.sweep import (
    RunSpec,
    Task,
    builtin_task,
    grid,
    load_runs,
    mean_record,
    run_sweep,
    summarise,
)
from fslr_func.io.record import FSLRRecord

# ---------------------------------------------------------------------------------- tiny task

_X = torch.randn(192, 5, generator=torch.Generator().manual_seed(0))
_Y = (_X[:, 0] > 0).long() + (_X[:, 1] > 0).long()


class _Net(nn.Module):
    """Input -> `depth` residual blocks -> readout: names match the depth policy."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.input = nn.Linear(5, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.readout = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.input(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.readout(h)


def _build(axis: str, scale: float, seed: int) -> nn.Module:
    if axis == "width":
        return _Net(round(8 * scale), 1)
    return _Net(round(8 * scale) if axis == "width_depth" else 8, round(2 * scale))


def _batches(seed: int, probe: bool = False) -> Any:
    g = torch.Generator().manual_seed(seed + (1000 if probe else 0))
    while True:
        idx = torch.randint(0, len(_Y), (32,), generator=g)
        yield _X[idx] if probe else (_X[idx], _Y[idx])


def tiny_task(axis: str = "width") -> Task:
    return Task(
        name=f"tiny-{axis}",
        build=functools.partial(_build, axis),
        train_batches=_batches,
        probe_batches=functools.partial(_batches, probe=True),
    )


def tiny_config(**kw: Any) -> SweepConfig:
    base: dict[str, Any] = {
        "scales": (1, 2),
        "lrs": (0.01, 0.04),
        "steps": 6,
        "seeds": 2,
        "last": 3,
        "samples": 4,
        "warmup_samples": 8,
        "every": 3,
    }
    return SweepConfig(**{**base, **kw})


def _sweep(cfg: SweepConfig, out: Path, **kw: Any) -> Any:
    return run_sweep(cfg, out, task=kw.pop("task", tiny_task(cfg.axis)), quiet=True, **kw)


# ---------------------------------------------------------------------------------- caching


def test_layout_and_summary_fields(tmp_path: Path) -> None:
    cfg = tiny_config()
    result = _sweep(cfg, tmp_path)
    assert len(result.executed) == len(grid(cfg)) == 24
    assert len(list((tmp_path / "runs").glob("*.json"))) == 24
    for lr in ("0.01", "0.04"):
        for seed in (0, 1):
            rec = FSLRRecord.load(tmp_path / "records" / f"lr={lr}_seed={seed}.json")
            assert rec.steps == [0, 3] and rec.meta["base_lr"] == float(lr)
        assert (tmp_path / "records" / f"lr={lr}_mean.json").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["axis"] == "width" and summary["scales"] == [1.0, 2.0]
    for mode in ("standard", "mup", "flerm"):
        m = summary["modes"][mode]
        assert set(m["best_lr"]) == {"1", "2"} and set(m["best_loss"]) == {"1", "2"}
        assert all(v in (0.01, 0.04) for v in m["best_lr"].values())
        assert m["shift_octaves"] == math.log2(m["best_lr"]["2"] / m["best_lr"]["1"])
    assert summary["config"]["steps"] == 6 and summary["wall_seconds"] >= 0
    # no leftover temporary files from the atomic writes
    assert not list(tmp_path.rglob("*.tmp"))


def test_interrupted_sweep_resumes_only_missing_runs(tmp_path: Path) -> None:
    cfg = tiny_config()
    done: list[str] = []

    def interrupt_after_five(result: dict[str, Any]) -> None:
        done.append(result["key"])
        if len(done) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _sweep(cfg, tmp_path, on_run=interrupt_after_five)
    assert len(list((tmp_path / "runs").glob("*.json"))) == 5
    resumed = _sweep(cfg, tmp_path)
    assert sorted(resumed.executed) == sorted({s.key for s in grid(cfg)} - set(done))
    again = _sweep(cfg, tmp_path)
    assert again.executed == [] and again.summary["modes"] == resumed.summary["modes"]


def test_deleted_run_and_grown_grid_rerun_only_what_is_missing(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1)
    _sweep(cfg, tmp_path)
    key = RunSpec("standard", 2.0, 0.04, 0).key
    (tmp_path / "runs" / f"{key}.json").unlink()
    assert _sweep(cfg, tmp_path).executed == [key]
    # a new learning rate: its standard (base one records), muP and FLeRM runs only
    more = cfg.replace(lrs=(0.01, 0.04, 0.02))
    assert sorted(_sweep(more, tmp_path).executed) == sorted(
        RunSpec(m, s, 0.02, 0).key for m in ("standard", "mup", "flerm") for s in (1.0, 2.0)
    )
    # a deleted base record is re-recorded; FLeRM runs of that lr stay valid (same seeds)
    (tmp_path / "records" / "lr=0.01_seed=0.json").unlink()
    assert _sweep(more, tmp_path).executed == [RunSpec("standard", 1.0, 0.01, 0).key]


def test_other_config_or_more_seeds_reruns(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1, scales=(1,), lrs=(0.01,))
    _sweep(cfg, tmp_path)
    assert len(_sweep(cfg.replace(steps=7), tmp_path).executed) == 3  # fingerprint changed
    # seed 1 is new; FLeRM seed 0 re-runs because its base record is now a 2-seed mean
    executed = _sweep(cfg.replace(steps=7, seeds=2), tmp_path).executed
    assert sorted(executed) == sorted(
        [RunSpec("standard", 1.0, 0.01, 1).key, RunSpec("mup", 1.0, 0.01, 1).key]
        + [RunSpec("flerm", 1.0, 0.01, s).key for s in (0, 1)]
    )


def test_damaged_cache_file_is_rerun(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1, scales=(1,), lrs=(0.01,), modes=("standard",))
    _sweep(cfg, tmp_path)
    key = RunSpec("standard", 1.0, 0.01, 0).key
    (tmp_path / "runs" / f"{key}.json").write_text('{"format": "fslr_func.sweep.run", "ver')
    assert _sweep(cfg, tmp_path).executed == [key]


def test_damaged_cache_files_are_rerun_and_rewritten(tmp_path: Path) -> None:
    # issue 10: a run file with "loss": "abc" was cached as valid; the summary raised TypeError
    cfg = tiny_config(seeds=1, scales=(1,), lrs=(0.01,))
    first = _sweep(cfg, tmp_path)
    record = tmp_path / "records" / "lr=0.01_seed=0.json"
    good = FSLRRecord.load(record)
    record.write_text(record.read_text()[:50])  # cut short
    assert _sweep(cfg, tmp_path).executed == [RunSpec("standard", 1.0, 0.01, 0).key]
    assert FSLRRecord.load(record) == good
    key = RunSpec("flerm", 1.0, 0.01, 0).key
    path = tmp_path / "runs" / f"{key}.json"
    for change in ({"loss": "abc"}, {"losses": [1.0, "nan"]}, {"flerm": {"lrs": {"w": None}}},
                   {"scale": 2.0}, {"loss": True}):  # fmt: skip
        path.write_text(json.dumps({**first.runs[key], **change}))
        again = _sweep(cfg, tmp_path)
        assert again.executed == [key], change
        assert json.loads(path.read_text())["loss"] == first.runs[key]["loss"]


def test_base_record_swapped_by_another_sweep_is_not_used(tmp_path: Path) -> None:
    # issue 10: two sweeps of different configs in one folder; a FLeRM run read the other
    # sweep's base record (no fingerprint check) and was cached as valid for good
    cfg = tiny_config(seeds=1, lrs=(0.02,))
    record = tmp_path / "records" / "lr=0.02_seed=0.json"

    def other_sweep_writes(result: dict[str, Any]) -> None:
        if result["key"] == RunSpec("standard", 1.0, 0.02, 0).key:
            foreign = FSLRRecord.load(record)
            foreign.fslr = {n: [123.0] * len(v) for n, v in foreign.fslr.items()}
            foreign.meta["fingerprint"] = "another-config"
            foreign.save(record)

    result = _sweep(cfg, tmp_path, on_run=other_sweep_writes)
    run = result.runs[RunSpec("flerm", 1.0, 0.02, 0).key]
    assert 123.0 not in run["flerm"]["targets"].values()
    assert result.summary["identity_check"]["max_abs_loss_diff"] == 0.0
    mean = FSLRRecord.load(tmp_path / "records" / "lr=0.02_mean.json")
    assert (
        mean.meta["fingerprint"] == result.runs[RunSpec("flerm", 1.0, 0.02, 0).key]["fingerprint"]
    )
    # a resumed sweep finds the foreign record stale: it re-records it, keeps its FLeRM runs
    assert _sweep(cfg, tmp_path).executed == [RunSpec("standard", 1.0, 0.02, 0).key]
    assert FSLRRecord.load(record).fslr == mean.fslr


def test_files_get_the_umask_permissions(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1, scales=(1,), lrs=(0.01,))
    old = os.umask(0o027)
    try:
        _sweep(cfg, tmp_path / "out")
    finally:
        os.umask(old)
    paths = list((tmp_path / "out").rglob("*"))
    assert len(paths) == 9  # sweep.json, summary.json, 2 folders, 3 runs, record, mean
    for path in paths:
        assert path.stat().st_mode & 0o777 == (0o750 if path.is_dir() else 0o640), path


# ---------------------------------------------------------------------------------- FLeRM


def test_flerm_at_base_scale_reproduces_standard(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1)
    result = _sweep(cfg, tmp_path)
    check = result.summary["identity_check"]
    assert check == {"lr_ratio_min": 1.0, "lr_ratio_max": 1.0, "max_abs_loss_diff": 0.0}
    for lr in cfg.lrs:
        std = result.runs[RunSpec("standard", 1.0, lr, 0).key]
        fl = result.runs[RunSpec("flerm", 1.0, lr, 0).key]
        assert std["losses"] == fl["losses"]
        wide = result.runs[RunSpec("flerm", 2.0, lr, 0).key]
        assert set(wide["flerm"]["lrs"]) == {n for n, _ in _Net(16, 1).named_parameters()}
        assert wide["flerm"]["lrs"] != dict.fromkeys(wide["flerm"]["lrs"], lr)


def test_depth_sweep_uses_share_blocks(tmp_path: Path) -> None:
    cfg = tiny_config(axis="depth", seeds=1, lrs=(0.02,))
    result = _sweep(cfg, tmp_path)
    run = result.runs[RunSpec("flerm", 2.0, 0.02, 0).key]
    targets = run["flerm"]["targets"]
    base = FSLRRecord.load(tmp_path / "records" / "lr=0.02_mean.json").at(0)
    # 2 base blocks -> 4 blocks: each base block's FSLR is shared by two scaled blocks
    assert targets["blocks.0.weight"] == pytest.approx(base["blocks.0.weight"] / 2)
    assert targets["blocks.3.weight"] == pytest.approx(base["blocks.1.weight"] / 2)
    assert targets["readout.weight"] == pytest.approx(base["readout.weight"])


def test_width_depth_sweep_shares_blocks_and_mup_widens_the_new_blocks(tmp_path: Path) -> None:
    cfg = tiny_config(axis="width_depth", seeds=1, lrs=(0.02,))
    assert cfg.policy == "share_blocks"
    result = _sweep(cfg, tmp_path)
    run = result.runs[RunSpec("flerm", 2.0, 0.02, 0).key]
    base = FSLRRecord.load(tmp_path / "records" / "lr=0.02_mean.json").at(0)
    # 8 units, 2 blocks -> 16 units, 4 blocks: blocks shared as over depth, names kept for width
    assert run["flerm"]["targets"]["blocks.3.weight"] == pytest.approx(base["blocks.1.weight"] / 2)
    assert run["flerm"]["targets"]["input.weight"] == pytest.approx(base["input.weight"])
    # muP: block 3 has no base tensor but its role (blocks.*.weight) is 2x wider in both dims
    mup = result.runs[RunSpec("mup", 2.0, 0.02, 0).key]["mup"]["lrs"]
    assert mup["blocks.3.weight"] == mup["blocks.0.weight"] == pytest.approx(0.01)
    assert mup["input.weight"] == pytest.approx(0.02)


@pytest.mark.parametrize("policy", ["equal", "equal_all"])
def test_the_paper_ablations_set_equal_targets(tmp_path: Path, policy: str) -> None:
    cfg = tiny_config(axis="depth", seeds=1, lrs=(0.02,), flerm_policy=policy, modes=("flerm",))
    assert cfg.policy == policy
    result = _sweep(cfg, tmp_path)
    targets = result.runs[RunSpec("flerm", 2.0, 0.02, 0).key]["flerm"]["targets"]
    names = [n for n, _ in _Net(8, 4).named_parameters()]
    assert set(targets) == set(names)
    if policy == "equal_all":  # every one of the 12 scaled tensors: 1 / 12
        assert targets == pytest.approx(dict.fromkeys(names, 1 / 12))
    else:  # each of the 8 base tensors 1 / 8; the 2 base blocks' shares split over 4 blocks
        assert targets["readout.weight"] == pytest.approx(1 / 8)
        assert targets["blocks.3.bias"] == pytest.approx(1 / 16)


def test_diverged_runs_score_infinity(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1, lrs=(0.01, 1e30), steps=20, last=5)
    result = _sweep(cfg, tmp_path)
    for mode in ("standard", "mup", "flerm"):
        m = result.summary["modes"][mode]
        assert m["loss"]["2"][1] is None and m["best_lr"]["2"] == 0.01
    run = result.runs[RunSpec("standard", 2.0, 1e30, 0).key]
    assert run["loss"] is None and len(run["losses"]) < 20 and run["losses"][-1] is None
    json.dumps(result.summary, allow_nan=False)  # strict JSON throughout


@pytest.mark.slow
def test_parallel_jobs_match_in_process(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1, lrs=(0.02,))
    inline = _sweep(cfg, tmp_path / "a")
    parallel = _sweep(cfg, tmp_path / "b", jobs=2)
    assert sorted(parallel.executed) == sorted(inline.executed)
    for key, run in inline.runs.items():
        assert parallel.runs[key]["losses"] == pytest.approx(run["losses"], rel=1e-5)


# ---------------------------------------------------------------------------------- summary


def _fake(mode: str, scale: float, lr: float, seed: int, loss: float | None) -> dict[str, Any]:
    return {"key": RunSpec(mode, scale, lr, seed).key, "loss": loss, "test_loss": None}


def test_summarise_best_lr_shift_and_seed_mean() -> None:
    cfg = SweepConfig(scales=(1, 8), lrs=octaves(-4, -1), seeds=2)
    # standard: optimum at 2^-2 for 1x and 2^-4 for 8x; FLeRM: 2^-2 for both
    curve: dict[tuple[str, float], list[float | None]] = {
        ("standard", 1.0): [3.0, 2.0, 1.0, 2.5],
        ("standard", 8.0): [0.5, 0.8, 1.5, None],
        ("flerm", 1.0): [3.0, 2.0, 1.0, 2.5],
        ("flerm", 8.0): [2.0, 1.0, 0.4, 0.9],
    }
    runs = {}
    for (mode, scale), losses in curve.items():
        for lr, loss in zip(cfg.lrs, losses, strict=True):
            for seed in (0, 1):
                value = None if loss is None else loss + (0.1 if seed else -0.1)
                r = _fake(mode, scale, lr, seed, value)
                runs[r["key"]] = r
    s = summarise(cfg, runs)
    assert s["modes"]["standard"]["best_lr"] == {"1": 0.25, "8": 0.0625}
    assert s["modes"]["standard"]["shift_octaves"] == -2.0
    assert s["modes"]["standard"]["best_loss"]["8"] == pytest.approx(0.5)
    assert s["modes"]["standard"]["loss"]["8"][3] is None
    assert s["modes"]["flerm"]["shift_octaves"] == 0.0
    assert s["modes"]["flerm"]["best_loss"] == {"1": pytest.approx(1.0), "8": pytest.approx(0.4)}
    # scale labels name the table's rows and the figure's lines (the LoRA example's ranks)
    s["scale_labels"] = {"1": "rank 2", "8": "rank 16"}
    rows = format_table(s).splitlines()
    assert rows[1].startswith("rank 2 ") and rows[2].startswith("rank 16 ")
    assert _scale_label(s, 8.0) == "rank 16"
    # a missing seed makes the cell unusable, not better
    del runs[RunSpec("flerm", 8.0, 0.25, 1).key]
    assert summarise(cfg, runs)["modes"]["flerm"]["best_lr"]["8"] == 0.5


def test_load_runs_ignores_other_fingerprints(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1, scales=(1,), lrs=(0.01,), modes=("standard",))
    _sweep(cfg, tmp_path)
    config, runs = load_runs(tmp_path)
    assert config == cfg and list(runs) == [RunSpec("standard", 1.0, 0.01, 0).key]
    meta = json.loads((tmp_path / "sweep.json").read_text())
    meta["fingerprint"] = "something-else"
    (tmp_path / "sweep.json").write_text(json.dumps(meta))
    assert load_runs(tmp_path)[1] == {}
    with pytest.raises(FileNotFoundError, match="not a sweep folder"):
        load_runs(tmp_path / "runs")


def test_mean_record_uses_common_steps() -> None:
    a = FSLRRecord(steps=[0, 3, 6], fslr={"w": [1.0, 2.0, 3.0]}, meta={"seed": 0})
    b = FSLRRecord(steps=[0, 3], fslr={"w": [3.0, 4.0]}, meta={"seed": 1})
    empty = FSLRRecord(meta={"seed": 2})
    m = mean_record([a, b, empty])
    assert m is not None and m.steps == [0, 3] and m.fslr == {"w": [2.0, 3.0]}
    assert mean_record([empty]) is None


# ---------------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"axis": "sideways"}, "axis"),
        ({"model": "cnn"}, "model"),
        ({"data": "text"}, "data"),
        ({"steps": 0}, "steps"),
        ({"seeds": 0}, "seeds"),
        ({"last": 500}, "last"),
        ({"scales": (1, 1.5), "width": 5}, "scales"),
        ({"scales": (1, 1)}, "scales"),
        ({"scales": (0, 1)}, "scales"),
        ({"lrs": (0.1, -0.1)}, "lrs"),
        ({"lrs": ()}, "lrs"),
        ({"modes": ()}, "modes"),
        ({"flerm_mode": "sometimes"}, "flerm_mode"),
        ({"flerm_policy": "nope"}, "flerm_policy"),
        # adds blocks the identity policy cannot map: failed after the base runs had trained
        ({"flerm_policy": "identity", "axis": "depth"}, "flerm_policy"),
        ({"flerm_init": "xavier"}, "flerm_init"),
        ({"axis": "width_depth", "depth": 3, "scales": (1, 4 / 3)}, "scales"),
        ({"model": "transformer", "data": "text", "width": 24}, "scales"),
        ({"model": "transformer", "data": "text", "norm": "sandwich"}, "norm"),
        ({"norm": "postnorm"}, "norm"),  # the ResMLP has no norms
    ],
)
def test_config_errors_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        SweepConfig(**change).validate()
    assert info.value.field == field


def test_config_round_trip_and_demo_is_valid() -> None:
    assert SweepConfig.from_dict(json.loads(json.dumps(DEMO.to_dict()))) == DEMO.validate()
    assert DEMO.scales[0] == 1 and DEMO.axis == "width" and DEMO.model == "resmlp"
    assert SweepConfig(scales=(8, 2, 4)).scales == (2.0, 4.0, 8.0)


def test_builtin_tasks_build_every_axis() -> None:
    task = builtin_task(SweepConfig(data="digits", width=8, depth=2, axis="depth"))
    assert len(task.build(4, 0).blocks) == 8  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="batch_size"):
        builtin_task(SweepConfig(data="digits", batch_size=1439))
    lm = builtin_task(
        SweepConfig.for_model("transformer", width=16, scales=(1, 2), seq_len=8, batch_size=2)
    )
    model = lm.build(2.0, 0)
    x, y = next(iter(lm.train_batches(0)))
    assert model(x).shape == (*y.shape, 256) and model.d_model == 32


@pytest.mark.parametrize("norm", ["prenorm", "postnorm", "prenormpostmod"])
def test_transformer_norm_reaches_the_model_and_the_fingerprint(norm: str) -> None:
    cfg = SweepConfig.for_model(
        "transformer", width=16, scales=(1, 2), seq_len=8, batch_size=2, norm=norm
    )
    model = builtin_task(cfg).build(2.0, 0)
    assert {b.norm_type for b in model.blocks} == {norm}  # type: ignore[union-attr]
    prenorm = cfg.replace(norm="prenorm")
    assert (cfg.fingerprint() == prenorm.fingerprint()) == (norm == "prenorm")
    assert SweepConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_prenorm_fingerprints_are_those_cached_before_the_norm_field() -> None:
    # sweeps cached before `norm` existed (PreNorm) must stay valid: these are the
    # fingerprints of benchmarks/transfer.py's two sweeps as computed before the field
    tf = SweepConfig.for_model(
        "transformer", width=16, scales=(1, 8), lrs=octaves(-10, -3), steps=150, last=30, seeds=3
    )
    assert tf.fingerprint({"task": tf.task_name}) == "83b22d4f81441b5f"
    assert DEMO.fingerprint({"task": DEMO.task_name}) == "827a924b4129523d"


def test_custom_task_skips_builtin_checks(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1, scales=(1, 1.25), lrs=(0.02,), modes=("standard",), width=7)
    with pytest.raises(ConfigError, match="whole number"):
        cfg.validate()  # 7 x 1.25 units is not a built-in ResMLP
    result = _sweep(cfg, tmp_path)  # the custom task builds round(8 * 1.25) units itself
    assert len(result.executed) == 2 and result.summary["task"] == "tiny-width"


def test_docs_demo_md_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "demo.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert len(blocks) == 1
    code = blocks[0]
    for old, new in [
        ("STEPS = 150", "STEPS = 6"),
        ("octaves(-10, -5)", "octaves(-6, -5)"),
        ("num_samples=5000", "num_samples=400"),
        ("jobs=2", "jobs=1"),
        ('"fslr_runs/gated"', repr(str(tmp_path / "gated"))),
    ]:
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(doc), "exec"), {"__name__": "__main__"})
    summary = json.loads((tmp_path / "gated" / "summary.json").read_text())
    assert summary["task"] == "gated-mlp/mnist1d" and summary["scales"] == [1.0, 2.0, 4.0]
    assert (tmp_path / "gated" / "transfer.png").stat().st_size > 1000


def test_periodic_flerm_resets_every_every_steps(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1, lrs=(0.02,), flerm_mode="periodic")
    run = _sweep(cfg, tmp_path).runs[RunSpec("flerm", 2.0, 0.02, 0).key]
    assert run["flerm"]["set_points"] == [0, 3]  # steps = 6, every = 3


def test_the_cache_takes_a_base_record_only_under_its_own_rate_and_seed(tmp_path: Path) -> None:
    """A record copied under another file name (another rate's, a sync tool's rename) was
    used for the rate of its name: the FLeRM runs of that rate came out wrong, silently."""
    from fslr_func.experiments.cache import SweepCache
    from fslr_func.io.record import FSLRRecord

    cache = SweepCache(tmp_path, "fp", [0])
    (tmp_path / "records").mkdir()
    record = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"base_lr": 2.0**-8, "seed": 0})
    record.meta["fingerprint"] = "fp"
    record.save(tmp_path / "records" / "lr=0.00390625_seed=0.json")
    record.save(tmp_path / "records" / "lr=0.015625_seed=0.json")  # mislabeled
    record.save(tmp_path / "records" / "lr=0.00390625_seed=1.json")  # mislabeled seed
    assert cache.record(2.0**-8, 0) is not None
    assert cache.record(2.0**-6, 0) is None
    assert cache.record(2.0**-8, 1) is None
