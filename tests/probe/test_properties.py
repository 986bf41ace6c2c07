"""Every property of the probe and ``exact``, written once and run on every case of the table
(``tests/cases.py``).

* ``(sum Z)^2`` of each sample is ``(omega . J dW)^2 / M`` exactly, with ``J dW`` computed here
  by forward-mode AD (or a double vjp where forward-mode AD has no formula), independently of
  the library: an identity, so the tolerance is float64 round-off; both sampling strategies.
* ``full`` is unbiased for ``exact^2``: its mean over many samples within 4 standard errors.
* Every strategy and chunk size gives the same statistics for the same omegas.
* ``estimate`` and ``with_fslr`` run on every case and leave the model and ``delta`` untouched.
* The fallbacks are needed exactly where ``docs/modules.md`` says.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from cases import CASES, FALLBACK_CASES, build, jdw, quiet

import fslr_func as ff
from fslr_func.probe.sampling import draw_omega, probe

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_sum_of_z_is_omega_dot_j_dw_over_sqrt_m(name: str, strategy: str) -> None:
    case = CASES[name]
    model, inputs, delta = build(case)
    samples = 3
    if strategy == "vmap" and not case.vmap:  # pinned: no silent fallback
        with pytest.raises((RuntimeError, NotImplementedError)):
            probe(model, inputs, delta, samples=samples, output_fn=case.output_fn, strategy="vmap")
        return
    result = quiet(
        probe,
        model,
        inputs,
        delta,
        samples=samples,
        output_fn=case.output_fn,
        generator=torch.Generator().manual_seed(3),
        forward_seed=case.forward_seed,
        strategy=strategy,
    )
    g = torch.Generator().manual_seed(3)
    m = result.num_outputs
    cpu = torch.device("cpu")
    omegas = [draw_omega(m, "gaussian", g, cpu, torch.float64) for _ in range(samples)]
    exact = quiet(
        ff.exact, model, inputs, delta, output_fn=case.output_fn, forward_seed=case.forward_seed
    )
    assert set(result.log_stats) == set(delta) == set(exact)
    for n, d in delta.items():
        t = jdw(model, inputs, n, d, case.output_fn, case.forward_seed)
        assert t.numel() == m
        expected = torch.stack([(w @ t) ** 2 / m for w in omegas])
        got = result.log_stats[n][:, -1].exp()
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-30, msg=n)
        torch.testing.assert_close(exact[n], t.square().mean().sqrt(), rtol=1e-8, atol=0, msg=n)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.vmap))
def test_strategies_and_chunk_sizes_agree_for_the_same_omega(name: str) -> None:
    case = CASES[name]
    model, inputs, delta = build(case)

    def run(**kw: object) -> dict[str, torch.Tensor]:
        return quiet(
            probe,
            model,
            inputs,
            delta,
            samples=5,
            output_fn=case.output_fn,
            forward_seed=case.forward_seed,
            generator=torch.Generator().manual_seed(7),
            **kw,
        ).log_stats

    ref = run(strategy="loop")
    # compared as statistics, not logs: a tensor whose exact FSLR is 0 (a bias before
    # BatchNorm) holds round-off, which differs between paths far below the others' scale
    floor = 1e-12 * max(float(v.exp().max()) for v in ref.values())
    for kw in (
        {"strategy": "vmap"},
        {"strategy": "vmap", "chunk_size": 2},
        {"strategy": "vmap", "chunk_size": 1},
        {"strategy": "autograd"},
    ):
        got = run(**kw)
        for n in delta:
            torch.testing.assert_close(
                got[n].exp(), ref[n].exp(), rtol=1e-10, atol=floor, msg=f"{kw} {n}"
            )


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.unbiased))
def test_full_is_unbiased_for_exact_squared(name: str) -> None:
    case = CASES[name]
    model, inputs, delta = build(case)
    exact = quiet(
        ff.exact, model, inputs, delta, output_fn=case.output_fn, forward_seed=case.forward_seed
    )
    result = quiet(
        probe,
        model,
        inputs,
        delta,
        samples=2000,
        output_fn=case.output_fn,
        generator=torch.Generator().manual_seed(0),
        forward_seed=case.forward_seed,
        chunk_size=500,
    )
    for n, ls in result.log_stats.items():
        q_full = ls[:, -1].exp()
        mean, se = q_full.mean(), q_full.std() / math.sqrt(len(q_full))
        # 4 standard errors: a false failure has probability below 1e-4 per tensor. The
        # absolute term is float64 round-off: BatchNorm cancels a bias before it exactly, so
        # its exact FSLR is 0 while the probe's vjp leaves ~1e-35.
        assert abs(mean - exact[n] ** 2) < 4 * se + 1e-25, n


@pytest.mark.parametrize("name", sorted(CASES))
def test_estimate_and_with_fslr_run_and_leave_the_model_untouched(name: str) -> None:
    case = CASES[name]
    model, inputs, delta = build(case)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kept = {n: d.clone() for n, d in delta.items()}
    est = quiet(
        ff.estimate,
        model,
        inputs,
        delta,
        samples=4,
        output_fn=case.output_fn,
        generator=torch.Generator().manual_seed(0),
    )
    assert set(est) == set(delta)
    assert all(bool(torch.isfinite(v)) and v >= 0 for v in est.values())
    fm = ff.with_fslr(model, samples=2, output_fn=case.output_fn, seed=0)
    fslr = quiet(fm.observe, inputs, delta)
    assert set(fslr) == set(delta)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for n, d in delta.items():
        assert torch.equal(d, kept[n]), n


# ---------------------------------------------------------------------------------------------
# Module-specific behaviour
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_fallbacks_are_needed_exactly_where_docs_modules_md_says(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fslr_func.probe.fallback as probe_module

    monkeypatch.setattr(probe_module, "_warned", set())
    case = CASES[name]
    model, inputs, delta = build(case)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        r = probe(model, inputs, delta, samples=2, output_fn=case.output_fn)
        ff.exact(model, inputs, delta, output_fn=case.output_fn)
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert any("double vjp" in m for m in messages) == (name in FALLBACK_CASES), messages
    assert not any("falls back to plain autograd" in m for m in messages), messages
    # "auto" times vmap against a loop, so only a *failed* vmap is deterministic: sparse
    # gradients have no batching rule and fall back to the loop with a warning.
    vmap_failed = any("vmap over the probe's vjp failed" in m for m in messages)
    assert vmap_failed == (name == "embedding-sparse"), messages
    if vmap_failed:
        assert r.strategy == "loop"
