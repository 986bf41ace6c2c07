"""The probe and ``estimate``: estimator-level properties (the properties every model case
shares are in ``tests/probe/test_properties.py``)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from conftest import MLP, DictOutput, ResMLP, random_delta
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call

import fslr_func as ff
from fslr_func.probe.sampling import draw_omega, probe


def test_kron_equals_exact_where_the_kronecker_assumption_holds(double):
    # One linear layer, one datum, rank-1 update: Cov(Z_ij, Z_i'j') = u_i^2 d_ii' b_j b_j' / K
    # factorises exactly, so E[kron] -> exact^2. With S samples each of the three means has a
    # relative standard error of about sqrt(2/S) (chi-square); at S = 20000 that is 1%, and
    # the ratio of three such means stays well within 5%.
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    x = torch.randn(1, 6)
    u, v = torch.randn(4, 1), torch.randn(1, 6)
    delta = {"weight": u @ v}
    exact = ff.exact(model, x, delta)["weight"]
    est = ff.estimate(
        model, x, delta, samples=20000, readout=None, generator=torch.Generator().manual_seed(1)
    )["weight"]
    assert float(est) == pytest.approx(float(exact), rel=0.05)


@given(c=st.floats(1e-6, 1e6) | st.floats(-1e6, -1e-6), estimator=st.sampled_from(ff.ESTIMATORS))
def test_homogeneity_fslr_of_c_delta_is_abs_c_times_fslr(c, estimator):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 5)
    delta = random_delta(model)
    scaled = {n: c * d for n, d in delta.items()}
    a = ff.estimate(
        model, x, delta, samples=3, estimator=estimator, generator=torch.Generator().manual_seed(0)
    )
    b = ff.estimate(
        model, x, scaled, samples=3, estimator=estimator, generator=torch.Generator().manual_seed(0)
    )
    for n in delta:
        torch.testing.assert_close(b[n], abs(c) * a[n], rtol=1e-4, atol=0)


def test_rademacher_omega_has_lower_variance_than_gaussian_for_full(double):
    # Gaussian omega: Var[(sum Z)^2] = 2 sigma^4; Rademacher removes the fourth-moment term,
    # which is large when few outputs carry the movement (here one datum, 3 outputs).
    torch.manual_seed(0)
    model, x = MLP(d_out=3), torch.randn(1, 5)
    delta = random_delta(model)
    var = {}
    for kind in ("gaussian", "rademacher"):
        r = probe(
            model, x, delta, samples=3000, omega=kind, generator=torch.Generator().manual_seed(0)
        )
        var[kind] = {n: ls[:, -1].exp().var() for n, ls in r.log_stats.items()}
    for n in delta:
        assert var["rademacher"][n] < 0.8 * var["gaussian"][n], n


def test_readout_variant_equals_its_row_independent_formula(double):
    torch.manual_seed(0)
    model, x = ResMLP(), torch.randn(5, 6)
    delta = random_delta(model)
    r = probe(model, x, delta, samples=6, generator=torch.Generator().manual_seed(0))
    assert r.readout_module == "readout"
    assert r.readout == {"readout.weight": "weight", "readout.bias": "bias"}
    # Rebuild Z for the readout weight by hand: g = J^T omega / sqrt(M).
    params = {n: p.detach() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    zs = []
    for _ in range(6):
        out, vjp_fn = torch.func.vjp(lambda p: functional_call(model, p, (x,)).reshape(-1), params)
        w = draw_omega(out.numel(), "gaussian", g, x.device, x.dtype)
        zs.append(vjp_fn(w / math.sqrt(out.numel()))[0]["readout.weight"] * delta["readout.weight"])
    expected = torch.stack([z.sum(1).square().sum() for z in zs]).mean().sqrt()
    est = ff.estimate(model, x, delta, samples=6, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(est["readout.weight"], expected, rtol=1e-10, atol=0)
    # Switching the readout off gives the tensor-normal estimator instead.
    off = ff.estimate(
        model, x, delta, samples=6, readout=None, generator=torch.Generator().manual_seed(0)
    )
    assert not torch.isclose(off["readout.weight"], expected)


def test_readout_is_detected_through_output_fn_on_a_dict_model():
    model = DictOutput()
    r = probe(model, torch.randn(3, 4), random_delta(model), output_fn=lambda o: o["logits"])
    assert r.readout_module == "head"
    assert set(r.readout) == {"head.weight", "head.bias"}


def test_readout_can_be_named_and_a_wrong_name_is_a_clear_error():
    model = MLP()
    r = probe(model, torch.randn(3, 5), random_delta(model), readout="out")
    assert set(r.readout) == {"out.weight", "out.bias"}
    with pytest.raises(ValueError, match="did you mean"):
        probe(model, torch.randn(3, 5), random_delta(model), readout="outt")


def test_a_named_readout_that_does_not_compute_the_output_is_not_silently_ignored():
    """``hidden`` (7 rows, the output has 3) got no readout role without a word: the user
    believed the readout estimators applied."""
    model = MLP()
    with pytest.warns(RuntimeWarning, match=r"readout='hidden' has a weight of shape \(7, 7\).*3"):
        r = probe(model, torch.randn(3, 5), random_delta(model), readout="hidden")
    assert r.readout == {}


class _InOutHead(nn.Module):
    """``x @ weight + bias`` with the weight stored as ``(in, out)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(8, 2)), nn.Parameter(torch.zeros(2))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + self.bias


