"""FLeRM variants of the transfer matrix (fslr_func.experiments.variants)."""

from __future__ import annotations

import contextlib
import functools
import math
import types

import pytest
import torch
from torch import nn

import fslr_func as ff
from fslr_func.experiments.configs import SweepConfig
from fslr_func.experiments.mup import apply_mup
from fslr_func.experiments.sweep import run_sweep
from fslr_func.experiments.variants import (
    VARIANTS,
    FeatureSpaceWindowFLeRM,
    GainTrackingFLeRM,
    GainTrackingRecorder,
    HiddenWidthPolicy,
    LocalGainRecorder,
    ReadoutBuiltMuPRatesFLeRM,
    ReadoutGainFLeRM,
    ReadoutInitFLeRM,
    ReadoutInitFreshFLeRM,
    ReadoutInitWindowFLeRM,
    ReadoutLocalFLeRM,
    ReadoutMuPAnchorFLeRM,
    ReadoutMuPHiddenFLeRM,
    ReadoutUpstreamFLeRM,
    ReadoutWidthBuiltFLeRM,
    ReadoutWidthFLeRM,
    WindowFLeRM,
    local_gains,
    window_ratios,
)


def _tiny_flerm(**changes: object) -> dict[str, object]:
    """A FLeRM-only ResMLP sweep small enough for a test (a few steps, one rate and seed)."""
    return {
        "width": 4,
        "depth": 2,
        "lrs": (0.01,),
        "last": 1,
        "seeds": 1,
        "num_samples": 500,
        "batch_size": 16,
        "samples": 4,
        "warmup_samples": 4,
        "every": 2,
        "modes": ("flerm",),
        **changes,
    }


def _flerm_runs(tmp_path, *variants: str, steps: int) -> dict[str, dict]:
    """The 8x FLeRM run of a tiny two-scale sweep per variant (the same seed and rate)."""
    common = _tiny_flerm(scales=(1, 8), steps=steps)
    return {
        v: run_sweep(SweepConfig(**common, flerm_variant=v), tmp_path / v, quiet=True).runs[
            "flerm_scale=8_lr=0.01_seed=0"
        ]["flerm"]
        for v in variants
    }


def _net(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3)
    )


def _run(
    width: int,
    base: ff.FSLRRecord | None = None,
    recorder=ff.Recorder,
    cls=None,
    steps=10,
    optimizer=torch.optim.Adam,
    **kw,
):
    model = _net(width)
    fm = ff.with_fslr(model, samples=4, seed=0, beta=0.0, strategy="loop")
    opt = optimizer(fm.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    probes = (torch.randn(16, 5, generator=g) for _ in range(10_000))
    if base is None:
        ctl = recorder(fm, probes, optimizer=opt, warmup_samples=4, every=2)
    else:
        make = cls or WindowFLeRM
        ctl = make(fm, opt, base, probe_batches=probes, warmup_samples=4, every=2, **kw)
    data = torch.Generator().manual_seed(2)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 5, generator=data)
        fm(x).square().mean().backward()
        with ctl.step():
            opt.step()
    return ctl


