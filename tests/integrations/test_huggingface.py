"""The real Hugging Face libraries: a GPT-2 built from ``GPT2Config`` (no download) and PEFT LoRA.

The identity ``(sum Z)^2 = (omega . J dW)^2 / M`` and the unbiasedness of ``full`` run on GPT-2
(SDPA and eager attention) with every other case, in ``tests/probe/test_properties.py``.

* The output is a ``CausalLMOutputWithCrossAttentions``: ``output_fn=lambda o: o.logits``;
  inputs are a dict of keyword arguments (``{"input_ids": ..., "use_cache": False}``).
* The embedding and the head are tied: one tensor, ``transformer.wte.weight``, counted once,
  and not given the readout estimator (its rows do not act only in the readout).
* Attention runs through SDPA (the default) or the eager implementation: the probe and
  ``exact`` put SDPA on its MATH kernel, which supports vjp, vmap and jvp; both agree.
* LoRA (PEFT): only the adapters are trainable; ``B`` starts at zero so ``A``'s FSLR is exactly
  0 at first: reported as 0, never a division by zero; FLeRM starts a few steps in.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _device import DEVICE
from torch import Tensor
from torch.func import functional_call, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

import fslr_func as ff
from fslr_func.probe.sampling import draw_omega, probe

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64


def logits(out: Any) -> Tensor:
    return out.logits


def gpt2(
    seed: int = 0,
    *,
    n_embd: int = 32,
    dtype: torch.dtype = torch.float64,
    train: bool = False,
    **kw: Any,
) -> Any:
    """A 2-layer GPT-2; in eval mode (no dropout) unless ``train``, like a loaded model."""
    transformers.utils.logging.set_verbosity_error()  # no bos/eos-outside-vocab notices
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=n_embd, n_head=2, vocab_size=VOCAB, n_positions=32, **kw
    )
    return transformers.GPT2LMHeadModel(config).to(DEVICE, dtype).train(train)


def tokens(seed: int = 1, batch: int = 2, length: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g).to(DEVICE)


def batch(seed: int = 1, **kw: Any) -> dict[str, Any]:
    return {"input_ids": tokens(seed, **kw), "use_cache": False}


def random_delta(model: Any, seed: int = 2, scale: float = 1e-3) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: scale * torch.randn(p.shape, generator=g, dtype=p.dtype).to(DEVICE)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def jdw(
    model: Any, inputs: dict[str, Any], name: str, d: Tensor, seed: int | None = None
) -> Tensor:
    """J dW of the flattened logits, by forward-mode AD, independent of the library."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def f(w: Tensor) -> Tensor:
        with torch.random.fork_rng(), sdpa_kernel(SDPBackend.MATH):
            if seed is not None:
                torch.manual_seed(seed)
            return functional_call(model, {**params, name: w}, (), inputs).logits.reshape(-1)

    return jvp(f, (params[name],), (d,))[1]


SOME = (
    "transformer.wte.weight",
    "transformer.wpe.weight",
    "transformer.h.0.attn.c_attn.weight",
    "transformer.h.1.mlp.c_fc.bias",
    "transformer.ln_f.weight",
)


# ---------------------------------------------------------------------------------------------
# GPT-2
# ---------------------------------------------------------------------------------------------


