"""FLeRM matching feature movement (``match="features"``) and the feature gains it reads."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import fslr_func as ff
from fslr_func.io.record import FSLRRecord
from fslr_func.training.feature_gains import (
    NoReadoutError,
    SubmoduleTensor,
    feature_gains,
    hidden_fan_in,
)

D_IN, CLASSES, STEPS = 5, 3, 4


def _net(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D_IN, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, CLASSES),
    )  # fmt: skip


def test_a_feature_gain_is_the_output_movement_over_the_readout_inputs():
    """By hand for a linear map into a linear readout: ``J_h dW = dW x``, ``J_f dW = R dW x``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    x = torch.randn(10, 4)
    delta = {"0.weight": torch.randn(6, 4), "1.weight": torch.randn(2, 6)}
    gains = feature_gains(net, x, delta, readout="1")
    moved = x @ delta["0.weight"].T  # (10, 6): the features' change
    rms = lambda t: t.double().square().mean().sqrt()  # noqa: E731
    want = float(rms(moved @ net[1].weight.detach().T) / rms(moved))
    assert set(gains) == {"0.weight"}  # the readout's own update moves no features
    assert math.isclose(gains["0.weight"], want, rel_tol=1e-6)


class _Pair(nn.Module):
    def forward(self, x):
        return x, x


def test_a_submodules_input_or_output_is_caught_or_refused_by_name():
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(3, 4)
    hidden = torch.tanh(net[0](x))
    assert torch.equal(SubmoduleTensor(net, "2")(x), hidden)  # the readout's input
    assert torch.equal(SubmoduleTensor(net, "1", output=True)(x), hidden)  # tanh's output
    pair = nn.Sequential(nn.Linear(4, 4), _Pair())
    with pytest.raises(NoReadoutError, match="'1' did not return a tensor"):
        SubmoduleTensor(pair, "1", output=True)(x)
    unused = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    unused.forward = lambda x: unused["a"](x)  # "b" is never called
    with pytest.raises(NoReadoutError, match="'b' was not called with a tensor input"):
        SubmoduleTensor(unused, "b")(x)


def test_hidden_tensors_are_those_wider_in_both_dims():
    small, big = _net(4), _net(16)
    shapes = {n: tuple(p.shape) for n, p in big.named_parameters()}
    base = {n: tuple(p.shape) for n, p in small.named_parameters()}
    assert hidden_fan_in(shapes, base) == {"2.weight": 4.0}