def test_window_ratios_is_a_ratio_of_sums():
    t = [{"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 2.0}]
    f = [{"a": 2.0, "b": 1.0}, {"a": 2.0, "b": math.inf}]
    assert window_ratios(t, f) == {"a": 1.0}  # b has a non-finite probe: left out
    assert window_ratios([{"a": 0.0}], [{"a": 1.0}]) == {}  # zero target: held


def test_window_flerm_rematches_to_the_window_movement():
    base = _run(8).record
    flerm = _run(32, base, window=(2, 6))
    assert [p.step for p in flerm.history] == [0, 6]
    rec = flerm.window_record
    assert rec.steps == [2, 4, 6]
    # the rates after the window are lr0 * sum(targets) / sum(FSLRs) over its probes
    lrs = flerm.lrs()
    for name in flerm.names:
        num = sum(base.at(s)[name] for s in rec.steps)
        den = sum(rec.fslr[name][i] for i in range(len(rec.steps)))
        assert lrs[name] == pytest.approx(1e-2 * num / den, rel=1e-9)
    cumulative = _run(32, base, window=(2, 8), cumulative=True)
    assert [p.step for p in cumulative.history] == [0, 2, 4, 6, 8]


def test_window_flerm_refuses_a_window_off_the_probe_grid():
    base = _run(8).record
    with pytest.raises(ValueError, match="window"):
        _run(32, base, window=(3, 6))


def test_hidden_width_policy_scales_only_two_infinite_dims():
    base = {n: tuple(p.shape) for n, p in _net(8).named_parameters()}
    pol = HiddenWidthPolicy(_net(32), base)
    assert pol.factors == {"2.weight": 2.0}  # fan-in 32 / 8 = 4, sqrt
    assert pol.one_to_one
    targets = pol(dict.fromkeys(base, 0.5), list(base))
    assert targets["2.weight"] == 1.0 and targets["0.weight"] == 0.5
    assert HiddenWidthPolicy(_net(32), base, alpha=0.0).factors == {"2.weight": 1.0}
    # at the base width nothing changes
    assert HiddenWidthPolicy(_net(8), base).factors == {}


def test_hidden_width_variant_sets_hidden_rates_up_by_the_factor(tmp_path):
    common = _tiny_flerm(scales=(1, 4), steps=3)
    plain = run_sweep(SweepConfig(**common), tmp_path / "plain", quiet=True)
    var = run_sweep(
        SweepConfig(**common, flerm_variant="hidden_sqrt"), tmp_path / "var", quiet=True
    )
    key = "flerm_scale=4_lr=0.01_seed=0"
    a, b = plain.runs[key]["flerm"], var.runs[key]["flerm"]
    for name, lr in a["lrs"].items():
        factor = 2.0 if name.startswith("blocks") and name.endswith("weight") else 1.0
        assert b["lrs"][name] == pytest.approx(factor * lr, rel=1e-9), name
    assert set(VARIANTS) >= {"hidden_sqrt", "window30", "window_all"}


def test_feature_variant_rescales_only_hidden_tensors_by_the_measured_gain(tmp_path):
    common = _tiny_flerm(scales=(1, 8), steps=3)
    plain = run_sweep(SweepConfig(**common), tmp_path / "plain", quiet=True)
    var = run_sweep(SweepConfig(**common, flerm_variant="feature"), tmp_path / "var", quiet=True)
    gains = ff.FSLRRecord.load(tmp_path / "var" / "records" / "lr=0.01_seed=0.json").meta[
        "feature_gain"
    ]
    assert "readout.weight" not in gains and "blocks.0.linear.weight" in gains
    key = "flerm_scale=8_lr=0.01_seed=0"
    a, b = plain.runs[key]["flerm"], var.runs[key]["flerm"]
    for name, lr in a["final_lrs"].items():  # the same base record and set point, ...
        hidden = name.startswith("blocks") and name.endswith("weight")
        ratio = b["final_lrs"][name] / lr  # ... the factor applied from the set point on
        assert b["lrs"][name] / a["lrs"][name] == pytest.approx(ratio), name
        assert (ratio != pytest.approx(1.0)) if hidden else ratio == pytest.approx(1.0), name


def test_feature_window_hidden_only_rematches_hidden_tensors_only(tmp_path):
    runs = _flerm_runs(tmp_path, "feature_window30", "feature_window30h", steps=12)
    a, b = runs["feature_window30"], runs["feature_window30h"]
    assert a["set_points"] == b["set_points"] == [0, 2]  # window (2, 0.3 * 12 rounded down)
    assert a["lrs"] == b["lrs"]
    for name in a["lrs"]:
        hidden = name.startswith("blocks") and name.endswith("weight")
        assert b["final_lrs"][name] == pytest.approx(
            a["final_lrs"][name] if hidden else a["lrs"][name]
        )
        if not hidden:
            assert a["final_lrs"][name] != pytest.approx(a["lrs"][name])  # re-matched


def test_powered_feature_variants_raise_the_hidden_factor_to_their_power(tmp_path):
    common = _tiny_flerm(scales=(1, 8), steps=3)
    lrs = {}
    for v in (None, "feature", "feature_p15", "feature_sq"):
        res = run_sweep(SweepConfig(**common, flerm_variant=v), tmp_path / str(v), quiet=True)
        lrs[v] = res.runs["flerm_scale=8_lr=0.01_seed=0"]["flerm"]["final_lrs"]
    for name, plain in lrs[None].items():
        factor = lrs["feature"][name] / plain  # 1 but for the hidden weights
        hidden = name.startswith("blocks") and name.endswith("weight")
        assert (factor > 1.2) if hidden else factor == pytest.approx(1.0), name
        assert lrs["feature_p15"][name] / plain == pytest.approx(factor**1.5, rel=1e-6), name
        assert lrs["feature_sq"][name] / plain == pytest.approx(factor**2, rel=1e-6), name


def test_gain_tracking_re_measures_the_factors_against_the_base_at_each_set_point():
    base = _run(8, recorder=GainTrackingRecorder).record
    at = base.meta["feature_gain_at"]
    assert sorted(int(s) for s in at) == base.steps == [0, 2, 4, 6, 8]
    assert at["0"] == base.meta["feature_gain"]  # the first update's, as Recorder's
    flerm = _run(32, base, cls=GainTrackingFLeRM, mode="periodic")
    assert [p.step for p in flerm.history] == [0, 2, 4, 6, 8]
    assert set(flerm.feature_factors) == {"2.weight"}
    first, last = flerm.history[0], flerm.history[-1]
    # output movement matched once: every other tensor keeps its step-0 rate
    assert {n: r for n, r in last.lrs.items() if n != "2.weight"} == {
        n: r for n, r in first.lrs.items() if n != "2.weight"
    }
    assert last.lrs["2.weight"] != pytest.approx(first.lrs["2.weight"])  # re-measured


def test_feature_space_window_matches_the_hidden_tensors_feature_movement_over_the_window():
    base = _run(8, recorder=GainTrackingRecorder).record
    flerm = _run(32, base, cls=FeatureSpaceWindowFLeRM, window=(2, 6), steps=8)
    assert [p.step for p in flerm.history] == [0, 6]
    first, last = flerm.history
    rec = flerm.window_record
    assert rec.steps == [2, 4, 6]
    scaled_at, base_at = rec.meta["feature_gain_at"], base.meta["feature_gain_at"]
    assert all(set(scaled_at[str(s)]) == {"2.weight"} for s in rec.steps)  # hidden only
    num = sum(base.at(s)["2.weight"] / base_at[str(s)]["2.weight"] for s in rec.steps)
    den = sum(rec.at(s)["2.weight"] / scaled_at[str(s)]["2.weight"] for s in rec.steps)
    assert last.lrs["2.weight"] == pytest.approx(1e-2 * num / den, rel=1e-6)
    assert last.lrs["2.weight"] != pytest.approx(first.lrs["2.weight"], rel=1e-3)
    # every other tensor keeps its step-0 rate
    assert {n: r for n, r in last.lrs.items() if n != "2.weight"} == {
        n: r for n, r in first.lrs.items() if n != "2.weight"
    }


def test_readout_gain_scales_the_readout_once_and_rates_the_rest_by_its_inverse():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    output = _run(32, base, cls=ff.FLeRM)
    readout = _run(32, base, cls=ReadoutGainFLeRM, mode="periodic")
    c = readout.readout_scale
    assert 0.2 < c < 0.9  # the wide model's gain is larger: its readout shrinks
    ratios0, plain0 = readout.history[0].lrs, output.history[0].lrs
    for name, lr in plain0.items():  # the same step-0 measurement, rates 1 / c off the readout
        want = lr if name.startswith("4.") else lr / c
        assert ratios0[name] == pytest.approx(want, rel=1e-6), name
    assert readout.history[1].step == 2 and readout._pending is None  # scaled once
    # after step 0 the readout's weight is c times that of the same step at the same rate
    one = _run(32, base, cls=ff.FLeRM, steps=1).fm.module[4].weight
    scaled = _run(32, base, cls=ReadoutGainFLeRM, steps=1).fm.module[4].weight
    assert torch.allclose(scaled, c * one, rtol=1e-5, atol=1e-7)


def test_readout_init_scales_the_readout_before_the_first_step_then_matches_output():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    gain = _run(32, base, cls=ReadoutGainFLeRM, steps=1)
    init = _run(32, base, cls=ReadoutInitFLeRM, steps=1, mode="periodic")
    # the same first update (Adam's sign of the gradient), so the same gains and scale
    assert init.readout_scale == pytest.approx(gain.readout_scale, rel=1e-4)  # Adam: eps
    assert init.feature_factors == {} and [p.step for p in init.history] == [0]
    plain = _run(32, base, cls=ff.FLeRM, steps=1).fm.module[4].weight
    ratio = float(init.fm.module[4].weight.detach().norm() / plain.detach().norm())
    assert ratio == pytest.approx(init.readout_scale, abs=0.05)  # scaled before one step
    rates, plain_rates = init.history[0].lrs, _run(32, base, cls=ff.FLeRM, steps=1).history[0].lrs
    for name in ("0.weight", "2.weight"):  # measured through the smaller readout: higher
        assert rates[name] > 1.5 * plain_rates[name], name


def test_readout_init_window_rematches_hidden_tensors_only(tmp_path):
    run = _flerm_runs(tmp_path, "readout_init_window30h", steps=12)["readout_init_window30h"]
    assert run["set_points"] == [0, 2]  # step 0, then the window (2, 0.3 * 12 rounded down)
    for name, lr in run["lrs"].items():
        hidden = name.startswith("blocks") and name.endswith("weight")
        moved = run["final_lrs"][name] != pytest.approx(lr)
        assert moved if hidden else not moved, name


def test_readout_init_window_scales_the_readout_as_readout_init_does():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    init = _run(32, base, cls=ReadoutInitFLeRM, steps=1)
    window = _run(32, base, cls=ReadoutInitWindowFLeRM, steps=1, window=(2, 4))
    assert window.readout_scale == pytest.approx(init.readout_scale) and window.readout_scale < 0.9
    assert window.feature_factors == {}  # the readout carries the factor


def test_raise_only_window_keeps_the_higher_of_the_step0_and_window_rates(tmp_path):
    runs = _flerm_runs(tmp_path, "feature_window30h_p15", "feature_window30h_p15_up", steps=12)
    both, up = runs["feature_window30h_p15"], runs["feature_window30h_p15_up"]
    assert up["lrs"] == both["lrs"]  # the same step 0; the window re-matches at step 2
    for name, lr in both["lrs"].items():
        want = max(lr, both["final_lrs"][name])
        assert up["final_lrs"][name] == pytest.approx(want, rel=1e-9), name


def test_readout_init_static_matches_once_on_the_scaled_readout(tmp_path):
    runs = _flerm_runs(tmp_path, "readout_init", "readout_init_static", steps=12)  # every 10
    static, periodic = runs["readout_init_static"], runs["readout_init"]
    assert static["set_points"] == [0] and len(periodic["set_points"]) > 1
    assert static["lrs"] == pytest.approx(periodic["lrs"])  # the same scaled readout at step 0
    assert static["final_lrs"] == static["lrs"]


def test_readout_width_static_matches_once_on_muPs_readout(tmp_path):
    runs = _flerm_runs(tmp_path, "readout_width", "readout_width_static", steps=12)
    static, periodic = runs["readout_width_static"], runs["readout_width"]
    assert static["set_points"] == [0] and len(periodic["set_points"]) > 1
    assert static["lrs"] == pytest.approx(periodic["lrs"])  # the same scaled readout at step 0
    assert static["final_lrs"] == static["lrs"]


def test_readout_width_scales_the_readout_by_muPs_factor_before_the_first_step():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    width = _run(32, base, cls=ReadoutWidthFLeRM, steps=1, mode="periodic")
    assert width.readout_scale == pytest.approx(0.5)  # sqrt(8 / 32): the readout's fan-in
    init = _run(32, base, cls=ReadoutInitFLeRM, steps=1, mode="periodic")
    ratio = float(
        width.fm.module[4].weight.detach().norm() / init.fm.module[4].weight.detach().norm()
    )
    assert ratio == pytest.approx(0.5 / init.readout_scale, rel=0.05)  # after one step


def test_readout_width_built_scales_the_readout_before_the_first_gradient():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    built = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=0, mode="periodic")
    assert built.readout_scale == pytest.approx(0.5)  # sqrt(8 / 32), before any step
    assert float(built.fm.module[4].weight.detach().norm()) == pytest.approx(
        0.5 * float(_net(32)[4].weight.detach().norm())
    )
    # the first gradient is the scaled model's: Adam's moments never see the unscaled one
    after = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1, mode="periodic")
    late = _run(32, base, cls=ReadoutWidthFLeRM, steps=1, mode="periodic")
    first = after.optimizer.state[after.fm.module[2].weight]["exp_avg_sq"]
    stale = late.optimizer.state[late.fm.module[2].weight]["exp_avg_sq"]
    assert float(first.sum()) < 0.5 * float(stale.sum())  # hidden gradients shrink with c


