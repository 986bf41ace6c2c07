"""``with_fslr``: transparency, unit-learning-rate updates, EMAs and checkpoints."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import MLP, ResMLP
from torch import nn

import fslr_func as ff


def train_step(fm, opt, x, y, probe_x=None):
    opt.zero_grad()
    nn.functional.cross_entropy(fm(x), y).backward()
    if probe_x is None:
        opt.step()
        return None
    with fm.measure(opt, probe_x) as m:
        opt.step()
    return m


def data(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def test_forward_is_the_models_and_parameters_are_shared():
    model = ResMLP()
    fm = ff.with_fslr(model)
    x, _ = data()
    assert torch.equal(fm(x), model(x))
    assert [p for p in fm.parameters()] == [p for p in model.parameters()]
    assert fm.module is model


def test_measure_uses_unit_lr_updates_for_any_param_group_layout(double):
    torch.manual_seed(0)
    model = ResMLP()
    fm = ff.with_fslr(model, samples=4, seed=0)
    opt = torch.optim.SGD(
        [
            {"params": [model.input.weight, model.input.bias], "lr": 0.1},
            {"params": list(model.blocks.parameters()), "lr": 0.01},
            {"params": list(model.readout.parameters()), "lr": 0.5},
        ],
        lr=1.0,
    )
    x, y = data()
    probe_x, _ = data(1)
    m = train_step(fm, opt, x, y, probe_x)
    # SGD's unit-rate update is minus the gradient, whatever the group's rate.
    for n, p in model.named_parameters():
        torch.testing.assert_close(m.delta[n], -p.grad, rtol=1e-10, atol=1e-12)
    assert m.lrs["blocks.0.weight"] == 0.01 and m.lrs["readout.bias"] == 0.5
    # The probe ran at the pre-update weights: it equals a one-shot estimate there.
    expected = ff.estimate(
        model,
        probe_x,
        m.delta,
        samples=4,
        params=m.before,
        generator=torch.Generator().manual_seed(0),
    )
    for n in expected:
        torch.testing.assert_close(m.fslr[n], expected[n], rtol=1e-10, atol=0)


def test_probe_does_not_mutate_the_module_or_its_gradients():
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    fm = ff.with_fslr(model, samples=2)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    x, y = data()
    opt.zero_grad()
    nn.functional.cross_entropy(fm(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with fm.measure(opt, data(1)[0]):
        opt.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    fm.observe(data(2)[0], {n: torch.ones_like(p) for n, p in model.named_parameters()})
    for n, p in model.named_parameters():
        assert torch.equal(p, after[n]) and torch.equal(p.grad, grads[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n


def test_ema_accumulates_and_a_list_of_batches_warms_it_up():
    torch.manual_seed(0)
    model = MLP(d_in=6, d_out=4)
    fm = ff.with_fslr(model, samples=2, seed=0)
    delta = {n: 1e-2 * torch.ones_like(p) for n, p in model.named_parameters()}
    fm.observe([data(i)[0] for i in range(5)], delta)
    assert {int(c) for c in fm.ema.counts.values()} == {5}  # every tensor folded in 5 probes
    assert all(torch.isfinite(v) and v > 0 for v in fm.fslr().values())


def test_state_dict_round_trip_restores_emas_and_the_omega_stream():
    torch.manual_seed(0)
    make = lambda: ff.with_fslr(ResMLP(), samples=3, seed=1)  # noqa: E731
    fm = make()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    for i in range(3):
        train_step(fm, opt, *data(i), probe_x=data(10 + i)[0])
    buffer = io.BytesIO()
    torch.save(fm.state_dict(), buffer)
    buffer.seek(0)
    other = make()
    other.load_state_dict(torch.load(buffer, weights_only=False))
    for n, v in fm.fslr().items():
        torch.testing.assert_close(other.fslr()[n], v, rtol=0, atol=0)
    assert other.readout_roles == fm.readout_roles
    # The next probe draws the same omegas in both.
    delta = {n: torch.ones_like(p) for n, p in fm.module.named_parameters()}
    a, b = fm.observe(data(5)[0], delta), other.observe(data(5)[0], delta)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0)


@pytest.mark.parametrize("outer", ["", "inner."])
def test_load_state_dict_names_missing_and_unexpected_keys_as_the_bare_model_does(outer):
    # they came back with the wrapper's "module." prefix, a key the user never passed
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    fm = ff.with_fslr(model, seed=0)
    target = nn.ModuleDict({"inner": fm}) if outer else fm
    state = {outer + k: v for k, v in model.state_dict().items() if k != "2.bias"}
    state[outer + "junk"] = torch.zeros(1)
    keys = target.load_state_dict(state, strict=False)
    assert keys.missing_keys == [outer + "2.bias"]
    assert keys.unexpected_keys == [outer + "junk"]
    with pytest.raises(RuntimeError, match=rf'Missing key\(s\) in state_dict: "{outer}2\.bias"'):
        target.load_state_dict(state)


def test_readout_detection_in_the_wrapper_and_switching_it_off():
    torch.manual_seed(0)
    delta = {n: torch.ones_like(p) for n, p in ResMLP().named_parameters()}
    fm = ff.with_fslr(ResMLP(), samples=2)
    fm.observe(data()[0], delta)
    assert fm.readout_roles == {"readout.weight": "weight", "readout.bias": "bias"}
    off = ff.with_fslr(ResMLP(), samples=2, readout=None)
    off.observe(data()[0], delta)
    assert off.readout_roles == {}


def test_wrapper_errors_are_clear():
    with pytest.raises(ValueError, match="no trainable parameters"):
        ff.with_fslr(nn.ReLU())
    with pytest.raises(ValueError, match="unknown estimator"):
        ff.with_fslr(MLP(), estimator="kfac")
    with pytest.raises(ValueError, match="unknown omega"):
        ff.with_fslr(MLP(), omega="sphere")
    fm = ff.with_fslr(MLP())
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"fm\.parameters"), fm.measure(other, torch.randn(2, 5)):
        pass


def test_the_wrapper_reuses_and_checkpoints_the_strategy_timing_chose():
    torch.manual_seed(0)
    fm = ff.with_fslr(ResMLP(), samples=3, seed=0, strategy="timed")
    assert fm.resolved_strategy == "timed"
    delta = {n: torch.ones_like(p) for n, p in fm.module.named_parameters()}
    fm.observe(data()[0], delta)
    assert fm.resolved_strategy in ("vmap", "loop")
    other = ff.with_fslr(ResMLP(), samples=3, seed=0, strategy="timed")
    other.load_state_dict(fm.state_dict())
    assert other.resolved_strategy == fm.resolved_strategy
    pinned = ff.with_fslr(ResMLP(), samples=3, strategy="loop")
    pinned.observe(data()[0], delta)
    assert pinned.resolved_strategy == "loop"


def test_a_warm_up_from_zero_skips_the_first_measurement_instead_of_stopping_the_run():
    # Hugging Face's linear warm-up starts at lr 0: the README's loop, fm.measure around
    # every step, raised "every learning rate is 0" at step 0 and stopped the run.
    torch.manual_seed(0)
    fm = ff.with_fslr(MLP(), samples=2, seed=0)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: t / 3)
    before = {n: p.detach().clone() for n, p in fm.module.named_parameters()}
    for t in range(2):
        opt.zero_grad()
        fm(torch.randn(8, 5)).square().mean().backward()
        if t == 0:
            warm_up = pytest.warns(RuntimeWarning, match="warm-up from 0")
            with warm_up, fm.measure(opt, torch.randn(8, 5)) as m:
                opt.step()
            assert m.moved == () and m.fslr == {} and fm.fslr() == {}
            for n, p in fm.module.named_parameters():  # the step ran at rate 0
                assert torch.equal(p, before[n])
        else:
            with fm.measure(opt, torch.randn(8, 5)) as m:
                opt.step()
            assert set(m.fslr) == set(before) and all(v > 0 for v in m.fslr.values())
        sched.step()
    no_scheduler = torch.optim.SGD(fm.parameters(), lr=0.0)  # rate 0 for good: an error
    with (
        pytest.raises(ValueError, match="every learning rate is 0"),
        fm.measure(no_scheduler, torch.randn(8, 5)),
    ):
        pass


def test_a_wrapper_is_not_wrapped_again() -> None:
    """Was: with_fslr(with_fslr(net)) nested silently, its tensors named 'module.module.*'."""
    fm = ff.with_fslr(nn.Linear(3, 2))
    for again in (fm, torch.compile(fm)):
        with pytest.raises(TypeError, match=r"with_fslr wrapper already.*fm\.module"):
            ff.with_fslr(again)
    assert [n for n, _ in ff.with_fslr(fm.module).named_parameters()] == [
        "module.weight",
        "module.bias",
    ]


def test_the_batched_change_flags_and_updates_match_the_per_tensor_ones() -> None:
    """after_step's multi-tensor paths (small updates' change flags by one 1-norm, the
    unit-rate updates by foreach copy/sub/div) agree with the per-tensor ones: a NaN, a
    subnormal or a lone negative entry is a change, signed zeros are not; updates bit for bit."""
    import math

    from fslr_func.training.measurement import _changed, _changed_all
    from fslr_func.training.update_scaling import Snapshots

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        deltas = {
            f"a{i}": (torch.randn(1 + i, generator=g) * (i % 3 != 0)).to(dtype) for i in range(12)
        }
        deltas["big"] = torch.zeros(20000, dtype=dtype)
        deltas["big_negative"] = torch.zeros(20000, dtype=dtype)
        deltas["big_negative"][5] = -1.0
        special = {"nan": [0.0, math.nan], "zeros": [0.0, -0.0], "tiny": [0.0, -1e-45]}
        deltas.update({n: torch.tensor(v).to(dtype) for n, v in special.items()})
        deltas["inf"] = torch.tensor([-math.inf, 0.0]).to(dtype)
        got = _changed_all(deltas)
        assert list(got) == list(deltas)
        for n, d in deltas.items():
            want = _changed(d)
            assert got[n].dtype == want.dtype and bool(got[n]) == bool(want), (dtype, n)
    after = {f"w{i}": torch.randn(33, 17, generator=g) for i in range(6)}
    before = {n: v + 1e-3 * torch.randn(v.shape, generator=g) for n, v in after.items()}
    rates = {n: 1e-3 * (1 + i) for i, n in enumerate(after)}
    updates = Snapshots().differences(after, before, rates)
    for n in after:
        assert torch.equal(updates[n], torch.sub(after[n], before[n]).div_(rates[n]))


def test_a_measurement_read_after_later_steps_gives_its_own_step_estimates() -> None:
    """Measurement.log_sq is computed when first read, from the EMA as it stood at the end of
    its step: read after later steps, it is what fm.log_sq() was then, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fm = ff.with_fslr(model, samples=4, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    kept = []
    for _ in range(3):
        fm.zero_grad()
        fm(x).square().sum().backward()
        with fm.measure(opt, x) as m:
            opt.step()
        kept.append((m, fm.log_sq()))
    for m, then in kept:
        assert dict(m.log_sq).keys() == then.keys()
        assert all(torch.equal(m.log_sq[n], then[n]) for n in then)
        assert m.fslr.keys() == then.keys()
