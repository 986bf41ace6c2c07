"""``with_fslr(..., estimator="exact")``: the wrapper, its Recorder and FLeRM driven by FSLRs
measured by forward-mode AD instead of estimated from omega samples (issue 23: "driving FLeRM
from exact FSLRs at its set points, an option in any case: bias-free")."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import fslr_func as ff
from fslr_func.probe.sampling import probe
from fslr_func.training.wrapper import FSLRModule


def _net(width: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 3)
    )


def _batches(seed: int, rows: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 4, generator=g) for _ in range(4)]


def _unit_update(model: torch.nn.Module, before: dict, lr: float) -> dict[str, torch.Tensor]:
    return {n: (p.detach() - before[n]) / lr for n, p in model.named_parameters()}


def _measured_once(**options: object) -> ff.FSLRModule:
    """An exact wrapper of a fresh ``_net(8)`` after one measured SGD step."""
    model = _net(8)
    fm = ff.with_fslr(model, estimator="exact", seed=0, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).square().mean().backward()
    with fm.measure(opt, torch.randn(5, 4)):
        opt.step()
    return fm


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_each_measured_step_folds_the_exact_fslr_of_its_update(beta: float) -> None:
    model = _net(16)
    fm = ff.with_fslr(model, estimator="exact", beta=beta, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    probe_batch = torch.randn(6, 4)
    squares = []
    for x in _batches(1)[:2]:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        model(x).square().mean().backward()
        with fm.measure(opt, probe_batch) as m:
            opt.step()
        delta = _unit_update(model, before, 1e-2)
        squares.append(
            {n: v**2 for n, v in ff.exact(model, probe_batch, delta, params=before).items()}
        )
    for name, got in m.fslr.items():
        # the bias-corrected EMA of ||J dW||^2 over the two steps
        want = math.sqrt((beta * squares[0][name] + squares[1][name]) / (1 + beta))
        assert float(got) == pytest.approx(want, rel=1e-12), name


@pytest.mark.filterwarnings("ignore:probe_batches ran out")
def test_a_recorder_and_flerm_on_exact_fslrs_match_movement_under_bf16_a_scaler_and_fused_adamw():
    base_model, probes = _net(8), _batches(2)[:1] * 4  # one batch: each EMA is its value
    fm = ff.with_fslr(base_model, estimator="exact", seed=0)
    opt = torch.optim.AdamW(base_model.parameters(), lr=1e-2, fused=True)
    recorder = ff.Recorder(fm, probes, optimizer=opt, every=2)
    scaler = torch.amp.GradScaler("cpu")

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step, steps: int) -> None:
        for x in _batches(3)[:steps]:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            with step():
                scaler.step(opt)
            scaler.update()

    train(base_model, opt, recorder.step, 4)
    record = recorder.record
    assert record.meta["estimator"] == "exact" and record.steps == [0, 2]

    wide = _net(64)
    before = {n: p.detach().clone() for n, p in wide.named_parameters()}
    wide_opt = torch.optim.AdamW(wide.parameters(), lr=1e-2, fused=True)
    flerm = ff.FLeRM(
        ff.with_fslr(wide, estimator="exact", seed=0), wide_opt, record, probe_batches=probes
    )
    train(wide, wide_opt, flerm.step, 1)
    # the first update, FLeRM's rate included, moves each tensor's output exactly as far as
    # the base's first update (its unit-rate FSLR times its rate) moved its tensor's
    moved = {n: p.detach() - before[n] for n, p in wide.named_parameters()}
    exact = ff.exact(wide, probes[0], moved, params=before)
    for name, value in exact.items():
        assert float(value) == pytest.approx(1e-2 * record.fslr[name][0], rel=1e-6), name

    kron = ff.with_fslr(_net(64), seed=0)
    with pytest.raises(ValueError, match="estimator 'exact'"):
        ff.FLeRM(kron, torch.optim.AdamW(kron.parameters()), record, probe_batches=probes)


def test_a_probe_batch_with_nan_is_left_out_of_a_training_run_and_refused_by_observe():
    model = _net(8)
    fm = ff.with_fslr(model, estimator="exact", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good, bad = torch.randn(5, 4), torch.full((5, 4), math.nan)
    for batch in (good, bad):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        with fm.measure(opt, batch):
            opt.step()
    counts = {n: int(c) for n, c in fm.ema.counts.items()}
    assert counts == dict.fromkeys(counts, 1) and len(counts) == 4  # the NaN probe left out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert set(fm.fslr()) == set(counts)
    assert any("left out" in str(w.message) for w in caught)
    delta = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="NaN"):
        fm.observe(bad, delta)


def test_a_tensor_the_step_left_unchanged_is_not_measured():
    model = _net(8)
    fm = ff.with_fslr(model, estimator="exact", seed=0)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)  # the readout never moves
    opt.zero_grad()
    model(torch.randn(8, 4)).square().mean().backward()
    with fm.measure(opt, torch.randn(5, 4)) as m:
        opt.step()
    assert set(m.fslr) == {"0.weight", "0.bias"}


def test_the_readout_is_found_for_feature_matching():
    assert _measured_once().readout_roles == {"2.weight": "weight", "2.bias": "bias"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "0" does not compute the output: its roles warn
        assert _measured_once(readout="0").readout_roles == {}


def test_exact_resumes_from_the_wrapper_state():
    fm = _measured_once()
    copy = ff.with_fslr(_net(8, seed=1), estimator="exact", seed=0)
    copy.load_state_dict(fm.state_dict())
    assert {n: float(v) for n, v in copy.fslr().items()} == {
        n: float(v) for n, v in fm.fslr().items()
    }


def test_exact_is_one_process_and_not_a_probe_results_estimator():
    model, x = _net(8), torch.randn(5, 4)
    delta = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="reduces sampled statistics over processes"):
        FSLRModule(model, estimator="exact", reduction=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not computed from a probe's omega samples"):
        probe(model, x, delta, samples=2).fslr("exact")
    assert ff.estimate(model, x, delta, estimator="exact") == ff.exact(model, x, delta)
    with pytest.raises(ValueError, match="unknown estimator 'exakt'"):
        ff.with_fslr(model, estimator="exakt")  # type: ignore[arg-type]


def test_a_tensor_whose_16_bit_update_rounds_away_reads_unknown_beside_measured_ones():
    # before, such a tensor had no EMA entry at all, and reading the step raised a KeyError
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
    fm = ff.with_fslr(model, estimator="exact", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # LayerNorm's 1.0 + 1e-3 rounds to 1.0
    model(torch.randn(8, 4, dtype=torch.bfloat16)).float().square().mean().backward()
    with fm.measure(opt, torch.randn(5, 4, dtype=torch.bfloat16)) as m:
        opt.step()
    assert "1.weight" in m.rounded_away and set(m.fslr) == {"0.weight", "0.bias", "1.bias"}


class _ScalesItsInput(torch.nn.Module):
    """Preprocesses its input in place, as ``x.div_(255)`` does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return self.b(torch.tanh(self.a(x)))