def _train(width: int, controller, *, seed: int = 1) -> None:
    """A few bf16-autocast steps under a GradScaler with a fused AdamW (the optimiser is
    the controller's)."""
    fm, opt, make = controller
    ctl = make(fm, opt)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(32, D_IN, generator=data)
        y = torch.randint(0, CLASSES, (32,), generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(fm(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        with ctl.step():
            scaler.step(opt)
        scaler.update()
    return ctl


def _setup(width: int):
    fm = ff.with_fslr(_net(width), samples=4, seed=0, strategy="loop")
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2, fused=True)
    probes = (torch.randn(32, D_IN, generator=torch.Generator().manual_seed(9)) for _ in range(99))
    return fm, opt, probes


def _base(feature_gains: bool = True) -> FSLRRecord:
    fm, opt, probes = _setup(4)
    rec = _train(
        4,
        (fm, opt, lambda f, o: ff.Recorder(
            f, probes, optimizer=o, warmup_samples=4, every=2, feature_gains=feature_gains
        )),
    )  # fmt: skip
    return rec.record


def _flerm(base: FSLRRecord, match: str, **kw: float) -> ff.FLeRM:
    fm, opt, probes = _setup(16)
    return _train(
        16,
        (fm, opt, lambda f, o: ff.FLeRM(
            f, o, base, probe_batches=probes, warmup_samples=4, match=match, **kw
        )),
    )  # fmt: skip


def test_flerm_matching_features_rescales_the_hidden_tensors_only_by_the_gains_ratio(tmp_path):
    base = _base()
    gains = base.meta["feature_gain"]
    assert set(gains) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # all but the readout
    assert all(0 < g < math.inf for g in gains.values())
    path = tmp_path / "base.json"
    base.save(path)
    base = FSLRRecord.load(path)  # the gains survive the file
    output, features = _flerm(base, "output"), _flerm(base, "features")
    assert output.feature_factors is None and set(features.feature_factors) == {"2.weight"}
    factor = features.feature_factors["2.weight"]
    assert factor > 0 and math.isfinite(factor) and not math.isclose(factor, 1.0, rel_tol=1e-3)
    for name, r in output.ratios.items():  # same set point, same measured FSLRs
        want = r * (factor if name == "2.weight" else 1.0)
        assert math.isclose(features.ratios[name], want, rel_tol=1e-6), name
    # feature_power raises the factor (the gains' ratio) to its power
    powered = _flerm(base, "features", feature_power=1.5).feature_factors["2.weight"]
    assert math.isclose(powered, factor**1.5, rel_tol=1e-9)
    # exact resume keeps the factors measured once
    fm, opt, probes = _setup(16)
    again = ff.FLeRM(fm, opt, base, probe_batches=probes, warmup_samples=4, match="features")
    again.load_state_dict(features.state_dict())
    assert again.feature_factors == features.feature_factors and again.ratios == features.ratios


def test_features_all_rescales_every_tensor_upstream_of_the_readout_by_its_gains_ratio():
    base = _base()  # bf16 autocast, GradScaler, fused AdamW, as _train runs
    output, hidden, every = (_flerm(base, m) for m in ("output", "features", "features_all"))
    factors = every.feature_factors
    assert set(factors) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # not the readout's
    assert factors["2.weight"] == pytest.approx(hidden.feature_factors["2.weight"], rel=1e-6)
    for name, r in output.ratios.items():
        assert every.ratios[name] == pytest.approx(r * factors.get(name, 1.0), rel=1e-6), name
    fm, opt, probes = _setup(16)  # exact resume keeps them
    options = {"probe_batches": probes, "warmup_samples": 4}
    again = ff.FLeRM(fm, opt, base, match="features_all", **options)
    again.load_state_dict(every.state_dict())
    assert again.feature_factors == factors and again.ratios == every.ratios
    with pytest.raises(ValueError, match="match='features_all'"):  # another matching: refused
        ff.FLeRM(fm, opt, base, match="features", **options).load_state_dict(every.state_dict())


class _Blocks(nn.Module):
    """A residual MLP whose blocks ``share_blocks`` maps: ``inp``, ``blocks.<i>``, ``head``."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D_IN, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _blocks_setup(width: int, depth: int):
    fm = ff.with_fslr(_Blocks(width, depth), samples=4, seed=0, strategy="loop")
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2, fused=True)
    probes = (torch.randn(32, D_IN, generator=torch.Generator().manual_seed(9)) for _ in range(99))
    return fm, opt, probes


def _blocks_base(depth: int) -> FSLRRecord:
    fm, opt, probes = _blocks_setup(4, depth)
    make = lambda f, o: ff.Recorder(  # noqa: E731
        f, probes, optimizer=o, warmup_samples=4, every=2, feature_gains=True
    )
    return _train(4, (fm, opt, make)).record


@pytest.mark.parametrize(("base_depth", "depth"), [(2, 4), (4, 2)])
def test_features_all_compares_each_block_with_the_base_block_it_answers_to(base_depth, depth):
    """Width and depth together (bf16 autocast, GradScaler, fused AdamW): under
    ``share_blocks`` a scaled block's feature gain is compared with the base block its target
    answers to (4 blocks from 2: 0, 0, 1, 1; 2 from 4: the geometric mean of two), never
    with the base block of its own index; a policy that names no counterparts warns."""
    base = _blocks_base(base_depth)
    recorded = base.meta["feature_gain"]
    fm, opt, probes = _blocks_setup(16, depth)
    options = {"probe_batches": probes, "warmup_samples": 4, "policy": "share_blocks"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor has a counterpart: silent
        flerm = ff.FLeRM(fm, opt, base, match="features_all", **options)
    for i in range(depth):
        answers = [m for m in range(base_depth) if (i * base_depth // depth == m or
                   m * depth // base_depth == i)]  # fmt: skip
        for kind in ("weight", "bias"):
            logs = [math.log(recorded[f"blocks.{m}.{kind}"]) for m in answers]
            want = math.exp(sum(logs) / len(logs))
            assert flerm.base_gains[f"blocks.{i}.{kind}"] == pytest.approx(want, rel=1e-12)
    assert "head.weight" not in flerm.base_gains  # the readout's own: output-matched
    flerm = _train(16, (fm, opt, lambda f, o: ff.FLeRM(f, o, base, match="features_all",
                                                        **options)))  # fmt: skip
    blocks = {f"blocks.{i}.{k}" for i in range(depth) for k in ("weight", "bias")}
    assert set(flerm.feature_factors) == blocks | {"inp.weight", "inp.bias"}
    assert all(0 < f < math.inf for f in flerm.feature_factors.values())
    share = ff.training.policies.share_blocks()
    opaque = lambda b, s: share(b, s)  # noqa: E731  (a custom policy: no counterparts)
    fm, opt, probes = _blocks_setup(16, depth)
    options = {**options, "probe_batches": probes, "policy": opaque}
    if depth > base_depth:
        with pytest.warns(RuntimeWarning, match=r"no counterpart for them"):
            ff.FLeRM(fm, opt, base, match="features_all", **options)


def test_matching_features_needs_the_base_gains_and_a_known_mode():
    fm, opt, probes = _setup(16)
    plain = _base(feature_gains=False)
    with pytest.raises(ValueError, match=r"Recorder\(\.\.\., feature_gains=True\)"):
        ff.FLeRM(fm, opt, plain, probe_batches=probes, match="features")
    with pytest.raises(ValueError, match="match must be"):
        ff.FLeRM(fm, opt, plain, probe_batches=probes, match="feature")  # type: ignore[arg-type]
    bad = FSLRRecord.from_dict({**plain.to_dict(), "meta": {**plain.meta, "feature_gain": {
        "2.weight": -2.0}}})  # fmt: skip
    with pytest.raises(ValueError, match="not finite numbers > 0"):
        ff.FLeRM(fm, opt, bad, probe_batches=probes, match="features")
    for power in (0.0, -1.0, math.nan, math.inf, True, "1.5"):
        with pytest.raises(ValueError, match="feature_power must be a finite number > 0"):
            ff.FLeRM(fm, opt, plain, probe_batches=probes, feature_power=power)  # type: ignore[arg-type]


def test_a_seed_mean_keeps_the_geometric_mean_of_the_gains():
    a = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"seed": 0, "feature_gain": {"w": 2.0}})
    b = FSLRRecord(steps=[0], fslr={"w": [3.0]}, meta={"seed": 1, "feature_gain": {"w": 8.0}})
    assert FSLRRecord.mean([a, b]).meta["feature_gain"] == {"w": 4.0}


@pytest.mark.parametrize("frozen", ["0", "4"])
def test_gains_of_a_model_with_frozen_tensors_leave_them_out(frozen):
    # a frozen input layer (a fine-tune, LoRA's base weights) made the gains' exact refuse
    # "params names tensors that are not trainable"; a frozen readout was not found at all,
    # even when named (the probe's readout roles only know trainable tensors)
    net = _net(8)
    net.get_submodule(frozen).requires_grad_(False)
    fm = ff.with_fslr(net, samples=2, seed=0, readout="4")
    opt = torch.optim.Adam([p for p in fm.parameters() if p.requires_grad], lr=1e-2)
    probes = (torch.randn(16, D_IN, generator=torch.Generator().manual_seed(k)) for k in range(9))
    rec = ff.Recorder(fm, probes, optimizer=opt, warmup_samples=2, feature_gains=True)
    nn.functional.cross_entropy(fm(torch.randn(16, D_IN)), torch.zeros(16).long()).backward()
    with rec.step():
        opt.step()
    gains = rec.record.meta["feature_gain"]
    trainable_before_readout = {
        n for n, p in net.named_parameters() if p.requires_grad and not n.startswith("4.")
    }
    assert set(gains) == trainable_before_readout
    assert all(math.isfinite(g) and g > 0 for g in gains.values())


def test_a_huge_feature_power_holds_the_tensor_instead_of_overflowing():
    """(gain ratio) ** 1000 overflows a float: the set point used to raise OverflowError in
    the middle of training, and a large finite factor skipped the dtype's rate limit."""
    base = _base()
    with pytest.warns(RuntimeWarning, match=r"too large for the parameter's dtype.*2\.weight"):
        flerm = _flerm(base, "features", feature_power=1000.0)
    factor = flerm.feature_factors["2.weight"]
    assert not 1e-30 < factor < 1e30  # the gains' ratio ** 1000
    lrs = flerm.lrs()
    assert all(math.isfinite(lr) and lr > 0 for lr in lrs.values())
    assert "2.weight" in flerm.history[0].held
    assert "2.weight" not in flerm.ratios and lrs["2.weight"] == 1e-2  # its group's rate
    # its state loads back: a factor of 0 or inf is one the rule makes (it was refused as
    # "damaged" by the state check)
    fm, opt, probes = _setup(16)
    again = ff.FLeRM(
        fm, opt, base, probe_batches=probes, warmup_samples=4, match="features",
        feature_power=1000.0,
    )  # fmt: skip
    again.load_state_dict(flerm.state_dict())
    assert again.feature_factors == flerm.feature_factors


def test_matching_features_refuses_a_wrapper_without_readout_at_construction():
    """Both failed at the first probe, after optimizer.step(), with NoReadoutError."""
    fm = ff.with_fslr(_net(16), samples=4, seed=0, readout=None)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"Recorder\(\.\.\., feature_gains=True\) measures"):
        ff.Recorder(fm, iter([]), optimizer=opt, feature_gains=True)
    with pytest.raises(ValueError, match=r"readout=None: wrap with with_fslr\(\.\.\., readout="):
        ff.FLeRM(fm, opt, _base(), probe_batches=iter([]), match="features")


def test_matching_features_warns_where_no_tensor_is_hidden():
    base = _base()
    torch.manual_seed(0)
    fm = ff.with_fslr(nn.Sequential(nn.Linear(D_IN, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
                                    nn.Linear(4, 7)), samples=4, seed=0)  # fmt: skip
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2)
    with pytest.warns(RuntimeWarning, match=r"match='features' changes nothing here: \['4\."):
        ff.FLeRM(fm, opt, base, probe_batches=iter([]), match="features")
    fm, opt, _ = _setup(4)  # the base's own shapes: factors of 1 by construction, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ff.FLeRM(fm, opt, base, probe_batches=iter([]), match="features")


def test_an_added_block_is_hidden_by_the_policys_counterpart_under_any_block_pattern() -> None:
    # blocks named layer0, layer1, ... (torchvision's ResNet): the default role pattern does
    # not see layer2 as a block, so a deeper model's added blocks got no feature factor
    from fslr_func.training.feature_gains import hidden_fan_in

    base = {"inp.weight": (16, 8), "layer0.lin.weight": (16, 16), "layer1.lin.weight": (16, 16)}
    shapes = {f"layer{i}.lin.weight": (64, 64) for i in range(4)}
    assert set(hidden_fan_in(shapes, base)) == {"layer0.lin.weight", "layer1.lin.weight"}
    links = {f"layer{i}.lin.weight": (f"layer{i // 2}.lin.weight",) for i in range(4)}
    assert hidden_fan_in(shapes, base, links) == dict.fromkeys(shapes, 4.0)


def test_only_the_readout_training_gives_no_gains_instead_of_an_error() -> None:
    # a linear probe on a frozen backbone: the features' exact raised "the model output does
    # not depend on any of the measured parameters ... remove torch.no_grad()"
    from fslr_func.training.feature_gains import feature_gains

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    net[0].requires_grad_(False)
    delta = {n: 0.1 * torch.ones_like(p) for n, p in net.named_parameters() if p.requires_grad}
    assert feature_gains(net, torch.randn(8, 3), delta, readout="2") == {}


def test_the_gains_of_a_model_with_dropout_follow_the_probes_forward_seed():
    # the gains' forwards drew dropout masks from the global RNG: output and feature movement
    # were measured on different masks, and the measured step advanced the run's RNG
    def gains(global_seed: int) -> tuple[bool, dict]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Tanh(),
            torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Tanh(),
            torch.nn.Linear(16, 3),
        )  # fmt: skip
        fm = ff.with_fslr(model, seed=0, forward_seed=1, samples=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        recorder = ff.Recorder(
            fm, [torch.randn(6, 4)], optimizer=opt, every=1, warmup_samples=4, feature_gains=True
        )
        model(torch.randn(8, 4)).square().mean().backward()
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        with recorder.step():
            opt.step()
        return torch.equal(state, torch.get_rng_state()), recorder.record.meta["feature_gain"]

    (untouched, a), (_, b) = gains(123), gains(456)
    assert untouched and a == b