@pytest.mark.parametrize(
    ("match", "variant"),
    [
        ("output", ReadoutWidthBuiltFLeRM),
        ("features", functools.partial(ReadoutWidthBuiltFLeRM, hidden_features=True)),
        ("features_all", ReadoutUpstreamFLeRM),
    ],
)
def test_the_built_readout_variants_are_scale_readout_then_a_plain_flerm(match, variant):
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record

    def recipe(fm, opt, base, *, probe_batches, **kw):
        ff.scale_readout(fm, base, next(probe_batches))  # the batch the variant's finder takes
        return ff.FLeRM(fm, opt, base, probe_batches=probe_batches, match=match, **kw)

    built = _run(32, base, cls=variant, mode="periodic")
    public = _run(32, base, cls=recipe, mode="periodic")
    assert public.ratios == built.ratios
    assert (public.feature_factors or {}) == (built.feature_factors or {})
    for p, q in zip(public.fm.parameters(), built.fm.parameters(), strict=True):
        assert torch.equal(p, q)


def test_readout_width_built_can_match_the_hidden_tensors_features():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    output = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1)
    features = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1, hidden_features=True)
    assert output.feature_factors == {}
    assert set(features.feature_factors) == {"2.weight"}  # the one hidden tensor
    ratio = features.ratios["2.weight"] / output.ratios["2.weight"]
    assert ratio == pytest.approx(features.feature_factors["2.weight"], rel=1e-5)
    assert features.ratios["0.weight"] == pytest.approx(output.ratios["0.weight"], rel=1e-5)


