"""muP rules of experiments/mup.py against the ``mup`` package (skipped where it is absent:
install it with ``pip install --no-deps mup pyyaml``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fslr_func.experiments.configs import SweepConfig
from fslr_func.experiments.models import ResMLP, Transformer
from fslr_func.experiments.mup import apply_mup, mup_groups, readouts, width_mults
from fslr_func.experiments.summary import format_table
from fslr_func.io.record import FSLRRecord


def _resmlp(width: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = ResMLP(40, 10, width=width, depth=2)
    with torch.no_grad():  # non-zero biases, so their rescaling is tested too
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return model


def _transformer(mult: int, seed: int = 0, norm: str = "prenorm") -> nn.Module:
    torch.manual_seed(seed)
    return Transformer(
        d_model=32, n_heads=2, d_ff=64, depth=2, seq_len=8, width_mult=mult, norm=norm
    )


def _package(model: nn.Module, base: nn.Module) -> nn.Module:
    """The same model made muP with the package: readout -> MuReadout, set_base_shapes."""
    mup = pytest.importorskip("mup")
    model = copy.deepcopy(model)
    old = model.readout
    new = mup.MuReadout(old.in_features, old.out_features)
    new.load_state_dict(old.state_dict())
    model.readout = new
    base = copy.deepcopy(base)
    base.readout = mup.MuReadout(base.readout.in_features, base.readout.out_features)
    mup.set_base_shapes(model, base)
    return model


CASES = [
    (_resmlp, 32, 128, torch.randn(5, 40)),
    (_transformer, 1, 4, torch.randint(0, 256, (2, 8))),
]


@pytest.mark.parametrize(("make", "small", "big", "x"), CASES, ids=["resmlp", "transformer"])
@pytest.mark.parametrize(("name", "wd"), [("adam", 0.0), ("adamw", 0.1), ("sgd", 0.01)])
def test_rates_match_the_package(make, small, big, x, name, wd):
    mup = pytest.importorskip("mup")
    base, model = make(small), make(big)
    ref = _package(model, base)
    impl = {"adam": mup.MuAdam, "adamw": mup.MuAdamW, "sgd": mup.MuSGD}[name]
    opt = impl(ref.parameters(), lr=0.01, weight_decay=wd)
    want = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    names = {n: id(p) for n, p in ref.named_parameters()}
    ours = mup_groups(model, base, 0.01, weight_decay=wd, optimizer=name)
    assert len(ours) == len(names)
    for g in ours:
        assert (g["lr"], g["weight_decay"]) == pytest.approx(want[names[g["name"]]], rel=1e-12)


@pytest.mark.parametrize(("make", "small", "big", "x"), CASES, ids=["resmlp", "transformer"])
def test_init_and_outputs_match_the_package(make, small, big, x):
    base, model = make(small), make(big)
    ref = _package(model, base)
    apply_mup(model, base, 0.01)
    theirs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, theirs[n]), n
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("norm", ["postnorm", "prenormpostmod"])
def test_every_norm_placement_matches_the_package(norm):
    mup = pytest.importorskip("mup")
    base, model = _transformer(1, norm=norm), _transformer(4, norm=norm)
    ref = _package(model, base)
    opt = mup.MuAdam(ref.parameters(), lr=0.01)
    want = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    names = {n: id(p) for n, p in ref.named_parameters()}
    ours = apply_mup(model, base, 0.01)
    assert {g["name"]: g["lr"] for g in ours} == pytest.approx(
        {n: want[i] for n, i in names.items()}, rel=1e-12
    )
    assert min(g["lr"] for g in ours) == pytest.approx(0.01 / 4)  # hidden matrices: lr / m
    x = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    # the placement matters: the same weights under PreNorm give other outputs
    pre = _transformer(4)
    pre.load_state_dict(_transformer(4, norm=norm).state_dict())
    apply_mup(pre, base, 0.01)
    assert not torch.allclose(pre(x), model(x))


def test_base_width_is_unchanged_and_extra_blocks_follow_their_role():
    base, same = _resmlp(32), _resmlp(32)
    x = torch.randn(3, 40)
    before = same(x)
    groups = apply_mup(same, base, 0.5)
    assert {g["lr"] for g in groups} == {0.5}
    torch.testing.assert_close(same(x), before, rtol=0, atol=0)
    deep = ResMLP(40, 10, width=64, depth=4)  # blocks 2 and 3: no base tensor, base role 32
    mults = width_mults(deep, base)
    assert mults["blocks.3.linear.weight"] == mults["blocks.0.linear.weight"] == (2.0, 2.0)
    assert readouts(deep, base) == {"readout": 2.0}
    # a tensor with neither a base tensor nor a role in the base has only finite dimensions
    extra = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
    assert width_mults(extra, {"0.weight": (4, 4), "0.bias": (4,)})["1.weight"] == (None, None)


def test_rejects_unknown_optimiser_and_rank_change():
    with pytest.raises(ValueError, match="muP rules"):
        mup_groups(nn.Linear(4, 4), nn.Linear(2, 2), 0.1, optimizer="lbfgs")
    with pytest.raises(ValueError, match="another rank"):
        width_mults(nn.Linear(4, 4), {"weight": (4,), "bias": (4,)})


def test_a_readout_tied_to_the_embedding_is_a_clear_error():
    # was KeyError('head.weight'): named_parameters() names a tied weight once
    def tied(width: int) -> nn.Module:
        model = nn.Sequential(nn.Embedding(5, width), nn.Linear(width, 5))
        model[1].weight = model[0].weight
        return model

    with pytest.raises(ValueError, match=r"1\.weight is tied to 0\.weight.*shared readout"):
        apply_mup(tied(8), tied(4), 0.01)


# ---------------------------------------------------------------------------------- sweeps


def _tiny_sweep(tmp_path, **kw):
    from tests.experiments.test_sweep import _sweep, tiny_config

    return _sweep(tiny_config(seeds=1, scales=(1, 2), lrs=(0.01,), **kw), tmp_path)


def test_mup_sweep_mode_is_standard_at_the_base_scale(tmp_path):
    result = _tiny_sweep(tmp_path, modes=("standard", "mup"))
    std, mup = (result.runs[f"{m}_scale=1_lr=0.01_seed=0"] for m in ("standard", "mup"))
    assert mup["losses"] == std["losses"] and set(mup["mup"]["lrs"].values()) == {0.01}
    wide = result.runs["mup_scale=2_lr=0.01_seed=0"]["mup"]["lrs"]
    assert wide["blocks.0.weight"] == 0.005 and wide["readout.weight"] == 0.01
    assert "mup best lr" in format_table(result.summary)


def test_flerm_init_mup_trains_flerm_on_mup_initialised_models(tmp_path):
    plain = _tiny_sweep(tmp_path / "plain", modes=("standard", "flerm"))
    mup = _tiny_sweep(tmp_path / "mup", modes=("standard", "flerm"), flerm_init="mup")
    config = SweepConfig(flerm_init="mup")
    assert config.fingerprint() != config.replace(flerm_init="standard").fingerprint()
    key = "flerm_scale={}_lr=0.01_seed=0"
    # the base scale is the task's own model, so FLeRM there is unchanged
    assert mup.runs[key.format(1)]["losses"] == plain.runs[key.format(1)]["losses"]
    # the wide model has muP's readout (multiplier 1/2): another model, other FSLRs and rates
    wide, wide_plain = mup.runs[key.format(2)], plain.runs[key.format(2)]
    assert wide["losses"] != wide_plain["losses"]
    assert wide["flerm"]["lrs"]["readout.weight"] != wide_plain["flerm"]["lrs"]["readout.weight"]


@pytest.mark.parametrize("norm", ["postnorm", "prenormpostmod"])
def test_transformer_sweep_runs_every_mode_for_every_norm(tmp_path, norm):
    from fslr_func.experiments.configs import SweepConfig
    from fslr_func.experiments.sweep import run_sweep

    cfg = SweepConfig.for_model(
        "transformer", width=16, scales=(1, 2), lrs=(0.01,), steps=3, last=1, seeds=1,
        seq_len=8, batch_size=2, samples=2, warmup_samples=2, every=1, norm=norm,
    )  # fmt: skip
    result = run_sweep(cfg, tmp_path, jobs=1, quiet=True)
    assert result.summary["task"] == f"transformer-{norm}/text"
    runs = {m: result.runs[f"{m}_scale=2_lr=0.01_seed=0"] for m in ("standard", "mup", "flerm")}
    assert all(math.isfinite(r["loss"]) for r in runs.values())
    assert runs["mup"]["mup"]["lrs"]["blocks.0.attn.q.weight"] == 0.005
    base = [result.runs[f"{m}_scale=1_lr=0.01_seed=0"]["losses"] for m in ("standard", "mup")]
    assert base[0] == base[1]  # muP is standard training at the base width


@pytest.mark.parametrize(
    ("optimizer", "schedule"),
    [("adamw", "warmup_cosine"), ("sgd", "cosine"), ("signsgd", "constant")],
)
def test_sweep_optimisers_and_schedules(tmp_path, optimizer, schedule):
    result = _tiny_sweep(tmp_path, optimizer=optimizer, schedule=schedule, weight_decay=0.01)
    assert all(r["loss"] is not None for r in result.runs.values())
    rec = FSLRRecord.load(tmp_path / "records" / "lr=0.01_seed=0.json")
    if schedule == "constant":
        assert rec.meta["schedule"] is None and rec.sched[-1] == 1.0
    else:
        assert rec.meta["schedule"] == "LambdaLR" and rec.sched[-1] < 1.0


def test_edge_of_grid_is_flagged():
    from fslr_func.experiments.configs import SweepConfig
    from fslr_func.experiments.run import RunSpec
    from fslr_func.experiments.summary import summarise

    cfg = SweepConfig(scales=(1, 2), lrs=(0.25, 0.5, 1.0), seeds=1, modes=("standard",))
    losses = {(1, 0.25): 2.0, (1, 0.5): 1.0, (1, 1.0): 3.0, (2, 0.25): 1.0, (2, 0.5): 2.0}
    runs = {RunSpec("standard", s, lr, 0).key: {"loss": v} for (s, lr), v in losses.items()}
    summary = summarise(cfg, runs)
    m = summary["modes"]["standard"]
    assert m["edge"] == ["2"] and m["shift_bound"] == "lower" and m["shift_octaves"] == -1.0
    table = format_table(summary)
    assert "0.25 (2^-2)!" in table and "<=-1 octaves" in table and "edge of the grid" in table


def test_train_takes_dict_inputs():
    from fslr_func.experiments.train import train

    class KW(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, *, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    model = KW()
    data = [({"x": torch.randn(4, 3)}, torch.randint(0, 2, (4,)))] * 3
    assert len(train(model, data, torch.optim.SGD(model.parameters(), lr=0.1), 3)) == 3
