"""Grouping a tensor's dims into Kronecker factors (``grouping=``), for conv weights.

``kron`` assumes one covariance factor per dim of the view of ``Z`` that ``grouping`` picks
(:func:`fslr_func.stats.estimator.grouped_shape`). The default, ``"auto"``, views a weight of rank
3 or more as ``out x rest``; ``"dims"`` is the paper's one factor per dim. The measurements behind
the default are in ``docs/grouping.md`` (``benchmarks/conv_grouping.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call

import fslr_func as ff
from fslr_func.probe.sampling import draw_omega, probe
from fslr_func.stats.estimator import GROUPINGS, grouped_shape
from fslr_func.stats.statistics import log_statistics


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv1d(4, 5, 3, groups=1)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x)).flatten(2)  # (N, 4, H*W)
        return self.head(torch.tanh(self.b(h)).mean(-1))


def conv_case(seed: int = 0) -> tuple[nn.Module, Tensor, dict[str, Tensor]]:
    torch.manual_seed(seed)
    model = ConvNet().double()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    delta = {n: 1e-2 * torch.randn_like(p) for n, p in model.named_parameters()}
    return model, x, delta


shapes = st.lists(st.integers(1, 4), min_size=0, max_size=5).map(tuple)


@given(shape=shapes)
def test_builtin_groupings_of_any_rank(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    for grouping in GROUPINGS:
        view = grouped_shape("w", shape, grouping)
        assert math.prod(view) == numel
    assert grouped_shape("w", shape, "dims") == shape
    expected = (shape[0], numel // shape[0]) if len(shape) >= 3 else shape
    assert grouped_shape("w", shape, "matrix") == expected
    assert grouped_shape("w", shape, "auto") == expected


def test_callable_groupings_are_validated() -> None:
    assert grouped_shape("c.weight", (4, 3, 2, 2), lambda n, s: (s[0], s[1], -1)) == (4, 3, 4)
    assert grouped_shape("c.weight", (4, 3, 2, 2), lambda n, s: [48]) == (48,)
    assert grouped_shape("c.weight", (4, 3, 2, 2), lambda n, s: None) == (4, 3, 2, 2)
    with pytest.raises(ValueError, match=r"grouping\('c\.weight', \(4, 3, 2, 2\)\)"):
        grouped_shape("c.weight", (4, 3, 2, 2), lambda n, s: (5, 10))
    with pytest.raises(ValueError, match="view shape"):
        grouped_shape("c.weight", (4, 3, 2, 2), lambda n, s: "matrix")  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="unknown grouping 'kfc'"):
        grouped_shape("c.weight", (4, 3), "kfc")


@pytest.mark.parametrize("grouping", ["dims", "matrix", "auto", "callable"])
def test_probe_statistics_are_those_of_the_grouped_view_of_z(grouping: str) -> None:
    model, x, delta = conv_case()
    spec = (
        (lambda n, s: (s[0], -1, s[-1]) if len(s) >= 3 else None)
        if grouping == "callable"
        else grouping
    )
    samples = 3
    r = probe(
        model, x, delta, samples=samples, generator=torch.Generator().manual_seed(1), grouping=spec
    )
    g = torch.Generator().manual_seed(1)
    omegas = [draw_omega(r.num_outputs, "gaussian", g, x.device, x.dtype) for _ in range(samples)]
    params = dict(model.named_parameters())
    out = functional_call(model, params, (x,)).reshape(-1)
    for s, w in enumerate(omegas):
        grads = torch.autograd.grad(
            out, list(params.values()), w / math.sqrt(out.numel()), retain_graph=True
        )
        for (n, p), gr in zip(params.items(), grads, strict=True):
            view = tuple(p.shape) if n in r.readout else grouped_shape(n, p.shape, spec)
            expected = log_statistics((gr * delta[n]).reshape(view))
            torch.testing.assert_close(r.log_stats[n][s], expected, rtol=1e-9, atol=1e-9)


def test_grouping_changes_only_kron_of_tensors_of_rank_three_or_more() -> None:
    model, x, delta = conv_case()

    def run(estimator: str, grouping: str) -> dict[str, Tensor]:
        return ff.estimate(
            model,
            x,
            delta,
            samples=8,
            estimator=estimator,
            grouping=grouping,
            generator=torch.Generator().manual_seed(0),
            strategy="loop",  # bit-for-bit comparisons need a pinned strategy
        )

    for estimator in ff.ESTIMATORS:
        dims, matrix, auto = (
            run(estimator, "dims"),
            run(estimator, "matrix"),
            run(estimator, "auto"),
        )
        for n in delta:
            torch.testing.assert_close(auto[n], matrix[n], rtol=0, atol=0)
            if estimator != "kron" or delta[n].dim() < 3:
                # q_0 and (sum Z)^2 do not depend on the view, nor does any rank <= 2 tensor.
                torch.testing.assert_close(dims[n], matrix[n], rtol=1e-12, atol=0)
    kron_dims, kron_matrix = run("kron", "dims"), run("kron", "matrix")
    assert not torch.isclose(kron_dims["a.weight"], kron_matrix["a.weight"])


def test_matrix_grouping_is_exact_where_out_by_patch_is_kronecker() -> None:
    # One datum and one output position: the conv is a linear map of the flattened patch, and
    # with a rank-1 update u v^T (out x patch) Cov(Z) = diag(u^2) (x) (v*x)(v*x)^T / K factorises
    # over (out, patch) exactly, so E[kron] -> exact^2 under the matrix view. The per-dim view
    # also assumes v*x factorises over (in, kh, kw), which it does not. Tolerance as the core
    # test of the same fact for a linear layer: S = 20000 gives each mean ~1% standard error.
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, bias=False).double()
    model = nn.Sequential(conv, nn.Flatten())
    x = torch.randn(1, 3, 3, 3, dtype=torch.float64)
    u, v = torch.randn(4, 1, dtype=torch.float64), torch.randn(1, 27, dtype=torch.float64)
    delta = {"0.weight": (u @ v).reshape(4, 3, 3, 3)}
    exact = float(ff.exact(model, x, delta)["0.weight"])

    def kron(grouping: str) -> float:
        est = ff.estimate(
            model,
            x,
            delta,
            samples=20000,
            readout=None,
            grouping=grouping,
            generator=torch.Generator().manual_seed(1),
            strategy="vmap",
            chunk_size=5000,
        )
        return float(est["0.weight"])

    assert kron("matrix") == pytest.approx(exact, rel=0.05)
    assert kron("auto") == pytest.approx(exact, rel=0.05)
    assert abs(kron("dims") / exact - 1) > 0.15  # the per-dim assumption is visibly wrong here


def test_with_fslr_plumbs_grouping_to_the_probe() -> None:
    model, x, delta = conv_case()
    for grouping, width in (("dims", 4 + 2), ("matrix", 2 + 2), ("auto", 2 + 2)):
        fm = ff.with_fslr(model, samples=2, seed=0, grouping=grouping)
        fm.observe(x, delta)
        assert fm.ema.value()["a.weight"].shape == (width,)
    fm = ff.with_fslr(model, samples=2, seed=0, grouping=lambda n, s: (math.prod(s),))
    fm.observe(x, delta)
    assert fm.ema.value()["a.weight"].shape == (1 + 2,)
    with pytest.raises(ValueError, match="unknown grouping"):
        ff.with_fslr(model, grouping="blocks")


def test_readout_tensors_keep_their_shape_whatever_the_grouping() -> None:
    model, x, delta = conv_case()
    r = probe(model, x, delta, samples=2, grouping=lambda n, s: (math.prod(s),))
    assert r.readout == {"head.weight": "weight", "head.bias": "bias"}
    assert r.log_stats["head.weight"].shape == (2, 2 + 2)  # still a (K, d) matrix
    assert r.log_stats["a.weight"].shape == (2, 1 + 2)


@pytest.mark.slow
def test_matrix_is_closer_to_exact_than_dims_on_a_trained_conv_net() -> None:
    # The benchmark's finding (docs/grouping.md) on one seed: after 3 Adam steps the per-dim
    # view underestimates a 5x5 conv's FSLR by ~40% while out x patch is within ~10%. 1000
    # samples leave a few percent of noise on each ratio, far below the gap between them.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import conv_grouping

    ratios = conv_grouping.measure("conv2d", seed=0, steps=3, samples=1000, batch=64, lr=1e-3)
    r = ratios["ratios"]["c2.weight"]
    assert abs(r["matrix"] - 1) < abs(r["dims"] - 1)
    assert 0.8 < r["matrix"] < 1.2
    assert 0.9 < r["full"] < 1.1