def test_readout_width_built_chooses_feature_matching_below_a_threshold():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    features = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1, hidden_features=True)
    (factor,) = features.feature_factors.values()
    low = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1, hidden_features=factor * 1.01)
    high = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1, hidden_features=factor * 0.99)
    assert low.hidden_matched == "features" and low.ratios == pytest.approx(features.ratios)
    assert low.hidden_factor == pytest.approx(factor)  # one hidden tensor: its own factor
    assert high.hidden_matched == "output" and high.feature_factors == {}
    output = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1)
    assert output.hidden_matched == "output" and high.ratios == pytest.approx(output.ratios)


def test_readout_upstream_matches_every_tensor_before_the_readout_in_feature_space():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    output = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1)
    upstream = _run(32, base, cls=ReadoutUpstreamFLeRM, steps=1)
    assert set(upstream.feature_factors) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, factor in upstream.feature_factors.items():
        ratio = upstream.ratios[name] / output.ratios[name]
        assert ratio == pytest.approx(factor, rel=1e-5), name
    for name in ("4.weight", "4.bias"):  # the readout's own: output movement, as before
        assert upstream.ratios[name] == pytest.approx(output.ratios[name], rel=1e-5)
    assert upstream.readout_scale == pytest.approx(0.5)


def _zero_bias_net(width: int) -> nn.Module:
    net = _net(width)
    for layer in net:
        if isinstance(layer, nn.Linear):
            nn.init.zeros_(layer.bias)  # as the matrix's models: muP's bias scaling is then moot
    return net