@pytest.mark.parametrize(
    ("model", "x"),
    [
        (
            lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), _InOutHead()),
            lambda: torch.randn(5, 3),
        ),
        (lambda: nn.Sequential(nn.Embedding(6, 4)), lambda: torch.tensor([[1, 2, 3]])),
    ],
)
def test_a_readout_found_by_auto_with_an_in_out_weight_is_not_warned_of(model: Any, x: Any) -> None:
    """The head found by ``readout="auto"`` was said not to compute the output, and the user,
    who had passed ``readout="auto"``, was told to pass it. Its bias, ``(K,)``, still gets
    the readout role; its weight the tensor-normal estimator."""
    net = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = probe(net, x(), random_delta(net), samples=2)
    assert "0.weight" not in r.readout and "2.weight" not in r.readout


@pytest.mark.parametrize(
    "tail",
    [nn.Identity(), nn.Flatten(), nn.Dropout(0.5).eval()],
    ids=["identity", "flatten", "eval_dropout"],
)
def test_readout_is_the_layer_that_computed_the_output_not_a_pass_through_after_it(tail):
    # timm's classifier heads end in nn.Identity (their `flatten`): the readout is the Linear
    # before it, whose output the pass-through returns unchanged, and the estimates are those
    # of the model without the tail (the pass-through was found instead, silently giving the
    # readout tensors the tensor-normal estimator).
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    model = nn.Sequential(*body, tail)
    x, delta = torch.randn(4, 5), random_delta(body)
    r = probe(model, x, delta)
    assert r.readout_module == "2"
    assert r.readout == {"2.weight": "weight", "2.bias": "bias"}
    with_tail = ff.estimate(model, x, delta, generator=torch.Generator().manual_seed(3))
    without = ff.estimate(body, x, delta, generator=torch.Generator().manual_seed(3))
    for name in delta:
        torch.testing.assert_close(with_tail[name], without[name], rtol=0, atol=0)