def test_tied_embedding_and_head_are_one_tensor_counted_once_and_not_a_readout() -> None:
    model = gpt2()
    names = [n for n, _ in model.named_parameters()]
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    delta = random_delta(model)
    r = probe(model, batch(), delta, samples=2, output_fn=logits)
    assert set(r.log_stats) == set(names)
    assert r.readout_module == "lm_head"  # found: its output is the logits ...
    assert r.readout == {}  # ... but the tied weight keeps the kron estimator
    untied = gpt2(tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    r = probe(untied, batch(), random_delta(untied), samples=2, output_fn=logits)
    assert r.readout == {"lm_head.weight": "weight"}


def test_sdpa_and_eager_attention_measure_the_same_function() -> None:
    sdpa, eager = gpt2(attn_implementation="sdpa"), gpt2(attn_implementation="eager")
    inputs, delta = batch(), random_delta(sdpa)
    a = ff.exact(sdpa, inputs, delta, output_fn=logits)
    b = ff.exact(eager, inputs, delta, output_fn=logits)
    ea = ff.estimate(
        sdpa, inputs, delta, samples=4, output_fn=logits, generator=torch.Generator().manual_seed(0)
    )
    eb = ff.estimate(
        eager,
        inputs,
        delta,
        samples=4,
        output_fn=logits,
        generator=torch.Generator().manual_seed(0),
    )
    for n in delta:
        torch.testing.assert_close(a[n], b[n], rtol=1e-8, atol=1e-20)
        torch.testing.assert_close(ea[n], eb[n], rtol=1e-6, atol=1e-20)


def test_inputs_with_attention_mask_and_the_default_cache_setting() -> None:
    model = gpt2()
    delta = random_delta(model)
    mask = torch.ones(2, 8, dtype=torch.long, device=DEVICE)
    mask[1, 5:] = 0  # right padding
    plain = ff.exact(model, {"input_ids": tokens()}, delta, output_fn=logits)
    cached = ff.exact(model, {"input_ids": tokens(), "use_cache": True}, delta, output_fn=logits)
    masked = ff.exact(
        model,
        {"input_ids": tokens(), "attention_mask": mask, "use_cache": False},
        delta,
        output_fn=logits,
    )
    for n in delta:
        torch.testing.assert_close(plain[n], cached[n], rtol=1e-10, atol=0)
    assert any(not torch.isclose(plain[n], masked[n]) for n in delta)
    est = ff.estimate(
        model, {"input_ids": tokens(), "attention_mask": mask}, delta, samples=2, output_fn=logits
    )
    assert all(torch.isfinite(v) for v in est.values())


def test_gradient_checkpointing_gives_the_same_numbers() -> None:
    # Non-reentrant activation checkpointing cannot run under torch.func (it calls
    # requires_grad_ inside the transform): the probe and exact fall back to plain autograd,
    # whose backward recomputes the blocks with the probed weights (not the module's own):
    # evaluated away from the current weights, as with_fslr does, the numbers must not move.
    # (Checkpointing is active in train mode only: no dropout, so both modes are one function.)
    model = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    inputs, delta = batch(), random_delta(model)
    g = torch.Generator().manual_seed(5)
    before = {
        n: p.detach() + 0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype).to(DEVICE)
        for n, p in model.named_parameters()
    }

    def measure() -> tuple[Any, dict[str, Tensor]]:
        r = probe(
            model,
            inputs,
            delta,
            samples=2,
            output_fn=logits,
            params=before,
            generator=torch.Generator().manual_seed(0),
        )
        return r, ff.exact(model, inputs, delta, output_fn=logits, params=before)

    reference, exact = measure()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable renamed
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", RuntimeWarning)
        got, got_exact = measure()
    assert got.strategy == "autograd"
    assert any("could not trace" in str(w.message) for w in record)
    for n in delta:
        torch.testing.assert_close(got.log_stats[n], reference.log_stats[n], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got_exact[n], exact[n], rtol=1e-9, atol=0)


def test_the_output_must_be_selected_and_the_error_says_how() -> None:
    model = gpt2()
    with pytest.raises(TypeError, match=r"output_fn=lambda out: out\.logits"):
        ff.estimate(model, batch(), random_delta(model))
    with pytest.raises(TypeError, match=r"out\.logits"):
        ff.exact(model, batch(), random_delta(model))


def lm_step(fm: Any, opt: torch.optim.Optimizer, x: Tensor) -> None:
    opt.zero_grad()
    out = fm(input_ids=x[:, :-1], use_cache=False).logits
    torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()


