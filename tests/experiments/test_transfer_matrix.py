"""The transfer matrix's adaptive cells (fslr_func.experiments.matrix) and its printer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fslr_func.experiments.configs import SweepConfig
from fslr_func.experiments.matrix import (
    _half_octaves,
    _next_out,
    adaptive_cell,
    best_rate,
    cell_summary,
    fitted_best,
    other_seeds_best,
    two_width_cell,
    width_extrapolated_shift,
)
from fslr_func.experiments.run import RunSpec
from tests._scripts import load_script


def test_next_out_widens_only_at_an_edge():
    rates = [2.0**-8, 2.0**-7, 2.0**-6]
    assert _next_out(2.0**-7, rates) is None
    assert _next_out(2.0**-8, rates) == 2.0**-9
    assert _next_out(2.0**-6, rates) == 2.0**-5
    assert _next_out(None, rates) == 2.0**-9  # nothing converged: go down
    assert _next_out(2.0**-20, [2.0**-20, 2.0**-19]) is None  # the range's end


def test_best_rate_needs_every_seed_and_skips_diverged_rates():
    runs = {
        RunSpec("flerm", 8.0, lr, k).key: {"mode": "flerm", "scale": 8.0, "lr": lr, "loss": v}
        for lr, k, v in [(0.5, 0, 1.0), (0.5, 1, 3.0), (0.25, 0, 1.5), (1.0, 0, None)]
    }
    runs |= {
        RunSpec("flerm", 8.0, 1.0, 1).key: {"mode": "flerm", "scale": 8.0, "lr": 1.0, "loss": 0.1}
    }
    # 0.25 lacks seed 1; 1.0 diverged on seed 0; 0.5 scores 2.0
    assert best_rate(runs, "flerm", 8.0, 2) == (0.5, [0.5, 1.0])


def test_other_seeds_best_scores_each_seed_at_the_rate_the_others_chose():
    def runs_of(table):
        return {
            RunSpec("standard", 8.0, lr, k).key: {
                "mode": "standard", "scale": 8.0, "lr": lr, "loss": v
            }
            for lr, losses in table.items()
            for k, v in enumerate(losses)
        }  # fmt: skip

    # seeds 0 and 1 get 0.5's loss (the others' means: 1.5 at 0.25, 1.35 at 0.5), seed 2
    # 0.25's (1.0 against 1.5): (1.5 + 1.5 + 2.0) / 3, above the best seed mean (4/3 at 0.25)
    table = {0.25: (1.0, 1.0, 2.0), 0.5: (1.5, 1.5, 1.2)}
    assert other_seeds_best(runs_of(table), "standard", 8.0, 3) == pytest.approx(5.0 / 3)
    assert best_rate(runs_of(table), "standard", 8.0, 3)[0] == 0.25
    # a seed whose chosen rate diverged makes the reference infinite, and no ratio is read
    diverged = runs_of({0.25: (1.0, None), 0.5: (2.0, 2.0)})
    assert other_seeds_best(diverged, "standard", 8.0, 2) == math.inf
    assert other_seeds_best(runs_of({0.25: (1.0,)}), "standard", 8.0, 1) is None  # one seed
    summary = cell_summary(
        SweepConfig(scales=(1, 8), seeds=2),
        {**diverged, **{
            RunSpec("mup", 8.0, 0.5, k).key: {"mode": "mup", "scale": 8.0, "lr": 0.5, "loss": 1.0}
            for k in range(2)
        }},
        0.5,
        ["standard", "mup"],
    )  # fmt: skip
    assert "other_seeds_ratio" not in summary["modes"]["mup"] and "ratio" in summary["modes"]["mup"]


def _tiny_cell() -> SweepConfig:
    """A cell that trains in seconds: 1x and 2x, two rates to start from, one seed."""
    return SweepConfig(
        width=4,
        depth=1,
        scales=(1, 2),
        lrs=(2.0**-5, 2.0**-4),
        steps=6,
        last=2,
        seeds=1,
        num_samples=500,
        batch_size=32,
        samples=2,
        warmup_samples=2,
        every=3,
    )


def test_adaptive_cell_finds_interior_optima_on_a_tiny_task(tmp_path):
    config = _tiny_cell()
    lines: list[str] = []
    s = adaptive_cell(config, tmp_path / "cell", jobs=1, log=lines.append)
    assert lines and math.log2(s["tuned"]) == round(math.log2(s["tuned"]))
    for m, entry in s["modes"].items():
        assert entry["best_lr"] is not None
        assert not entry["edge"], (m, entry)  # widened until the optimum is interior
        assert entry["at_tuned"]["losses"] is not None
    assert s["modes"]["flerm"]["ratio"] > 0
    again = adaptive_cell(config, tmp_path / "cell", jobs=1, log=lines.append)
    assert again == s  # all cached
    n = len(lines)
    adaptive_cell(config, tmp_path / "cell", jobs=1, log=lines.append)
    assert len(lines) == n  # nothing ran


def test_half_octaves_are_the_grid_floats_and_skip_rates_run():
    assert _half_octaves(2.0**-7, [2.0**-8, 2.0**-7]) == [2.0**-7.5, 2.0**-6.5]
    # from an off-octave rate the neighbours are the octave floats a cached run has
    assert _half_octaves(2.0**-6.5, [2.0**-7, 2.0**-6.5]) == [2.0**-6]
    assert _half_octaves(0.01, []) == [0.01 * 2**-0.5, 0.01 * 2**0.5]  # off the grid


def test_refined_cell_resolves_every_best_rate_to_half_an_octave(tmp_path):
    config = _tiny_cell()
    octave = adaptive_cell(config, tmp_path / "cell", jobs=1)
    refined = adaptive_cell(config, tmp_path / "cell", jobs=1, refine=True)
    b = refined["tuned"]
    assert abs(round(math.log2(b / octave["tuned"]), 6)) in (0.0, 0.5)  # b or b * 2**+-0.5
    for m, entry in refined["modes"].items():
        half = {round(2 * math.log2(lr), 6) for lr in entry["rates"]}
        k = round(2 * math.log2(entry["best_lr"]))
        assert {k - 1, k + 1} <= half, m  # both half-octave neighbours of the best were run
        assert entry["best_loss"] <= octave["modes"][m]["best_loss"] or b != octave["tuned"]
        assert entry["at_tuned"]["losses"] is not None  # every mode ran at the refined b
    # the octave read-out of the same folder is unchanged by the refined runs beside it
    assert adaptive_cell(config, tmp_path / "cell", jobs=1, train=False) == octave


def test_cell_summary_ratio_against_retuned_standard():
    cfg = SweepConfig(scales=(1, 8), seeds=2)
    rows = [
        ("standard", 1.0, 0.5, [1.0, 1.2]),
        ("standard", 8.0, 0.25, [0.8, 0.8]),
        ("standard", 8.0, 0.5, [0.9, 0.9]),
        ("flerm", 8.0, 0.5, [0.84, 0.84]),
        ("mup", 8.0, 0.5, [0.7, None]),
    ]
    runs = {
        RunSpec(m, s, lr, k).key: {"mode": m, "scale": s, "lr": lr, "loss": v}
        for m, s, lr, vs in rows
        for k, v in enumerate(vs)
    }
    out = cell_summary(cfg, runs, 0.5, ["standard", "flerm", "mup"])
    assert out["base_loss"] == pytest.approx(1.1)
    assert out["modes"]["standard"]["shift"] == -1.0
    assert out["modes"]["flerm"]["ratio"] == pytest.approx(0.84 / 0.8)
    assert out["modes"]["mup"]["at_tuned"]["mean"] is None  # a seed diverged
    assert "ratio" not in out["modes"]["mup"]


def test_cell_summary_reads_test_losses_at_the_rates_chosen_by_training_loss():
    cfg = SweepConfig(scales=(1, 8), seeds=2)
    rows = [  # (mode, scale, lr, losses, test losses)
        ("standard", 1.0, 0.5, [1.0, 1.0], [1.5, 1.5]),
        ("standard", 8.0, 0.25, [0.8, 0.8], [1.2, 1.4]),  # best by training loss
        ("standard", 8.0, 0.5, [0.9, 0.9], [1.0, 1.0]),  # best by test loss: not chosen
        ("flerm", 8.0, 0.5, [0.84, 0.84], [0.9, 1.1]),
        ("mup", 8.0, 0.5, [0.7, 0.7], [0.9, None]),  # a seed without a test loss
    ]
    runs = {
        RunSpec(m, s, lr, k).key: {"mode": m, "scale": s, "lr": lr, "loss": v, "test_loss": t}
        for m, s, lr, vs, ts in rows
        for k, (v, t) in enumerate(zip(vs, ts, strict=True))
    }
    out = cell_summary(cfg, runs, 0.5, ["standard", "flerm", "mup"])["modes"]
    assert out["standard"]["best_test"] == pytest.approx(1.3)
    assert out["flerm"]["at_tuned"]["test"] == pytest.approx(1.0)
    assert out["flerm"]["test_ratio"] == pytest.approx(1.0 / 1.3)
    assert out["mup"]["at_tuned"]["test"] is None and "test_ratio" not in out["mup"]
    assert out["mup"]["ratio"] == pytest.approx(0.7 / 0.8)


def _curve(losses: dict[float, float | None], seeds: int = 1) -> dict:
    """FLeRM runs at 2x: log2 rate -> loss (``None``: diverged), the same on every seed."""
    return {
        RunSpec("flerm", 2.0, 2.0**e, k).key: {
            "mode": "flerm",
            "scale": 2.0,
            "lr": 2.0**e,
            "loss": v,
        }
        for e, v in losses.items()
        for k in range(seeds)
    }


def test_fitted_best_is_the_parabolas_vertex_between_the_neighbours():
    # a parabola with its vertex at -6.2, on a grid of unequal spacing
    exact = {e: (e + 6.2) ** 2 + 1.0 for e in (-8.0, -7.0, -6.5, -6.0, -5.0)}
    assert fitted_best(_curve(exact), "flerm", 2.0, 1) == pytest.approx(-6.2)
    # kept between the neighbours of the best rate, however steep the other side
    lopsided = {-7.0: 1.0, -6.5: 0.5, -6.0: 0.5000001}
    assert -6.5 <= fitted_best(_curve(lopsided), "flerm", 2.0, 1) <= -6.0
    # the best itself at an edge, or next to a diverged rate: nothing to fit
    assert fitted_best(_curve({-7.0: 2.0, -6.0: 1.0}), "flerm", 2.0, 1) == -6.0
    assert fitted_best(_curve({-7.0: 2.0, -6.0: 1.0, -5.0: None}), "flerm", 2.0, 1) == -6.0
    assert fitted_best(_curve({-7.0: None}), "flerm", 2.0, 1) is None


def test_width_extrapolated_shift_decays_as_one_over_the_width():
    s2 = 0.4
    # s(m) = s_inf (1 - 1/m): s(2) = s_inf / 2, so s_inf = 0.8
    assert width_extrapolated_shift(s2, 2, 8) == pytest.approx(0.8 * (1 - 1 / 8))
    assert width_extrapolated_shift(s2, 2, 2) == pytest.approx(s2)
    assert width_extrapolated_shift(-s2, 2, 4) == pytest.approx(-0.6)
    with pytest.raises(ValueError, match="must exceed 1"):
        width_extrapolated_shift(s2, 1, 8)
    with pytest.raises(ValueError, match="must be finite"):
        width_extrapolated_shift(math.nan, 2, 8)


def test_two_width_cell_runs_the_top_width_at_the_extrapolated_rates(tmp_path):
    config = _tiny_cell().replace(scales=(1, 4), flerm_variant="readout_built_upstream")
    tuned = 2.0**-4
    doc = two_width_cell(config, tmp_path / "top", tmp_path / "second", tuned, 2, jobs=1)
    mup = two_width_cell(config, tmp_path / "top", tmp_path / "mup2", tuned, 2, mode="mup")
    assert set(mup["at"]) == {"inverse_width", "constant"}  # muP gets the same second width
    s2 = doc["second_fit_shift"]
    second = adaptive_cell(
        config.replace(scales=(1, 2)),
        tmp_path / "second",
        modes=("flerm",),
        tuned=tuned,
        train=False,
        refine=True,
    )
    assert s2 == second["modes"]["flerm"]["fit_shift"]  # the refined grid's fitted best
    inverse = math.log2(doc["rates"]["inverse_width"] / tuned)
    assert inverse == pytest.approx(width_extrapolated_shift(s2, 2, 4), abs=0.005)
    assert math.log2(doc["rates"]["constant"] / tuned) == pytest.approx(s2, abs=0.005)
    for model in ("inverse_width", "constant"):
        assert math.isfinite(doc["at"][model]["mean"])
    for rate in (0.0, -1e-3, math.inf, math.nan):
        with pytest.raises(ValueError, match="positive finite"):
            two_width_cell(config, tmp_path / "top", tmp_path / "bad", rate, 2, train=False)
    for bad in (1, 4, 8):  # the second width lies strictly between the base and the top
        with pytest.raises(ValueError, match="between the base's"):
            two_width_cell(config, tmp_path / "top", tmp_path / "bad", tuned, bad, train=False)
    # cached: a re-read trains nothing and reads the same
    again = two_width_cell(
        config, tmp_path / "top", tmp_path / "second", tuned, 2, jobs=1, train=False
    )
    assert again == doc


def test_matrix_script_lists_cells_and_prints_rows(capsys):
    mod = load_script("benchmarks/transfer_matrix.py")
    assert mod.main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert "resmlp-w32-s150" in names and "conv2d-bn-w8-s150" in names
    families = {mod.ALL_CELLS[n].model for n in names}
    by_name = set(mod.HELD_OUT_CELLS) | set(mod.BUDGET_CELLS) | set(mod.OPTIMIZER_CELLS)
    assert by_name <= set(names)  # run by name too
    assert {mod.ALL_CELLS[n].optimizer for n in names} == {"adam", "adamw", "sgd"}
    assert families == {"resmlp", "resconv", "resconv_bn", "transformer"}
    main = {
        "tuned": 2.0**-6,
        "modes": {
            "standard": {"shift": -2.0, "best_loss": 1.0, "edge": False},
            "flerm": {"shift": 0.0, "at_tuned": {"mean": 1.05, "sd": 0.01}, "edge": False},
            "mup": {"shift": 1.0, "at_tuned": {"mean": 0.95, "sd": 0.02}, "edge": True},
        },
    }
    line = mod.row("x", main)
    assert (
        line
        == "| x | 2^-6 | +0 | 1.050 (0.010) | 1.050 | -2 | 1.000 | >=+1 | 0.950 (0.020) | 0.950 |"
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--base-rate", "nope=2^-6", "--variant", "feature"], "unknown cell 'nope'"),
        (["--base-rate", "resmlp-w32-s150=x", "--variant", "feature"], "'x' is not a number"),
        (["--base-rate", "resmlp-w32-s150=2^-6"], "give --variant"),
        (["--two-widths", "2"], "needs --variant"),
        (["--two-widths", "8", "--variant", "feature"], "1 < K < 8"),
        (["--seeds", "0"], "--seeds must be a positive integer"),
    ],
)
def test_matrix_script_base_rate_refuses_bad_input(args, says, capsys):
    mod = load_script("benchmarks/transfer_matrix.py")
    with pytest.raises(SystemExit) as err:
        mod.main(args)
    assert err.value.code == 2 and says in capsys.readouterr().err


def test_matrix_script_base_rate_runs_the_variant_at_the_given_rate(tmp_path, capsys, monkeypatch):
    mod = load_script("benchmarks/transfer_matrix.py")
    seen = {}

    def fake_cell(config, out, *, modes, tuned, **kw):
        seen.update(variant=config.flerm_variant, modes=modes, tuned=tuned)
        at = {"mean": 0.5, "sd": 0.01}
        return {"modes": {"flerm": {"shift": 1.0, "at_tuned": at, "best_loss": 0.4}}}

    monkeypatch.setattr(mod, "adaptive_cell", fake_cell)
    args = ["--cells", "resmlp-w32-s600", "--base-rate", "resmlp-w32-s600=2^-7"]
    assert mod.main([*args, "--variant", "feature", "--out", str(tmp_path)]) == 0
    assert seen == {"variant": "feature", "modes": ("flerm",), "tuned": 2.0**-7}
    fake = fake_cell

    def counted(config, out, **kw):  # --seeds: the cell's own seeds replaced
        seen["seeds"] = config.seeds
        return fake(config, out, **kw)

    monkeypatch.setattr(mod, "adaptive_cell", counted)
    assert mod.main([*args, "--variant", "feature", "--out", str(tmp_path), "--seeds", "5"]) == 0
    assert seen["seeds"] == 5 != mod.ALL_CELLS["resmlp-w32-s600"].seeds
    out = capsys.readouterr().out
    assert "resmlp-w32-s600 feature: shift +1; loss at b 0.5000 (sd 0.0100); best 0.4000" in out
    assert "transfer matrix" not in out  # no main cell ran: no tables


def test_readout_first_gradient_script_scaled_before_is_mup(monkeypatch):
    from fslr_func.experiments.run import execute
    from fslr_func.experiments.task import builtin_task

    mod = load_script("benchmarks/readout_first_gradient.py")
    tiny = SweepConfig.for_model(
        "resmlp", scales=(1, 8), steps=4, last=2, width=4, depth=2, num_samples=500, batch_size=16
    )
    monkeypatch.setitem(mod.CELLS, "tiny", tiny)
    mup, _ = execute(builtin_task(tiny), tiny, RunSpec("mup", 8, 0.01, 0))
    before = mod.run("tiny", 0.01, 0, "before")
    assert before == pytest.approx(mup["loss"], rel=1e-4)  # muP's forward and rates
    assert mod.run("tiny", 0.01, 0, "after") != pytest.approx(before, rel=1e-4)


def test_readout_choice_script_reports_the_auto_variants_choice(tmp_path, monkeypatch):
    import dataclasses

    from fslr_func.experiments.run import execute
    from fslr_func.experiments.task import builtin_task

    mod = load_script("benchmarks/readout_choice.py")
    tiny = SweepConfig.for_model(
        "resmlp", scales=(1, 8), steps=3, last=1, width=4, depth=2, num_samples=500, batch_size=16
    )
    tiny = dataclasses.replace(tiny, flerm_variant="readout_built_auto", samples=4)
    monkeypatch.setitem(mod.ALL_CELLS, "tiny", tiny)
    _, record = execute(builtin_task(tiny), tiny, RunSpec("standard", 1, 0.01, 0), record=True)
    record.save(tmp_path / "lr=0.01_mean.json")
    factor, matched = mod.choice("tiny", 0.01, 0, tmp_path)
    assert factor > 0 and matched == ("features" if factor < 0.5 else "output")


def test_two_width_row_reads_each_model_against_retuning():
    mod = load_script("benchmarks/transfer_matrix.py")
    main = {
        "tuned": 2.0**-6,
        "modes": {"standard": {"best_loss": 0.5}, "mup": {"at_tuned": {"mean": 0.54}}},
    }
    variant = {
        "tuned": 2.0**-6,
        "modes": {"flerm": {"fit_shift": 0.3, "at_tuned": {"mean": 0.55}}},
        "two_widths": {
            "second_fit_shift": 0.2,
            "rates": {"inverse_width": 2.0**-5.65, "constant": 2.0**-5.8},
            "at": {"inverse_width": {"mean": 0.5}, "constant": {"mean": 0.52}},
        },
    }
    mup = {"rates": {"inverse_width": 2.0**-6.5}, "at": {"inverse_width": {"mean": 0.53}}}
    assert mod.two_width_row("x", main, variant, mup) == (
        "| x | 2^-6 | +0.20; +0.30 | 1.100 | +0.35; 1.000 | +0.20; 1.040 | 1.080 | -0.50; 1.060 "
        "| -; - |"
    )


def test_two_width_counts_reads_both_references():
    mod = load_script("benchmarks/transfer_matrix.py")
    main = {
        "modes": {
            "standard": {"best_loss": 1.0, "other_seeds_best": 1.1},
            "mup": {"at_tuned": {"mean": 1.1}},
        }
    }
    variant = {
        "modes": {"flerm": {"at_tuned": {"mean": 1.0}}},
        "two_widths": {"at": {"inverse_width": {"mean": 1.2}, "constant": {"mean": 1.05}}},
    }
    mup = {"at": {"constant": {"mean": 0.9}}}  # its inverse-width model did not run
    line = mod.two_width_counts([(main, variant, mup)])
    assert line == (
        "within 2% of re-tuning, of 1 (of re-tuning judged on other seeds): FLeRM at b 1 (1); "
        "inverse width 0 (0); constant 0 (1); muP at b 0 (1); muP, inverse width 0 (0); "
        "muP, constant 1 (1)"
    )


@pytest.mark.parametrize("given", [True, False])
def test_matrix_script_two_widths_prints_the_table_and_counts(tmp_path, capsys, monkeypatch, given):
    mod = load_script("benchmarks/transfer_matrix.py")
    calls = []

    def fake_cell(config, out, *, modes=("standard", "mup", "flerm"), tuned=None, **kw):
        at = {"mean": 0.5, "sd": 0.0}
        return {
            "tuned": tuned or 2.0**-7,
            "modes": {
                "standard": {"best_loss": 0.5, "other_seeds_best": 0.5},
                "mup": {"at_tuned": {"mean": 0.6}},
                "flerm": {"shift": 0.0, "fit_shift": 0.1, "at_tuned": at, "best_loss": 0.5},
            },
        }

    def fake_two(config, out, out_second, tuned, second, *, mode="flerm", **kw):
        calls.append((mode, Path(out_second).parent.name, second))
        return {"second_fit_shift": 0.2, "rates": {"constant": tuned * 2**0.2}, "at": {}}

    monkeypatch.setattr(mod, "adaptive_cell", fake_cell)
    monkeypatch.setattr(mod, "two_width_cell", fake_two)
    args = ["--cells", "resmlp-w32-s150", "--variant", "feature", "--two-widths", "2"]
    args += ["--base-rate", "resmlp-w32-s150=2^-7"] if given else []
    assert mod.main([*args, "--out", str(tmp_path / "matrix")]) == 0
    out = capsys.readouterr().out
    # FLeRM's and muP's second width, in the sibling folder of the 2x cells
    assert sorted(calls) == [("flerm", "matrix@2x", 2), ("mup", "matrix@2x", 2)]
    assert "| resmlp-w32-s150 feature | 2^-7 | +0.20; +0.10 | 1.000 |" in out
    assert "FLeRM at b 1 (1); inverse width 0 (0); constant 0 (0); muP at b 0 (0)" in out
