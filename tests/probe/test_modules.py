"""Module coverage: ``estimate`` agrees with ``exact`` on the modules users wrap.

For every case the probe's per-sample ``(sum Z)^2`` is checked against ``(omega . J dW)^2 / M``
with ``J dW`` computed here by forward-mode AD (or a double vjp where forward-mode AD has no
formula), independently of the library: an identity, so the tolerance is float64 round-off
(bf16: its own precision). ``full`` is unbiased for ``exact^2``: its mean over many samples
is checked within 4 standard errors, the core tests' criterion. Module-specific properties
(BatchNorm running statistics, one dropout mask per probe, parametrization names, frozen
parameters, compiled modules' names) are tested beside them. ``docs/modules.md`` lists the
same cases.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import parametrizations, parametrize

import fslr_func as ff
from fslr_func.probe.sampling import draw_omega, probe

# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class Conv1dNet(nn.Module):
    """Rank-3 weights: strided, grouped and dilated Conv1d."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(2, 4, 3, stride=2, padding=1)
        self.b = nn.Conv1d(4, 6, 3, groups=2, dilation=2)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.head(h.mean(-1))


class Conv2dNet(nn.Module):
    """Rank-4 weights: strided, grouped (and depthwise) Conv2d without bias in one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.b = nn.Conv2d(4, 4, 3, groups=2, padding=1, bias=False)
        self.c = nn.Conv2d(4, 4, (1, 3), groups=4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return self.head(h.mean((-1, -2)))


class BatchNormNet(nn.Module):
    """BatchNorm1d and BatchNorm2d, used in train mode (batch statistics, running updates)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn2 = nn.BatchNorm2d(3)
        self.lin = nn.Linear(3, 5)
        self.bn1 = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.bn2(self.conv(x))).mean((-1, -2))
        return self.head(torch.tanh(self.bn1(self.lin(h))))


def mlp(d_in: int = 4, width: int = 6, d_out: int = 3, *, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(d_in, width), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, d_out)]
    return nn.Sequential(*layers)


class Symmetric(nn.Module):
    """A user-written parametrization: the weight is the symmetric part of the parameter."""

    def forward(self, x: Tensor) -> Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def weight_normed() -> nn.Module:
    m = mlp()
    parametrizations.weight_norm(m[0])
    parametrizations.weight_norm(m[2], dim=1)
    return m


def spectral_normed() -> nn.Module:
    m = mlp()
    parametrizations.spectral_norm(m[2])
    return m


def custom_parametrized() -> nn.Module:
    m = mlp()
    parametrize.register_parametrization(m[2], "weight", Symmetric())
    parametrizations.orthogonal(m[0])
    return m


def legacy_weight_norm() -> nn.Module:
    m = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(m[2])  # the deprecated hook-based version
    return m


def frozen() -> nn.Module:
    m = mlp()
    m[0].requires_grad_(False)
    m[2].bias.requires_grad_(False)
    return m


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = torch.tanh(self.body(x))
        return {"logits": self.head(h), "features": h}


class TupleOut(DictOut):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        h = torch.tanh(self.body(x))
        return self.head(h), h


class KwargsModel(nn.Module):
    """Two inputs, one of them a keyword argument with a default."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 6), nn.Linear(2, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor, side: Tensor | None = None, scale: float = 1.0) -> Tensor:
        h = self.a(x) if side is None else self.a(x) + self.b(side)
        return self.head(torch.tanh(scale * h))


class Nested(nn.Module):
    """A model with a ``torch.compile``-d submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.block = torch.compile(nn.Sequential(nn.Linear(6, 6), nn.Tanh()), backend="eager")
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(torch.tanh(self.inp(x))))


class SparseEmbedding(nn.Module):
    """``Embedding(sparse=True)``: the probe's gradient is a sparse tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(x)).mean(1))


class Recurrent(nn.Module):
    """LSTM and GRU (rank-1 and rank-2 weights of several gates)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.gru = nn.GRU(5, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.gru(self.lstm(x)[0])[0][:, -1])