def test_finding_the_readout_leaves_the_probe_batch_as_it_was():
    # the readout search ran the model on the user's batch: an in-place preprocessing
    # forward changed it, and the probe measured another input (44% off)
    model, batch = _ScalesItsInput(), torch.randn(6, 4)
    original = batch.clone()
    fm = ff.with_fslr(model, estimator="exact", beta=0.0, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(8, 4)).square().mean().backward()
    with fm.measure(opt, batch) as m:
        opt.step()
    assert torch.equal(batch, original)
    want = ff.exact(model, original, _unit_update(model, before, 0.1), params=before)
    assert {n: float(v) for n, v in m.fslr.items()} == pytest.approx(
        {n: float(v) for n, v in want.items()}, rel=1e-12
    )


def test_a_step_that_moves_nothing_measures_nothing():
    # a GradScaler-skipped step left every tensor unchanged: exact was called on an empty
    # update and raised "delta is empty"
    model = _net(8)
    fm = ff.with_fslr(model, estimator="exact", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fm.measure(opt, torch.randn(5, 4)) as m:
        pass  # the scaler found an Inf gradient: no step
    assert m.moved == () and fm.ema.counts == dict.fromkeys(fm.ema.counts, 0)


def test_after_a_reset_the_readout_is_looked_for_again():
    fm = ff.with_fslr(_net(8), estimator="exact", seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    for _ in range(2):
        fm(torch.randn(8, 4)).square().mean().backward()
        with fm.measure(opt, torch.randn(5, 4)):
            opt.step()
        assert fm.readout_roles == {"2.weight": "weight", "2.bias": "bias"}
        fm.reset()


def test_an_infinite_probe_input_is_left_out_without_a_second_pass():
    # the non-finite tangent was taken for a forward-mode overflow: a misleading warning and a
    # double-vjp pass per tensor for values then left out
    fresh = type("InfProbeNet", (torch.nn.Sequential,), {})  # its own warn-once state
    for final in (torch.nn.Tanh(), torch.nn.Identity()):  # the output finite, then not
        torch.manual_seed(0)
        model = fresh(torch.nn.Linear(4, 8), final, torch.nn.Linear(8, 3))
        fm = ff.with_fslr(model, estimator="exact", seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        bad = torch.randn(6, 4)
        bad[0, 0] = math.inf
        model(torch.randn(8, 4)).square().mean().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fm.measure(opt, bad):
                opt.step()
            read = set(fm.fslr())
        # tanh keeps the output finite: the readout's tensors are measured, the input
        # layer's weight, which the Inf reaches, is left out
        finite_output = isinstance(final, torch.nn.Tanh)
        assert read >= {"2.weight", "2.bias"} if finite_output else read == set()
        assert "0.weight" not in read
        assert not any("forward-mode AD overflowed" in str(w.message) for w in caught)
        assert any("left out" in str(w.message) for w in caught)


def test_exact_state_is_not_loaded_into_a_sampled_wrapper_even_without_strict():
    # strict=False carried the exact averages over, which kron then read as FSLR squared
    fm = _measured_once()
    kron = ff.with_fslr(_net(8), seed=0)
    with pytest.raises(ValueError, match="saved with estimator 'exact' and this wrapper uses"):
        kron.load_state_dict(fm.state_dict(), strict=False)


def test_the_grouping_does_not_matter_to_exact_records():
    # exact values do not depend on the Kronecker grouping: FLeRM and FSLRRecord.mean
    # refused records of another grouping as "different quantities"
    def record(grouping: str) -> ff.FSLRRecord:
        model = _net(8)
        fm = ff.with_fslr(model, estimator="exact", seed=0, grouping=grouping)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        recorder = ff.Recorder(fm, _batches(4), optimizer=opt, every=1, warmup_samples=8)
        for x in _batches(5)[:2]:
            opt.zero_grad()
            model(x).square().mean().backward()
            with recorder.step():
                opt.step()
        return recorder.record

    auto, dims = record("auto"), record("dims")
    assert ff.FSLRRecord.mean([auto, dims]).fslr == auto.fslr == dims.fslr
    wide = ff.with_fslr(_net(32), estimator="exact", seed=0, grouping="auto")
    ff.FLeRM(wide, torch.optim.SGD(wide.parameters(), lr=0.1), dims, probe_batches=_batches(4))


def test_distributed_exact_is_refused_before_a_process_group_is_needed():
    # with_fslr(distributed=True) asked for an initialised process group first
    with pytest.raises(ValueError, match="estimator='exact' measures each process's own"):
        ff.with_fslr(_net(8), estimator="exact", distributed=True)