def test_with_fslr_training_loop_float32() -> None:
    model = gpt2(dtype=torch.float32)
    fm = ff.with_fslr(model, samples=4, output_fn=logits, seed=0)
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-3)
    for step in range(3):
        lm_step(fm, opt, tokens(10 + step, batch=4, length=9))
        with fm.measure(opt, [batch(20 + step), batch(30 + step)]) as m:
            opt.step()
    fslr = fm.fslr()
    assert set(fslr) == {n for n, _ in model.named_parameters()}
    assert all(bool(torch.isfinite(v)) and v > 0 for v in fslr.values())
    assert fm.readout_roles == {}
    assert set(m.delta) == set(fslr)


def test_flerm_transfers_from_a_narrow_gpt2_to_a_wide_one() -> None:
    from fslr_func.training.flerm import FLeRM
    from fslr_func.training.recorder import Recorder

    def probes(seed: int) -> Iterator[dict[str, Any]]:
        return (batch(seed + i, batch=2, length=8) for i in range(10_000))

    def run(n_embd: int, base: Any = None) -> Any:
        model = gpt2(n_embd=n_embd, dtype=torch.float32)
        fm = ff.with_fslr(model, samples=4, output_fn=logits, seed=0)
        opt = torch.optim.Adam(fm.parameters(), lr=1e-3)
        ctl = (
            Recorder(fm, probes(100), warmup_samples=8, every=None)
            if base is None
            else FLeRM(fm, opt, base, probe_batches=probes(200), warmup_samples=8)
        )
        for step in range(3):
            lm_step(fm, opt, tokens(step, batch=4, length=9))
            with ctl.step(opt) if base is None else ctl.step():
                opt.step()
        return ctl

    base = run(16).record
    flerm = run(48, base)
    assert [p.step for p in flerm.history] == [0]
    point = flerm.history[0]
    assert point.held == ()
    assert set(point.lrs) == {n for n, _ in flerm.fm.module.named_parameters()}
    assert all(math.isfinite(v) and v > 0 for v in point.lrs.values())
    # Matching the narrow model's function-space steps changes the rates of the wide one.
    assert len({round(math.log10(v), 2) for v in point.lrs.values()}) > 5


# ---------------------------------------------------------------------------------------------
# PEFT LoRA
# ---------------------------------------------------------------------------------------------


def lora(
    rank: int = 4,
    seed: int = 0,
    dropout: float = 0.0,
    dtype: torch.dtype = torch.float64,
    train: bool = False,
) -> Any:
    base = gpt2(seed, dtype=dtype, train=train)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=["c_attn"],
        fan_in_fan_out=True,  # GPT-2's projections are transformers' Conv1D
        init_lora_weights="gaussian",  # the paper's: A Gaussian, B = 0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(base, config)


def test_lora_only_the_adapters_are_measured_and_a_is_zero_at_init() -> None:
    model = lora()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    delta = random_delta(model)
    assert set(delta) == set(trainable)
    est = ff.estimate(model, batch(), delta, samples=8, output_fn=logits)
    exact = ff.exact(model, batch(), delta, output_fn=logits)
    for n in trainable:
        if ".lora_A." in n:  # B = 0: A does not move the function, exactly
            assert float(est[n]) == 0.0 and float(exact[n]) == 0.0, n
        else:
            assert float(est[n]) > 0 and float(exact[n]) > 0, n
    frozen = {n: torch.zeros_like(p) for n, p in model.named_parameters() if not p.requires_grad}
    with pytest.raises(ValueError, match="is frozen"):
        ff.estimate(model, batch(), dict(list(frozen.items())[:1]), output_fn=logits)