class _SharedLayer(nn.Module):
    """One ``Linear`` applied twice: ``out = W(Wx + b) + b = W^2 x + (W + I) b``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        with torch.no_grad():  # W + I = 0.5 * ones: every output mixes every bias entry
            self.lin.weight.copy_(0.5 * torch.ones(6, 6) - torch.eye(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x))


def test_a_layer_applied_more_than_once_is_not_a_readout(double):
    # The shared layer computes the output, but its tensors also act before it: the readout
    # bias estimator E[q0] drops the cross terms that (W + I) b has, and read ||J db|| at
    # sqrt(6 / 36) = 0.41 of exact, silently. Not a readout: kron, within its noise of exact
    # (S = 400 Gaussian samples: relative sd of a mean of squares ~ sqrt(2/400) = 7%; the
    # square root halves it).
    torch.manual_seed(0)
    model, x = _SharedLayer(), torch.randn(16, 6)
    delta = {"lin.weight": torch.zeros(6, 6), "lin.bias": torch.ones(6)}
    r = probe(model, x, delta)
    assert r.readout_module is None and r.readout == {}
    est = ff.estimate(model, x, delta, samples=400, generator=torch.Generator().manual_seed(0))
    want = ff.exact(model, x, delta)["lin.bias"]
    torch.testing.assert_close(est["lin.bias"], want, rtol=0.1, atol=0)


class _RawParameters(torch.nn.Module):
    """Only parameters of its own, no submodules: the model itself is the leaf module."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(3, 4, 6) / 2)
        self.w2 = torch.nn.Parameter(torch.randn(6, 2) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.einsum("nd,edh->nh", x, self.w1)) @ self.w2


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()),
        _RawParameters,
    ],
    ids=["activation-last", "raw-parameters"],
)
def test_a_parameterless_leaf_computing_the_output_is_no_readout(make):
    """Was: the module computing the output (a final Tanh, or the model itself when it has no
    submodules) was taken as the readout, and ``estimate`` and ``with_fslr`` raised
    "readout='1' is a Tanh without a weight or bias ... or pass readout='auto'" under that
    very default."""
    torch.manual_seed(0)
    model, x = make().double(), torch.randn(6, 4, dtype=torch.float64)
    delta = {n: 1e-2 * torch.randn_like(p) for n, p in model.named_parameters()}
    r = probe(model, x, delta, samples=2)
    assert r.readout_module is None and r.readout == {}
    g = torch.Generator().manual_seed(0)
    est = ff.estimate(model, x, delta, samples=2000, estimator="full", generator=g)
    fm = ff.with_fslr(model, samples=2, seed=0)
    assert set(fm.observe(x, delta)) == set(delta)
    for n, want in ff.exact(model, x, delta).items():  # 2000 samples: ~3% sd of the FSLR
        torch.testing.assert_close(est[n], want, rtol=0.12, atol=0, msg=n)


def test_no_readout_when_the_output_is_not_a_layer_output():
    model = MLP()
    r = probe(model, torch.randn(3, 5), random_delta(model), output_fn=lambda o: 2 * o)
    assert r.readout_module is None and r.readout == {}


def test_batchnorm_running_statistics_are_bit_identical_after_a_probe():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    model.train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    params = {n: p.clone() for n, p in model.named_parameters()}
    ff.estimate(model, torch.randn(8, 4), random_delta(model), samples=4)
    ff.exact(model, torch.randn(8, 4), random_delta(model))
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n


def test_frozen_parameters_are_constants_and_tied_weights_appear_once():
    model = MLP()
    model.inp.weight.requires_grad_(False)
    delta = random_delta(model)
    with pytest.raises(ValueError, match="frozen"):
        ff.estimate(model, torch.randn(3, 5), delta)
    del delta["inp.weight"]
    assert set(ff.estimate(model, torch.randn(3, 5), delta)) == set(delta)

    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    names = [n for n, _ in tied.named_parameters()]
    assert names == ["0.weight"]
    r = probe(tied, torch.tensor([[0, 1, 2]]), random_delta(tied))
    assert r.readout == {}  # a tied head is not given the readout variant


def test_a_subset_of_tensors_can_be_measured():
    model = MLP()
    delta = {"hidden.weight": torch.randn(7, 7)}
    assert set(ff.estimate(model, torch.randn(3, 5), delta)) == {"hidden.weight"}


