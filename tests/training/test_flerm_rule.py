"""FLeRM's pure rule (fslr_func.training.flerm_rule), property-tested: matched tensors move the
function
as their targets say, the rule is scale-covariant, every tensor lands in exactly one outcome."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from fslr_func.training.flerm_rule import match, rate

positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
anything = st.one_of(
    positive, st.just(0.0), st.just(math.nan), st.just(math.inf), st.floats(0, 1e-13)
)
names = st.lists(st.text("abcdef.", min_size=1, max_size=6), min_size=1, max_size=6, unique=True)


@given(names.flatmap(lambda ns: st.tuples(
    st.just(ns),
    st.lists(positive, min_size=len(ns), max_size=len(ns)),
    st.lists(positive, min_size=len(ns), max_size=len(ns)),
)), positive, st.floats(0.01, 10))  # fmt: skip
def test_a_matched_tensor_moves_the_function_by_its_target(
    case: tuple[list[str], list[float], list[float]], lr0: float, sched: float
) -> None:
    ns, targets, fslrs = case
    m = match(dict(zip(ns, targets, strict=True)), dict(zip(ns, fslrs, strict=True)), lr0=lr0)
    assert set(m.ratios) == set(ns) and not (m.zero or m.nonfinite or m.unmatched)
    for n, target, fslr in zip(ns, targets, fslrs, strict=True):
        # the rate times the tensor's unit-rate FSLR is lr0 * sched * target
        moved = rate(lr0, sched, m.ratios[n]) * fslr
        assert math.isclose(moved, lr0 * sched * target, rel_tol=1e-12)


@given(positive, positive, st.integers(-60, 60))
def test_scaling_every_fslr_by_k_scales_the_ratios_by_one_over_k(
    target: float, fslr: float, k: int
) -> None:
    scale = 2.0**k
    a = match({"w": target}, {"w": fslr}, lr0=1.0, min_fslr=0.0)
    b = match({"w": target}, {"w": fslr * scale}, lr0=1.0, min_fslr=0.0)
    assert math.isclose(b.ratios["w"] * scale, a.ratios["w"], rel_tol=1e-12)


@given(st.dictionaries(st.sampled_from("abcdefgh"), anything, max_size=8),
       st.dictionaries(st.sampled_from("abcdefgh"), anything, max_size=8),
       st.one_of(st.none(), positive))  # fmt: skip
def test_every_tensor_lands_in_exactly_one_outcome_and_ratios_are_finite_positive(
    fslrs: dict[str, float], targets: dict[str, float], limit: float | None
) -> None:
    targets = {n: t for n, t in targets.items() if not math.isnan(t) and t >= 0}
    max_rate = None if limit is None else dict.fromkeys("abcdefgh", limit)
    m = match(targets, fslrs, lr0=1e-2, max_rate=max_rate)
    groups = [set(m.ratios), set(m.zero), set(m.nonfinite), set(m.unmatched)]
    assert sum(len(g) for g in groups) == len(set(fslrs) | set(targets))
    assert set().union(*groups) == set(fslrs) | set(targets)
    assert all(math.isfinite(r) and r > 0 for r in m.ratios.values())
    if max_rate is not None:
        assert all(1e-2 * r <= max_rate[n] for n, r in m.ratios.items())
    assert set(m.unmatched) == set(fslrs) - set(targets)
    for n in m.zero:  # held for a zero or tiny FSLR or target, never a division by it
        assert fslrs.get(n, 0.0) <= 1e-12 or targets[n] <= 1e-12