def test_lora_a_fslr_is_zero_then_positive_once_b_moves() -> None:
    model = lora(dtype=torch.float32)
    fm = ff.with_fslr(model, samples=4, output_fn=logits, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-3)
    seen = []
    for step in range(2):
        lm_step(fm, opt, tokens(step, batch=4, length=9))
        with fm.measure(opt, batch(50 + step)) as m:
            opt.step()
        seen.append(m.fslr)
    a = [n for n in seen[0] if ".lora_A." in n]
    assert all(float(seen[0][n]) == 0.0 for n in a)  # 0, not NaN: nothing divides by it
    assert all(float(seen[1][n]) > 0.0 for n in a)  # B left zero at the first step


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
def test_dropout_in_gpt2_and_lora_shares_a_seed_between_probe_and_exact(strategy: str) -> None:
    # GPT-2's own dropout (embeddings, attention, residual) and LoRA's, in train mode: with
    # forward_seed the probe's single forward and every jvp of exact draw the same masks.
    model = lora(dropout=0.2, train=True)
    assert model.training
    delta = random_delta(model)
    inputs = batch()
    r = probe(
        model,
        inputs,
        delta,
        samples=2,
        output_fn=logits,
        forward_seed=0,
        strategy=strategy,
        generator=torch.Generator().manual_seed(0),
    )
    exact = ff.exact(model, inputs, delta, output_fn=logits, forward_seed=0)
    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")  # the omegas come from the CPU generator the probe was given
    omegas = torch.stack(
        [draw_omega(r.num_outputs, "gaussian", g, cpu, torch.float64) for _ in range(2)]
    ).to(DEVICE)
    for n, d in delta.items():
        t = jdw(model, inputs, n, d, seed=0)
        torch.testing.assert_close(exact[n], t.square().mean().sqrt(), rtol=1e-8, atol=0)
        expected = (omegas @ t) ** 2 / r.num_outputs
        torch.testing.assert_close(r.log_stats[n][:, -1].exp(), expected, rtol=1e-8, atol=1e-30)
    # Without a shared seed, exact draws other masks: a different function.
    other = ff.exact(model, inputs, delta, output_fn=logits, forward_seed=1)
    assert any(not torch.isclose(other[n], exact[n]) for n in delta if ".lora_B." in n)


def test_flerm_on_lora_starts_a_few_steps_in_without_dividing_by_zero() -> None:
    from fslr_func.training.flerm import FLeRM
    from fslr_func.training.recorder import Recorder

    def probes(seed: int) -> Iterator[dict[str, Any]]:
        return (batch(seed + i) for i in range(10_000))

    def run(rank: int, base: Any = None, start_step: int = 3) -> Any:
        model = lora(rank, dtype=torch.float32)
        fm = ff.with_fslr(model, samples=4, output_fn=logits, seed=0)
        opt = torch.optim.Adam(fm.parameters(), lr=1e-3)
        ctl = (
            Recorder(fm, probes(100), warmup_samples=8, every=None, start_step=start_step)
            if base is None
            else FLeRM(
                fm, opt, base, probe_batches=probes(200), warmup_samples=8, start_step=start_step
            )
        )
        for step in range(start_step + 2):
            lm_step(fm, opt, tokens(step, batch=4, length=9))
            with ctl.step(opt) if base is None else ctl.step():
                opt.step()
        return ctl

    base = run(2).record
    assert base.steps == [3]
    assert all(v > 0 for v in base.at(3).values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no zero-FSLR warning: A has moved
        flerm = run(8, base)
    point = flerm.history[0]
    assert point.step == 3 and point.held == ()
    assert all(math.isfinite(v) and v > 0 for v in point.lrs.values())
    # Started at step 0 instead, A's FSLR is exactly 0: FLeRM holds A's rate and says so.
    base0 = run(2, start_step=0).record
    with pytest.warns(RuntimeWarning, match="zero"):
        flerm0 = run(8, base0, start_step=0)
    held = flerm0.history[0].held
    assert held and all(".lora_A." in n for n in held)
    assert all(math.isfinite(v) and v > 0 for v in flerm0.history[0].lrs.values())


@pytest.mark.slow
def test_lora_rank_example_quick_run(tmp_path: Path) -> None:
    script = Path(__file__).parents[2] / "examples" / "lora_rank.py"
    out = tmp_path / "lora_rank.png"
    result = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.exists() and out.stat().st_size > 10_000
    assert "flerm best lr" in result.stdout and "rank 8 at the rank-2 optimum" in result.stdout
    saved = json.loads(out.with_suffix(".json").read_text())
    assert set(saved["summary"]["modes"]) == {"standard", "flerm"} and len(saved["runs"]) == 12