class Encoder(nn.Module):
    """``nn.TransformerEncoderLayer`` in eval mode (its fused fast path, which has no jvp, is
    skipped while a torch function mode watches the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).mean(1))


class MoreConvs(nn.Module):
    """ConvTranspose2d, Conv3d and GroupNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 3, 3, stride=2)
        self.norm = nn.GroupNorm(1, 3)
        self.vol = nn.Conv3d(1, 2, 2)
        self.head = nn.Linear(2, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.up(x)))  # (N, 3, 9, 9)
        return self.head(torch.tanh(self.vol(h[:, None, :, :4, :4])).mean((2, 3, 4)))


class TokenModel(nn.Module):
    """Embedding with padding_idx, LayerNorm, RMSNorm and nn.MultiheadAttention."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.ln = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.rms = nn.RMSNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(self.emb(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.rms(h))


@dataclass
class Case:
    make: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Any]
    output_fn: Callable[[Any], Tensor] | None = None
    forward_seed: int | None = None
    train: bool = True


def _x(*shape: int) -> Callable[[torch.Generator], Tensor]:
    return lambda g: torch.randn(*shape, generator=g)


pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

CASES: dict[str, Case] = {
    "conv1d": Case(Conv1dNet, _x(3, 2, 11)),
    "conv2d": Case(Conv2dNet, _x(3, 2, 7, 7)),
    "batchnorm-train": Case(BatchNormNet, _x(5, 2, 5, 5)),
    "batchnorm-eval": Case(BatchNormNet, _x(5, 2, 5, 5), train=False),
    "dropout": Case(lambda: mlp(dropout=0.3), _x(6, 4), forward_seed=7),
    "weight_norm": Case(weight_normed, _x(6, 4)),
    "weight_norm-legacy": Case(legacy_weight_norm, _x(6, 4)),
    "spectral_norm": Case(spectral_normed, _x(6, 4)),
    "parametrizations": Case(custom_parametrized, _x(6, 4)),
    "frozen": Case(frozen, _x(6, 4)),
    "dict-output": Case(DictOut, _x(6, 4), output_fn=lambda o: o["logits"]),
    "tuple-output": Case(TupleOut, _x(6, 4), output_fn=lambda o: o[0]),
    "tuple-inputs": Case(KwargsModel, lambda g: (torch.randn(5, 4, generator=g), None, 2.0)),
    "dict-inputs": Case(
        KwargsModel, lambda g: {"x": torch.randn(5, 4, generator=g), "side": torch.ones(5, 2)}
    ),
    "compiled": Case(lambda: torch.compile(mlp(), backend="eager"), _x(6, 4)),
    "compiled-submodule": Case(Nested, _x(6, 4)),
    "embedding-sparse": Case(SparseEmbedding, lambda g: torch.randint(0, 10, (3, 5), generator=g)),
    "lstm-gru": Case(Recurrent, _x(3, 6, 4)),
    "embedding-norms-mha": Case(TokenModel, lambda g: torch.randint(0, 10, (2, 5), generator=g)),
    "transformer-encoder-eval": Case(Encoder, _x(3, 5, 8), train=False),
    "conv-transpose-conv3d-groupnorm": Case(MoreConvs, _x(2, 2, 4, 4)),
}
# exact uses a double vjp (no forward-mode formula): weight_norm, spectral_norm and the encoder
FALLBACK_CASES = {"weight_norm", "weight_norm-legacy", "spectral_norm"}


def build(case: Case, seed: int = 0) -> tuple[nn.Module, Any, dict[str, Tensor]]:
    torch.manual_seed(seed)
    model = case.make().double()
    model.train(case.train)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = _double(case.inputs(g))
    delta = {
        n: 1e-2 * torch.randn(p.shape, generator=g, dtype=p.dtype)
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return model, inputs, delta


def _double(inputs: Any) -> Any:
    if isinstance(inputs, Tensor):
        return inputs.double() if inputs.is_floating_point() else inputs
    if isinstance(inputs, dict):
        return {k: _double(v) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(_double(v) for v in inputs)
    return inputs


def _split(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    if isinstance(inputs, dict):
        return (), inputs
    return tuple(inputs), {}


def jdw(
    model: nn.Module,
    inputs: Any,
    name: str,
    d: Tensor,
    output_fn: Callable[[Any], Tensor] | None = None,
    forward_seed: int | None = None,
) -> Tensor:
    """J dW of the flattened output, independent of the library (buffers cloned)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    args, kwargs = _split(inputs)

    def f(w: Tensor) -> Tensor:
        state = {**params, **{n: b.clone() for n, b in model.named_buffers()}, name: w}
        with torch.random.fork_rng():
            if forward_seed is not None:
                torch.manual_seed(forward_seed)
            out = functional_call(model, state, args, kwargs)
        return (out if output_fn is None else output_fn(out)).reshape(-1)

    try:
        return jvp(f, (params[name],), (d,))[1]
    except (RuntimeError, NotImplementedError):
        # No forward-mode formula (weight_norm, spectral_norm, the fused encoder layer):
        # J d = d/du <J^T u, d>, through the MATH attention kernel (the flash one has no
        # double backward).
        with sdpa_kernel(SDPBackend.MATH):
            w = params[name].clone().requires_grad_(True)
            out = f(w)
            u = torch.zeros_like(out, requires_grad=True)
            (g,) = torch.autograd.grad(out, w, u, create_graph=True)
            return torch.autograd.grad(g, u, d)[0]


