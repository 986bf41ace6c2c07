"""Exact and property tests of the pure statistics, estimators and EMA."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fslr_func.stats.estimator import (
    EMA,
    fslr_from_log,
    log_sq_norm,
    mean_log_stats,
)
from fslr_func.stats.statistics import log_statistics

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=5).map(tuple)


def direct_stats(z: torch.Tensor) -> torch.Tensor:
    """The statistics by their definition, in float64, for comparison."""
    z = z.double()
    parts = [z.square().sum()]
    parts += [z.sum(d).square().sum() for d in range(z.dim())]
    parts.append(z.sum().square())
    return torch.stack(parts)


@given(shape=shapes, seed=st.integers(0, 2**16))
def test_log_statistics_match_definition_for_any_rank(shape, seed):
    z = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    torch.testing.assert_close(log_statistics(z).exp(), direct_stats(z), rtol=1e-12, atol=0)


@given(shape=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_kron_is_invariant_to_permuting_the_dims_of_z(shape, seed, data):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn((6, *shape), generator=g, dtype=torch.float64)
    perm = data.draw(st.permutations(range(len(shape))))
    ls = torch.stack([log_statistics(z) for z in zs])
    ls_perm = torch.stack([log_statistics(z.permute(tuple(perm))) for z in zs])
    a = log_sq_norm(mean_log_stats(ls), "kron")
    b = log_sq_norm(mean_log_stats(ls_perm), "kron")
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_rank_zero_and_one_reduce_to_the_design_formulas():
    g = torch.Generator().manual_seed(0)
    scalars = torch.randn(50, generator=g, dtype=torch.float64)
    vectors = torch.randn(50, 7, generator=g, dtype=torch.float64)
    ls0 = mean_log_stats(torch.stack([log_statistics(z) for z in scalars]))
    ls1 = mean_log_stats(torch.stack([log_statistics(z) for z in vectors]))
    for est in ("kron", "full", "iid"):
        torch.testing.assert_close(log_sq_norm(ls0, est).exp(), scalars.square().mean())
    torch.testing.assert_close(log_sq_norm(ls1, "kron").exp(), vectors.sum(1).square().mean())
    torch.testing.assert_close(log_sq_norm(ls1, "full").exp(), vectors.sum(1).square().mean())
    torch.testing.assert_close(log_sq_norm(ls1, "iid").exp(), vectors.square().sum(1).mean())


def test_matrix_kron_is_the_papers_three_ema_formula():
    zs = torch.randn(40, 3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    e_z2 = zs.square().sum((1, 2)).mean()
    e_zzt = zs.sum(1).square().sum(1).mean()
    e_ztz = zs.sum(2).square().sum(1).mean()
    ls = mean_log_stats(torch.stack([log_statistics(z) for z in zs]))
    torch.testing.assert_close(log_sq_norm(ls, "kron").exp(), e_zzt * e_ztz / e_z2)
    torch.testing.assert_close(log_sq_norm(ls, "kron", "weight").exp(), e_ztz)
    torch.testing.assert_close(log_sq_norm(ls, "kron", "bias").exp(), e_z2)
    # The readout variants only change kron: full and iid keep their meaning.
    torch.testing.assert_close(log_sq_norm(ls, "full", "weight"), log_sq_norm(ls, "full"))


@pytest.mark.parametrize("magnitude", [1e-30, 1e30])
@pytest.mark.parametrize("rank", [0, 1, 2, 4])
def test_extreme_float32_magnitudes_are_finite_and_correct(magnitude, rank):
    shape = (3,) * rank
    zs = torch.randn((8, *shape), generator=torch.Generator().manual_seed(2))
    ls = torch.stack([log_statistics(z) for z in zs])
    ls_scaled = torch.stack([log_statistics(z * magnitude) for z in zs.float()])
    assert ls_scaled.dtype == torch.float64 and torch.isfinite(ls_scaled).all()
    shift = 2 * math.log(magnitude)
    torch.testing.assert_close(ls_scaled, ls + shift, rtol=1e-5, atol=1e-4)
    est = fslr_from_log(log_sq_norm(mean_log_stats(ls_scaled), "kron"))
    ref = fslr_from_log(log_sq_norm(mean_log_stats(ls), "kron")) * magnitude
    assert torch.isfinite(est) and est > 0
    torch.testing.assert_close(est, ref, rtol=1e-5, atol=0)


def test_zero_update_gives_zero_not_nan():
    ls = torch.stack([log_statistics(torch.zeros(3, 4)) for _ in range(3)])
    for est in ("kron", "full", "iid"):
        value = fslr_from_log(log_sq_norm(mean_log_stats(ls), est))
        assert value == 0.0


@given(
    value=st.lists(st.floats(-50, 50), min_size=1, max_size=4),
    n=st.integers(1, 20),
    beta=st.floats(0.0, 0.99),
)
def test_ema_of_a_constant_stream_is_that_constant_from_the_first_update(value, n, beta):
    x = torch.tensor(value, dtype=torch.float64)
    ema = EMA(beta=beta)
    for _ in range(n):
        ema.update({"w": x})
        torch.testing.assert_close(ema.value()["w"], x, rtol=1e-12, atol=1e-12)


def test_ema_is_the_bias_corrected_average_and_round_trips():
    xs = [1.0, 4.0, 2.0]
    ema = EMA(beta=0.5)
    for x in xs:
        ema.update({"w": torch.tensor([math.log(x)], dtype=torch.float64)})
    m = 0.0
    for x in xs:
        m = 0.5 * m + 0.5 * x
    expected = m / (1 - 0.5**3)
    assert math.isclose(float(ema.value()["w"].exp()), expected, rel_tol=1e-12)
    other = EMA()
    other.load_state_dict(ema.state_dict())
    torch.testing.assert_close(other.value()["w"], ema.value()["w"])


def test_unknown_estimator_and_bad_beta_are_clear_errors():
    with pytest.raises(ValueError, match="unknown estimator 'kronn'"):
        log_sq_norm(torch.zeros(4, dtype=torch.float64), "kronn")
    with pytest.raises(ValueError, match="beta"):
        EMA(beta=1.0)


def test_statistics_of_a_large_float32_tensor_are_accurate_under_vmap():
    """Sums over millions of float32 elements (an LM head or embedding) must not drift:
    torch.dot under vmap accumulated serially and read q0 1% low at 8M elements."""
    from torch.func import vmap

    z = torch.randn(2, 2000, 4000, generator=torch.Generator().manual_seed(0))
    got = vmap(log_statistics)(z).exp()
    for row, zi in zip(got, z.double(), strict=True):
        want = torch.stack(
            [zi.square().sum(), zi.sum(0).square().sum(), zi.sum(1).square().sum(), zi.sum() ** 2]
        )
        torch.testing.assert_close(row, want, rtol=1e-5, atol=0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN included, and of the same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.nan_to_num(7.0, 8.0, 9.0), b.nan_to_num(7.0, 8.0, 9.0))
    return torch.equal(a, b)


def test_batched_mean_and_ema_match_the_per_tensor_path_bit_for_bit() -> None:
    """The wrapper's batched mean over samples and EMA update (all tensors in one
    concatenation) give exactly what the one-tensor functions give, drops included."""
    from fslr_func.stats.estimator import mean_valid_log_stats, mean_valid_log_stats_all

    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        count = int(torch.randint(2, 14, (), generator=g))
        sizes = [int(torch.randint(1, 6, (), generator=g)) for _ in range(count)]
        samples = int(torch.randint(1, 12, (), generator=g))
        stats = {
            f"t{i}": 30 * torch.randn(samples, s, generator=g, dtype=torch.float64)
            for i, s in enumerate(sizes)
        }
        for t in stats.values():
            u = torch.rand(t.shape, generator=g)
            t[u < 0.05] = math.nan
            t[(u >= 0.05) & (u < 0.1)] = math.inf
            t[(u >= 0.1) & (u < 0.2)] = -math.inf
        batched = mean_valid_log_stats_all(stats)
        means = {n: mean_valid_log_stats(t) for n, t in stats.items()}
        assert all(_same(batched[n], means[n]) for n in stats)
        together, alone = EMA(0.9), EMA(0.9)
        for step in range(4):
            include = None
            if step % 2:
                named = [n for n in stats if step > 1 or n < "t5"]
                include = {n: torch.rand((), generator=g) > 0.3 for n in named}
            together.update(means, step=step, include=include)
            for n, x in means.items():
                only = None if include is None else {k: v for k, v in include.items() if k == n}
                alone.update({n: x}, step=step, include=only)
            for field in ("log_m", "counts", "dropped", "last_dropped"):
                a, b = getattr(together, field), getattr(alone, field)
                assert all(_same(a[n], b[n]) for n in b), field