def test_clear_errors_for_bad_input():
    model, x = MLP(), torch.randn(3, 5)
    delta = random_delta(model)
    with pytest.raises(ValueError, match=r"'hiden.weight': did you mean \['hidden.weight'"):
        ff.estimate(model, x, {"hiden.weight": delta["hidden.weight"]})
    with pytest.raises(ValueError, match="shapes differ"):
        ff.estimate(model, x, {"hidden.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="NaN or Inf"):
        ff.estimate(model, x, {"hidden.weight": torch.full((7, 7), float("nan"))})
    with pytest.raises(ValueError, match="NaN or Inf"):
        ff.exact(model, x, {"hidden.weight": torch.full((7, 7), float("inf"))})
    with pytest.raises(ValueError, match="empty"):
        ff.estimate(model, x, {})
    with pytest.raises(TypeError, match="output_fn"):
        ff.estimate(DictOutput(), torch.randn(3, 4), random_delta(DictOutput()))
    with pytest.raises(ValueError, match="samples"):
        ff.estimate(model, x, delta, samples=0)
    with pytest.raises(ValueError, match="unknown omega"):
        ff.estimate(model, x, delta, omega="uniform")
    with pytest.raises(ValueError, match="unknown estimator"):
        ff.estimate(model, x, delta, estimator="diag")


@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_a_seeded_generator_reproduces_the_estimate_bit_for_bit(strategy):
    model, x = MLP(), torch.randn(3, 5)
    delta = random_delta(model)

    def run(strategy):
        return ff.estimate(
            model, x, delta, generator=torch.Generator().manual_seed(5), strategy=strategy
        )

    a, b = run(strategy), run(strategy)
    assert all(torch.equal(a[n], b[n]) for n in a)
    # "timed" picks one of the two by timing: the same numbers up to float rounding.
    timed = run("timed")
    for n in a:
        torch.testing.assert_close(timed[n], a[n], rtol=1e-5, atol=0)


def test_auto_is_deterministic_vmap_for_mlps_and_a_loop_for_conv_nets_on_cpu():
    """The default decides from the model and the device, never by timing, so two runs take
    the same path and agree bit for bit."""
    model, x = MLP(), torch.randn(3, 5)
    delta = random_delta(model)
    gen = torch.Generator
    auto = probe(model, x, delta, samples=4, generator=gen().manual_seed(5))
    vmapped = probe(model, x, delta, samples=4, strategy="vmap", generator=gen().manual_seed(5))
    assert auto.strategy == "vmap"
    assert all(torch.equal(auto.log_stats[n], vmapped.log_stats[n]) for n in delta)
    conv = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(9, 2))
    cdelta = random_delta(conv)
    assert probe(conv, torch.randn(4, 2, 5), cdelta, samples=2).strategy == "loop"


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_timed_times_vmap_against_a_loop_and_keeps_the_same_numbers(chunk_size, double):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(6, 5)
    delta = random_delta(model)

    def run(strategy):
        return probe(
            model,
            x,
            delta,
            samples=5,
            strategy=strategy,
            chunk_size=chunk_size,
            generator=torch.Generator().manual_seed(3),
        )

    timed = run("timed")
    assert timed.strategy in ("vmap", "loop")
    reference = run("loop").log_stats
    for n in delta:
        torch.testing.assert_close(timed.log_stats[n], reference[n], rtol=1e-10, atol=1e-10)
    # The decision is kept for the next probe of this model and these shapes ...
    assert probe(model, x, delta, samples=1, strategy="timed").strategy == timed.strategy
    # ... but one sample cannot be timed both ways: a fresh model's stays undecided.
    fresh = MLP()
    assert probe(fresh, x, random_delta(fresh), samples=1, strategy="timed").strategy == "timed"


def test_auto_loops_over_the_samples_of_a_large_cpu_probe_and_batches_a_small_one():
    """The choice is the shapes' (probed elements x output rows vs LOOP_WORK), never timing."""
    from fslr_func.probe.vjp import LOOP_WORK

    torch.manual_seed(0)
    big = nn.Linear(512, 512)
    rows = LOOP_WORK // sum(p.numel() for p in big.parameters()) + 1
    delta = random_delta(big)
    assert probe(big, torch.randn(rows, 512), delta, samples=2).strategy == "loop"
    assert probe(big, torch.randn(rows // 2, 512), delta, samples=2).strategy == "vmap"
    small = MLP()
    assert probe(small, torch.randn(8, 5), random_delta(small), samples=2).strategy == "vmap"


def test_a_loop_runs_the_same_backward_on_plain_autograd_bit_for_bit():
    """``auto``'s first probe of a conv net runs under torch.func.vjp and resolves to the
    loop; the next ones (cached) loop over plain autograd, as ``strategy="loop"`` does: the
    same arithmetic, so every probe agrees bit for bit with every other."""
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(9, 2))
    x, delta = torch.randn(4, 2, 5), random_delta(conv)

    def run(strategy: str) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(1)
        result = probe(conv, x, delta, samples=3, strategy=strategy, generator=gen)
        assert result.strategy == "loop"
        return result.log_stats

    first, cached, explicit = run("auto"), run("auto"), run("loop")
    for n in delta:
        assert torch.equal(first[n], cached[n]) and torch.equal(first[n], explicit[n]), n
