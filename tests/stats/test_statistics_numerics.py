"""Property tests of the per-sample statistics at every magnitude a dtype holds.

The reference is the definition of the ``D + 2`` statistics evaluated in float64 on the very
values given (float64 holds every product and square of float32, bfloat16 and float16 values
exactly or to 2^-53), so the only error allowed is that of float32 summation: at most
``1e-5`` times the same statistic of ``|Z|`` (a bound on every partial sum; shapes here have
at most 4^5 = 1024 elements, whose pairwise summation errs by far less).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import MLP
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor
from torch.func import vmap

import fslr_func as ff
from fslr_func.stats.estimator import log_sq_norm, mean_log_stats
from fslr_func.stats.statistics import (
    ProductStatistics,
    ScaledUpdate,
    log_statistics,
    product_log_statistics,
    scale_exponent,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RTOL = 1e-5
shapes = st.lists(st.integers(1, 4), min_size=0, max_size=5).map(tuple)


def exponent_range(dtype: torch.dtype) -> tuple[int, int]:
    """``(a, b)``: ``2^a`` is the smallest subnormal of ``dtype``, ``2^b`` its largest 2^n."""
    info = torch.finfo(dtype)
    return round(math.log2(info.tiny * info.eps)), math.frexp(info.max)[1] - 1


def values(shape: tuple[int, ...], seed: int, exponent: int, dtype: torch.dtype) -> Tensor:
    """Gaussian values whose largest magnitude is ``2^exponent``, rounded to ``dtype``."""
    base = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    base = base / base.abs().max()
    return (base * 2.0**exponent).to(dtype)


def reference(z: Tensor) -> Tensor:
    """The statistics by their definition, in float64."""
    z = z.double()
    parts = [z.square().sum()] + [z.sum(d).square().sum() for d in range(z.dim())]
    return torch.stack([*parts, z.sum().square()])


def assert_matches(log_got: Tensor, z64: Tensor) -> None:
    assert log_got.dtype == torch.float64
    assert not torch.isnan(log_got).any() and not torch.isposinf(log_got).any()
    error = (log_got.exp() - reference(z64)).abs()
    bound = RTOL * reference(z64.abs())
    assert bool((error <= bound).all()), (log_got.exp(), reference(z64))


@st.composite
def magnitudes(draw: st.DrawFn, dtype: torch.dtype) -> int:
    low, high = exponent_range(dtype)
    # Half the draws at the ends of the range, where overflow and subnormals live.
    return draw(st.one_of(st.integers(low, high), st.sampled_from([low, low + 3, high])))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(shape=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_statistics_equal_the_float64_definition_at_every_magnitude(dtype, shape, seed, data):
    z = values(shape, seed, data.draw(magnitudes(dtype)), dtype)
    assert_matches(log_statistics(z), z.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(shape=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_statistics_of_a_product_equal_the_float64_definition(dtype, shape, seed, data):
    """The probe's path: gradient and update of independent magnitudes (their product may be
    far outside the dtype, e.g. 2^-149 * 2^-149), reduced under vmap over three samples."""
    grads = values((3, *shape), seed, data.draw(magnitudes(dtype)), dtype)
    delta = values(shape, seed + 1, data.draw(magnitudes(dtype)), dtype)
    shift = -math.log(7.0)
    got = vmap(lambda g: product_log_statistics(g, ScaledUpdate.of(delta, shift)))(grads)
    for row, g in zip(got, grads, strict=True):
        assert_matches(row - shift, g.double() * delta.double())


@given(
    shapes=st.lists(shapes, min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_statistics_of_every_tensor_at_once_equal_the_float64_definition(
    shapes, dtypes, seed, data
):
    """One sample's tensors of mixed ranks, dtypes and magnitudes in one call (their log,
    scale and shift applied together), viewed as given shapes where one is asked for."""
    updates, grads, views, want = {}, {}, {}, {}
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=False)):
        name = f"t{i}"
        g = values(shape, seed + 2 * i, data.draw(magnitudes(dtype)), dtype)
        d = values(shape, seed + 2 * i + 1, data.draw(magnitudes(dtype)), dtype)
        updates[name], grads[name] = ScaledUpdate.of(d, -1.5), g
        if len(shape) >= 3:  # the kron grouping's matrix view of a rank >= 3 tensor
            views[name] = (shape[0], math.prod(shape[1:]))
        want[name] = (g.double() * d.double()).reshape(views.get(name, shape))
    got = ProductStatistics(updates, views)(grads)
    assert list(got) == list(updates)
    for name, z64 in want.items():
        assert_matches(got[name] + 1.5, z64)


def test_overwriting_the_gradients_gives_the_same_statistics_bit_for_bit():
    """The probe hands its gradients over (``overwrite=True``): under vmap, a contiguous
    float32 one becomes ``Z'`` in place, and those torch cannot write (an expanded one, one
    without a sample dimension) or that are cast anyway (bfloat16) are left as they were."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (6, 5), "expanded": (4, 3), "shared": (5,), "half": (3, 2)}
    updates = {n: ScaledUpdate.of(torch.randn(s, generator=gen), -0.5) for n, s in shapes.items()}
    stats = ProductStatistics(updates, {"w": (3, 10)})
    row, shared = torch.randn(1, 3, generator=gen), torch.randn(5, generator=gen)

    def grads(w: Tensor) -> dict[str, Tensor]:
        return {
            "w": w * 3.0,
            "expanded": (w[0, :1] * row).expand(4, 3),  # stride 0: torch refuses to write it
            "shared": shared.clone(),  # the same for every sample: no sample dimension
            "half": w[:3, :2].to(torch.bfloat16),
        }

    def both(w: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
        given, kept = grads(w), grads(w)
        plain = torch.cat(list(stats(kept).values()))
        overwritten = torch.cat(list(stats(given, overwrite=True).values()))
        return plain, overwritten, given, kept

    plain, overwritten, given, kept = vmap(both)(torch.randn(4, 6, 5, generator=gen))
    assert torch.isfinite(plain).all()
    assert torch.equal(plain, overwritten)
    for name in ("expanded", "shared", "half"):
        assert torch.equal(given[name], kept[name])
    assert not torch.equal(given["w"], kept["w"])  # written: Z' = g / p * dW


def few_bits(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> Tensor:
    """Whole multiples of 2^-8 below 1 (8 significant bits): exact in every dtype here, and
    still exact times 2^p from the smallest subnormal exponent + 8 up to the largest."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-255, 256, shape, generator=g) / 256.0).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_estimators_are_invariant_to_scaling_the_update_by_a_power_of_two(dtype, shape, seed, data):
    """``||Delta f||^2`` scales by exactly ``4^power`` for every power of two that keeps the
    update exact, subnormals included."""
    low, high = exponent_range(dtype)
    power = data.draw(st.integers(low + 8, high))
    delta = few_bits(shape, seed, dtype)
    scaled = (delta.double() * 2.0**power).to(dtype)
    assert torch.equal(scaled.double(), delta.double() * 2.0**power)
    grads = values((4, *shape), seed + 1, -3, dtype)

    def log_e(d: Tensor) -> Tensor:
        update = ScaledUpdate.of(d)
        return mean_log_stats(torch.stack([product_log_statistics(g, update) for g in grads]))

    for estimator in ("kron", "full", "iid"):
        want = log_sq_norm(log_e(delta), estimator) + 2 * power * math.log(2.0)
        torch.testing.assert_close(log_sq_norm(log_e(scaled), estimator), want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("power", ["lowest", -60, 60])
def test_probe_fslrs_scale_with_the_update_down_to_subnormals(dtype, power):
    """One-shot estimates of an update scaled by 2^power are finite and exactly 2^power times
    the unscaled ones (same omegas, same gradients); at the lowest power that keeps the
    update exact (2^-141 ~ 3.5e-43 in float32, 2^-125 in bfloat16) most of it is subnormal."""
    power = exponent_range(dtype)[0] + 8 if power == "lowest" else power
    torch.manual_seed(0)
    model = MLP().to(dtype)
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    delta = {n: few_bits(p.shape, i, dtype) for i, (n, p) in enumerate(model.named_parameters())}
    scaled = {n: d * 2.0**power for n, d in delta.items()}
    assert all(torch.equal(scaled[n].double(), d.double() * 2.0**power) for n, d in delta.items())
    for estimator in ("kron", "full", "iid"):
        seed = torch.Generator().manual_seed(2)
        base = ff.estimate(model, x, delta, estimator=estimator, generator=seed)
        seed = torch.Generator().manual_seed(2)
        got = ff.estimate(model, x, scaled, estimator=estimator, generator=seed)
        for n in delta:
            assert torch.isfinite(got[n]) and got[n] > 0, (n, got[n])
            torch.testing.assert_close(got[n], base[n] * 2.0**power, rtol=1e-12, atol=0)


def test_scale_exponent_reads_subnormals_and_clamps_to_normal_powers():
    smallest = torch.tensor([0.0, -(2.0**-149)])
    assert int(scale_exponent(smallest)) == 127  # 2^149 is no float32: clamped
    assert int(scale_exponent(torch.tensor([2.0**-130]))) == 127
    assert int(scale_exponent(torch.tensor([3.0e38]))) == -126
    assert int(scale_exponent(torch.tensor([0.75, -0.5]))) == 0
    assert int(scale_exponent(torch.zeros(3))) == 0


def test_non_finite_z_gives_statistics_the_ema_refuses():
    for bad in (math.nan, math.inf, -math.inf):
        z = torch.tensor([[1.0, bad], [2.0, 3.0]])
        log_q = log_statistics(z)
        assert bool((torch.isnan(log_q) | torch.isposinf(log_q)).any())
        update = ScaledUpdate.of(torch.ones(2, 2))
        log_q = product_log_statistics(z, update)
        assert bool((torch.isnan(log_q) | torch.isposinf(log_q)).any())


@pytest.mark.parametrize("power", [-1060, -900, 900, 1010])
def test_float64_statistics_are_finite_and_shift_exactly_at_the_ends_of_its_range(power):
    """Float64 has no wider type to check against; its statistics of ``2^power Z`` (exact:
    8-bit values) are those of ``Z`` shifted by ``2 power log 2``, subnormals included."""
    z = few_bits((3, 4), 7, torch.float64)
    scaled = z * 2.0**power
    assert torch.equal(scaled / 2.0**power, z)
    got = log_statistics(scaled)
    assert bool(torch.isfinite(got).all())
    want = log_statistics(z) + 2 * power * math.log(2.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