@pytest.mark.parametrize(
    ("name", "optimizer"),
    [("adam", torch.optim.Adam), ("sgd", functools.partial(torch.optim.SGD, momentum=0.9))],
)
def test_the_mup_rates_control_trains_as_mup_does(name, optimizer):
    g = torch.Generator().manual_seed(1)
    probes = (torch.randn(16, 5, generator=g) for _ in range(10_000))
    data = [torch.randn(16, 5, generator=g) for _ in range(6)]

    def train(model, opt, controller=None):
        for x in data:
            opt.zero_grad()
            model(x).square().mean().backward()
            with controller.step() if controller else contextlib.nullcontext():
                opt.step()

    fm = ff.with_fslr(_zero_bias_net(8), samples=4, seed=0, beta=0.0)
    opt = optimizer(fm.parameters(), lr=1e-2)
    recorder = ff.Recorder(fm, probes, optimizer=opt, warmup_samples=4, every=2, feature_gains=True)
    train(fm, opt, recorder)
    fm = ff.with_fslr(_zero_bias_net(32), samples=4, seed=0, beta=0.0)
    opt = optimizer(fm.parameters(), lr=1e-2)
    control = ReadoutBuiltMuPRatesFLeRM(
        fm, opt, recorder.record, probe_batches=probes, warmup_samples=4, every=2
    )
    mup = _zero_bias_net(32)
    mup_opt = optimizer(apply_mup(mup, _zero_bias_net(8), 1e-2, optimizer=name), lr=1e-2)
    x = torch.randn(7, 5)
    assert torch.equal(fm(x), mup(x))  # scale_readout gives muP's initial function
    train(fm, opt, control)
    train(mup, mup_opt)
    with torch.no_grad():  # and its rates muP's updates (Adam: up to its eps)
        assert torch.allclose(fm(x), mup(x), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(fm(x), _zero_bias_net(32)(x) * 0.5, atol=1e-3)  # it trained
    assert len(control.history) == 1  # set once, at step 0, and held


def test_local_gains_are_output_movement_over_the_own_layers_output_movement():
    net = _net(6)
    fm = ff.with_fslr(net, samples=4, seed=0)
    x = torch.randn(9, 5)
    delta = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    m = types.SimpleNamespace(delta=delta, before=before, inputs=[x])
    gains = local_gains(fm, m)
    out = ff.exact(net, x, delta)
    h = torch.relu(net[0](x)).detach()  # the input of the hidden layer "2"
    layer = (h @ delta["2.weight"].T).square().mean().sqrt()  # its output's movement, RMS
    assert gains["2.weight"] == pytest.approx(float(out["2.weight"] / layer), rel=1e-5)
    bias = delta["2.bias"].expand(9, 6).square().mean().sqrt()
    assert gains["2.bias"] == pytest.approx(float(out["2.bias"] / bias), rel=1e-5)
    assert gains["4.weight"] == pytest.approx(1.0) and gains["4.bias"] == pytest.approx(1.0)
    assert set(local_gains(fm, m, names={"0.weight"})) == {"0.weight"}


def test_readout_local_scales_every_tensors_output_matched_ratio_by_its_local_factor():
    base = _run(8, recorder=LocalGainRecorder).record
    assert base.meta["feature_gain"]["4.weight"] == pytest.approx(1.0)  # the readout's own
    output = _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=1)
    local = _run(32, base, cls=ReadoutLocalFLeRM, steps=1)
    assert set(local.feature_factors) == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
        "4.weight",
        "4.bias",
    }
    for name, factor in local.feature_factors.items():
        ratio = local.ratios[name] / output.ratios[name]
        assert ratio == pytest.approx(factor, rel=1e-5), name
    assert local.feature_factors["4.weight"] == pytest.approx(1.0, rel=1e-5)