def quiet(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the library's one-time fallback warnings silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", category=RuntimeWarning, message=".*(falls?|falling) back.*"
        )
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Every case: the identity and the unbiasedness of ``full``
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_sum_of_z_is_omega_dot_j_dw_over_sqrt_m(name: str) -> None:
    case = CASES[name]
    model, inputs, delta = build(case)
    samples = 3
    result = quiet(
        probe,
        model,
        inputs,
        delta,
        samples=samples,
        output_fn=case.output_fn,
        generator=torch.Generator().manual_seed(3),
        forward_seed=case.forward_seed,
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


@pytest.mark.parametrize("name", ["conv1d", "conv2d", "batchnorm-train", "dropout", "frozen"])
def test_full_is_unbiased_for_exact_squared(name: str) -> None:
    case = CASES[name]
    model, inputs, delta = build(case)
    exact = ff.exact(model, inputs, delta, forward_seed=case.forward_seed)
    result = probe(
        model,
        inputs,
        delta,
        samples=2000,
        generator=torch.Generator().manual_seed(0),
        forward_seed=case.forward_seed,
        strategy="vmap",
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


def test_conv_weights_keep_their_rank_under_dims_and_become_matrices_by_default() -> None:
    model, inputs, delta = build(CASES["conv2d"])
    auto = probe(model, inputs, delta, samples=2)
    dims = probe(model, inputs, delta, samples=2, grouping="dims")
    assert auto.log_stats["a.weight"].shape == (2, 2 + 2)  # (out, in*kh*kw)
    assert dims.log_stats["a.weight"].shape == (2, 4 + 2)  # (out, in, kh, kw)
    model1, inputs1, delta1 = build(CASES["conv1d"])
    assert probe(model1, inputs1, delta1, samples=2, grouping="dims").log_stats["a.weight"].shape[
        1
    ] == (3 + 2)


def test_batchnorm_train_mode_running_statistics_are_untouched() -> None:
    model, x, delta = build(CASES["batchnorm-train"])
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    assert any("num_batches_tracked" in n for n in buffers)
    for strategy in ("vmap", "loop", "autograd"):
        ff.estimate(model, x, delta, samples=3, strategy=strategy)
    ff.exact(model, x, delta)
    fm = ff.with_fslr(model, samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    with fm.measure(opt, x):
        pass  # a step that does nothing: the probe still runs
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    # ... while a real forward in train mode does update them (the probe is really train mode).
    model(x)
    assert not torch.equal(model.bn1.running_mean, buffers["bn1.running_mean"])


def test_batchnorm_train_and_eval_measure_different_functions() -> None:
    model, x, delta = build(CASES["batchnorm-train"])
    train = ff.exact(model, x, delta)
    model.eval()
    evaluated = ff.exact(model, x, delta)
    assert not torch.isclose(train["lin.weight"], evaluated["lin.weight"])


def test_dropout_one_mask_per_probe_and_shared_seed_with_exact() -> None:
    case = CASES["dropout"]
    model, x, delta = build(case)
    # With a shared forward_seed, exact and the probe see the same mask ...
    a = ff.exact(model, x, delta, forward_seed=11)
    b = ff.exact(model, x, delta, forward_seed=11)
    c = ff.exact(model, x, delta, forward_seed=12)
    for n in delta:
        assert torch.equal(a[n], b[n])
    assert any(not torch.isclose(a[n], c[n]) for n in delta)
    # ... and the seeded forward neither uses nor advances the global RNG (omega comes from
    # its own generator here).
    state = torch.get_rng_state()
    probe(model, x, delta, samples=2, forward_seed=11, generator=torch.Generator())
    assert torch.equal(torch.get_rng_state(), state)
    # One mask for all samples: every sample of one probe satisfies the identity with the
    # J dW of that one mask (test_sum_of_z_... checks it for S = 3; here S = 16, vmap and loop).
    for strategy in ("vmap", "loop"):
        r = probe(
            model,
            x,
            delta,
            samples=16,
            forward_seed=5,
            strategy=strategy,
            generator=torch.Generator().manual_seed(0),
        )
        g = torch.Generator().manual_seed(0)
        omegas = torch.stack(
            [draw_omega(r.num_outputs, "gaussian", g, x.device, x.dtype) for _ in range(16)]
        )
        t = jdw(model, x, "0.weight", delta["0.weight"], forward_seed=5)
        expected = (omegas @ t) ** 2 / r.num_outputs
        torch.testing.assert_close(
            r.log_stats["0.weight"][:, -1].exp(), expected, rtol=1e-8, atol=0
        )


def test_dropout_without_a_seed_runs_and_eval_mode_needs_none() -> None:
    model, x, delta = build(CASES["dropout"])
    assert all(torch.isfinite(v) for v in ff.estimate(model, x, delta, samples=2).values())
    model.eval()
    a, b = ff.exact(model, x, delta), ff.exact(model, x, delta)
    assert all(torch.equal(a[n], b[n]) for n in delta)


def test_parametrized_modules_are_keyed_by_their_parameter_names() -> None:
    model, x, delta = build(CASES["weight_norm"])
    assert "0.parametrizations.weight.original0" in delta  # the norm g
    assert "0.parametrizations.weight.original1" in delta  # the direction v
    est = ff.estimate(model, x, delta, samples=2)
    assert set(est) == set(delta)


def test_frozen_parameters_are_constants_and_cannot_be_in_delta() -> None:
    model, x, delta = build(CASES["frozen"])
    assert "0.weight" not in delta and "2.bias" not in delta
    bad = {**delta, "0.weight": torch.zeros_like(model[0].weight)}
    with pytest.raises(ValueError, match=r"'0\.weight' is frozen"):
        ff.estimate(model, x, bad)
    with pytest.raises(ValueError, match=r"'0\.weight' is frozen"):
        ff.exact(model, x, bad)
    fm = ff.with_fslr(model, samples=2, seed=0)
    opt = torch.optim.Adam([p for p in fm.parameters() if p.requires_grad], lr=1e-2)
    model(x).square().mean().backward()
    with fm.measure(opt, x):
        opt.step()
    assert set(fm.fslr()) == set(delta)


def test_bf16_parameters_agree_with_the_float64_model() -> None:
    torch.manual_seed(0)
    model = mlp().to(torch.bfloat16)
    x = torch.randn(16, 4).to(torch.bfloat16)
    delta = {n: 1e-2 * torch.randn_like(p) for n, p in model.named_parameters()}
    est = ff.estimate(model, x, delta, samples=64, generator=torch.Generator().manual_seed(0))
    exact = ff.exact(model, x, delta)
    ref_model = mlp().double()
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref_delta = {n: d.double() for n, d in delta.items()}
    ref_est = ff.estimate(
        ref_model, x.double(), ref_delta, samples=64, generator=torch.Generator().manual_seed(0)
    )
    ref_exact = ff.exact(ref_model, x.double(), ref_delta)
    for n in delta:
        assert est[n].dtype == exact[n].dtype == torch.float64
        # bf16 keeps 8 bits of mantissa (relative error 2^-8 per op); through three layers a
        # few percent is the precision available, and the same omega makes the rest identical.
        assert float(exact[n]) == pytest.approx(float(ref_exact[n]), rel=0.05), n
        assert float(est[n]) == pytest.approx(float(ref_est[n]), rel=0.1), n


def test_model_outputs_that_are_not_tensors_need_output_fn() -> None:
    for make, hint in ((DictOut, "keys"), (TupleOut, "tuple")):
        model, x, delta = build(Case(make, _x(6, 4)))
        with pytest.raises(TypeError, match=hint):
            ff.estimate(model, x, delta)
        with pytest.raises(TypeError, match="output_fn"):
            ff.exact(model, x, delta)


def test_readout_is_found_through_dict_and_tuple_outputs() -> None:
    for make in (DictOut, TupleOut):
        model, x, delta = build(Case(make, _x(6, 4)))
        fn = (lambda o: o["logits"]) if make is DictOut else (lambda o: o[0])
        r = probe(model, x, delta, samples=2, output_fn=fn)
        assert r.readout_module == "head"
        assert r.readout == {"head.weight": "weight", "head.bias": "bias"}


def test_compiled_model_names_and_values_match_the_original() -> None:
    torch.manual_seed(0)
    plain = mlp().double()
    compiled = torch.compile(plain, backend="eager")
    x = torch.randn(6, 4, dtype=torch.float64)
    delta = {n: 1e-2 * torch.randn_like(p) for n, p in plain.named_parameters()}
    cdelta = {f"_orig_mod.{n}": d for n, d in delta.items()}
    assert set(cdelta) == {n for n, _ in compiled.named_parameters()}
    a = ff.estimate(plain, x, delta, samples=4, generator=torch.Generator().manual_seed(0))
    b = ff.estimate(compiled, x, cdelta, samples=4, generator=torch.Generator().manual_seed(0))
    ea, eb = ff.exact(plain, x, delta), ff.exact(compiled, x, cdelta)
    for n in delta:
        torch.testing.assert_close(b[f"_orig_mod.{n}"], a[n], rtol=1e-12, atol=0)
        torch.testing.assert_close(eb[f"_orig_mod.{n}"], ea[n], rtol=1e-12, atol=0)
    r = probe(compiled, x, cdelta, samples=2)
    assert r.readout == {"_orig_mod.4.weight": "weight", "_orig_mod.4.bias": "bias"}
    with pytest.raises(ValueError, match="did you mean"):
        ff.estimate(compiled, x, delta)  # the uncompiled names: a clear error


def test_with_fslr_on_a_compiled_model_trains_without_recompiling() -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    compiled = torch.compile(mlp(), backend="eager")
    x, probe_x = torch.randn(8, 4), torch.randn(8, 4)
    fm = ff.with_fslr(compiled, samples=2, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    graphs = None
    for step in range(3):
        opt.zero_grad()
        fm(x).square().mean().backward()
        with fm.measure(opt, probe_x):
            opt.step()
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # the probe runs the module eagerly
    assert set(fm.fslr()) == {n for n, _ in compiled.named_parameters()}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_compiled_model() -> None:
    torch.manual_seed(0)
    plain = mlp()
    compiled = torch.compile(plain)
    x = torch.randn(6, 4)
    compiled(x)
    delta = {f"_orig_mod.{n}": 1e-2 * torch.randn_like(p) for n, p in plain.named_parameters()}
    est = ff.estimate(compiled, x, delta, samples=4)
    exact = ff.exact(compiled, x, delta)
    assert set(est) == set(exact) == set(delta)


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


def test_embedding_bag_probe_works_and_exact_says_it_cannot() -> None:
    # EmbeddingBag has neither a forward-mode formula nor a double backward: the probe (one
    # backward per sample) works; exact has no path and raises torch's error (limitations.md).
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(10, 4), nn.Linear(4, 3))
    x = torch.randint(0, 10, (3, 5))
    delta = {n: 1e-2 * torch.randn_like(p) for n, p in model.named_parameters()}
    est = quiet(ff.estimate, model, x, delta, samples=4, estimator="full")
    assert all(bool(torch.isfinite(v)) and v > 0 for v in est.values())
    with pytest.raises(NotImplementedError, match="_embedding_bag_backward"):
        quiet(ff.exact, model, x, delta)