def test_mup_anchor_starts_at_mups_rates_and_follows_the_rules_rematching():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    control = _run(32, base, cls=ReadoutBuiltMuPRatesFLeRM, steps=1)
    first = _run(32, base, cls=ReadoutMuPAnchorFLeRM, steps=1, mode="periodic")
    assert first.lrs() == pytest.approx(control.lrs(), rel=1e-6)  # step 0: muP's rates
    anchored = _run(32, base, cls=ReadoutMuPAnchorFLeRM, steps=5, mode="periodic")
    assert len(anchored.history) == 3  # set points at steps 0, 2 and 4
    matched, start = anchored._matched, anchored._first
    assert matched != start  # the rule's own ratios were re-matched on this run
    for name, lr in anchored.lrs().items():  # the rule's change since step 0, on muP's start
        expected = control.lrs()[name] * matched[name] / start[name]
        assert lr == pytest.approx(expected, rel=1e-5), name


def test_mup_hidden_starts_only_the_hidden_matrices_at_mups_rates():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    control = _run(32, base, cls=ReadoutBuiltMuPRatesFLeRM, steps=1).lrs()
    rule = _run(32, base, cls=ReadoutUpstreamFLeRM, steps=1, mode="periodic").lrs()
    hidden = _run(32, base, cls=ReadoutMuPHiddenFLeRM, steps=1, mode="periodic").lrs()
    assert hidden["2.weight"] == pytest.approx(control["2.weight"], rel=1e-6)  # the hidden one
    for name in ("0.weight", "0.bias", "2.bias", "4.weight", "4.bias"):
        assert hidden[name] == pytest.approx(rule[name], rel=1e-6), name


def test_the_readout_variants_refuse_output_matching():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    with pytest.raises(ValueError, match="read feature gains"):
        _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=0, match="output")


@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf])
def test_readout_width_built_refuses_a_threshold_that_is_not_positive_and_finite(bad):
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    with pytest.raises(ValueError, match="positive finite threshold"):
        _run(32, base, cls=ReadoutWidthBuiltFLeRM, steps=0, hidden_features=bad)


def test_readout_init_fresh_takes_its_first_step_back_on_the_scaled_readout():
    base = _run(8, recorder=functools.partial(ff.Recorder, feature_gains=True)).record
    fresh = _run(32, base, cls=ReadoutInitFreshFLeRM, steps=1, mode="periodic")
    init = _net(32)
    for (name, p), q in zip(fresh.fm.module.named_parameters(), init.parameters(), strict=True):
        scale = fresh.readout_scale if name == "4.weight" else 1.0
        assert torch.allclose(p.detach(), scale * q.detach()), name  # no update kept
    assert not fresh.optimizer.state  # Adam's moments start at the next gradient
    assert fresh.history[0].step == 0 and fresh.readout_scale < 1.0  # measured, set
    two = _run(32, base, cls=ReadoutInitFreshFLeRM, steps=2, mode="periodic")
    assert {float(s["step"]) for s in two.optimizer.state.values()} == {1.0}


def test_the_measured_readout_variants_are_registered():
    names = {"readout_init", "readout_init_static", "readout_width", "readout_width_static"}
    names |= {"readout_init_window30h", "readout_built", "readout_built_static"}
    names |= {"readout_init_fresh", "readout_built_features", "readout_built_auto"}
    names |= {"readout_built_upstream", "readout_built_upstream_static"}
    names |= {"readout_built_mup_rates", "readout_built_local", "readout_built_mup_anchor"}
    names |= {"readout_built_mup_hidden"}
    assert names <= set(VARIANTS)  # the sweep resolves a variant by its name


def test_a_base_run_with_its_own_allocation_is_transferred_by_flerm():
    from fslr_func.experiments.run import RunSpec, execute
    from fslr_func.experiments.task import builtin_task

    config = SweepConfig(**{**_tiny_flerm(scales=(1, 8), steps=3), "modes": ("standard",)})
    task = builtin_task(config)
    hidden = {"blocks.0.linear.weight": 4.0}
    runs = {
        k: execute(task, config, RunSpec("standard", 1.0, 0.01, 0), record=True, lr_factors=f)
        for k, f in (("plain", None), ("factored", hidden))
    }
    plain, factored = runs["plain"][1], runs["factored"][1]
    assert factored.meta["base_lr"] == 0.01  # not the first group's, whatever the order
    assert factored.lrs_at(0)["blocks.0.linear.weight"] == pytest.approx(0.04)
    assert factored.lrs_at(0)["blocks.1.linear.weight"] == pytest.approx(0.01)
    flerm = {
        k: execute(task, config, RunSpec("flerm", 8.0, 0.01, 0), rec)[0]["flerm"]["lrs"]
        for k, rec in (("plain", plain), ("factored", factored))
    }
    # the same first update (the base's step 0 is before any rate acts), targets 4x: rate 4x
    assert flerm["factored"]["blocks.0.linear.weight"] == pytest.approx(
        4 * flerm["plain"]["blocks.0.linear.weight"], rel=1e-6
    )
    assert flerm["factored"]["blocks.1.linear.weight"] == pytest.approx(
        flerm["plain"]["blocks.1.linear.weight"], rel=1e-6
    )
    with pytest.raises(ValueError, match="lacks"):
        execute(task, config, RunSpec("standard", 1.0, 0.01, 0), lr_factors={"nope": 2.0})
    with pytest.raises(ValueError, match="standard training only"):
        execute(task, config, RunSpec("flerm", 8.0, 0.01, 0), plain, lr_factors=hidden)
