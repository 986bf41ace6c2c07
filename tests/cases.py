"""The table of model cases every property of the probe and ``exact`` runs on (the way
curvlinops' ``test/cases.py`` works): each property is written once, in
``tests/probe/test_properties.py``, and a new case is one line of :data:`CASES`.

A case is a model, its probe inputs and how its output is read. The models cover what users
wrap: linear and residual layers, attention, convolutions of every rank, BatchNorm in both
modes, dropout, parametrizations, frozen tensors, non-tensor outputs and inputs,
``torch.compile``, sparse embeddings, recurrent layers, the Transformer encoder layer, norms
and a Hugging Face GPT-2 (``docs/modules.md`` lists the same).
"""

from __future__ import annotations

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


class MLP(nn.Module):
    """Two hidden layers with tanh; the readout is ``out``."""

    def __init__(self, d_in: int = 5, width: int = 7, d_out: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


class ResMLP(nn.Module):
    """A residual MLP with a readout named ``readout``."""

    def __init__(self, d_in: int = 6, width: int = 8, depth: int = 2, d_out: int = 4) -> None:
        super().__init__()
        self.input = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.readout = nn.Linear(width, d_out)

    def forward(self, x: Tensor) -> Tensor:
        h = self.input(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.readout(h)


class ConvNet(nn.Module):
    """Conv2d (rank-4 weight), pooling and a linear readout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(x)).mean(dim=(2, 3)))


class AttentionBlock(nn.Module):
    """Single-head causal self-attention with a residual, then a linear readout."""

    def __init__(self, d: int = 6, vocab: int = 5) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.readout = nn.Linear(d, vocab)

    def forward(self, x: Tensor) -> Tensor:
        a = nn.functional.scaled_dot_product_attention(
            self.q(x), self.k(x), self.v(x), is_causal=True
        )
        return self.readout(x + self.o(a))


class DictOutput(nn.Module):
    """Returns a dict, like many research models."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = torch.tanh(self.body(x))
        return {"logits": self.head(h), "features": h}


def random_delta(model: nn.Module, seed: int = 0, scale: float = 1e-2) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: scale * torch.randn(p.shape, generator=g, dtype=p.dtype)
        for n, p in model.named_parameters()
    }


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


class Scripted(nn.Module):
    """A ``torch.jit.script``-ed hidden block and a traced readout inside an eager model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.block = torch.jit.script(nn.Sequential(nn.Linear(6, 6), nn.Tanh()))
        self.head = torch.jit.trace(nn.Linear(6, 3), torch.zeros(1, 6))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(torch.tanh(self.inp(x))))


class _EmbeddingHead(nn.Module):
    """An embedding of ``vocab`` tokens in ``dim`` dims, mean-pooled, and a linear head."""

    def __init__(self, vocab: int, dim: int, **embedding: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, **embedding)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(x)).mean(1))


class SparseEmbedding(_EmbeddingHead):
    """``Embedding(sparse=True)``: the probe's gradient is a sparse tensor."""

    def __init__(self) -> None:
        super().__init__(10, 4, sparse=True)


class FreqScaledEmbedding(_EmbeddingHead):
    """``Embedding(scale_grad_by_freq=True)``: its backward divides a row's gradient by the
    count of its token in the batch, so the probe runs it unscaled (a repeated token would
    read too small)."""

    def __init__(self) -> None:
        super().__init__(4, 5, scale_grad_by_freq=True)


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


def gpt2(attn: str) -> nn.Module:
    """A 2-layer GPT-2 built from its config (no download), in eval mode like a loaded model;
    the test of a case built from it is skipped where transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, attn_implementation=attn
    )
    return transformers.GPT2LMHeadModel(config).eval()  # type: ignore[no-any-return]


@dataclass
class Case:
    """One model of the table: how to build it, its inputs and how to read its output.

    Attributes:
        make: builds the model (float32; :func:`build` makes it float64).
        inputs: the probe inputs from a generator (a tensor, a tuple or a dict).
        output_fn: what of the output is measured (``None``: the output, a tensor).
        forward_seed: fixes the forward's randomness (dropout) for the probe and ``exact``.
        train: the model's mode.
        unbiased: the unbiasedness of ``full`` is checked on it (costly: many samples).
        vmap: its probe runs under ``vmap`` (sparse gradients have no batching rule: a pinned
            ``strategy="vmap"`` raises, ``"auto"`` falls back to the loop).
    """

    make: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Any]
    output_fn: Callable[[Any], Tensor] | None = None
    forward_seed: int | None = None
    train: bool = True
    unbiased: bool = False
    vmap: bool = True


def x_of(*shape: int) -> Callable[[torch.Generator], Tensor]:
    return lambda g: torch.randn(*shape, generator=g)


def _logits(out: Any) -> Tensor:
    return out.logits  # type: ignore[no-any-return]


def _tokens(g: torch.Generator) -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 64, (2, 8), generator=g), "use_cache": False}


CASES: dict[str, Case] = {
    "mlp": Case(MLP, x_of(6, 5), unbiased=True),
    "resmlp": Case(ResMLP, x_of(6, 6)),
    "attention": Case(AttentionBlock, x_of(2, 5, 6)),
    "convnet": Case(ConvNet, x_of(3, 2, 5, 5)),
    "conv1d": Case(Conv1dNet, x_of(3, 2, 11), unbiased=True),
    "conv2d": Case(Conv2dNet, x_of(3, 2, 7, 7), unbiased=True),
    "batchnorm-train": Case(BatchNormNet, x_of(5, 2, 5, 5), unbiased=True),
    "batchnorm-eval": Case(BatchNormNet, x_of(5, 2, 5, 5), train=False),
    "dropout": Case(lambda: mlp(dropout=0.3), x_of(6, 4), forward_seed=7, unbiased=True),
    "weight_norm": Case(weight_normed, x_of(6, 4)),
    "weight_norm-legacy": Case(legacy_weight_norm, x_of(6, 4)),
    "spectral_norm": Case(spectral_normed, x_of(6, 4)),
    "parametrizations": Case(custom_parametrized, x_of(6, 4)),
    "frozen": Case(frozen, x_of(6, 4), unbiased=True),
    "dict-output": Case(DictOut, x_of(6, 4), output_fn=lambda o: o["logits"]),
    "tuple-output": Case(TupleOut, x_of(6, 4), output_fn=lambda o: o[0]),
    "tuple-inputs": Case(KwargsModel, lambda g: (torch.randn(5, 4, generator=g), None, 2.0)),
    "dict-inputs": Case(
        KwargsModel, lambda g: {"x": torch.randn(5, 4, generator=g), "side": torch.ones(5, 2)}
    ),
    "compiled": Case(lambda: torch.compile(mlp(), backend="eager"), x_of(6, 4)),
    "compiled-submodule": Case(Nested, x_of(6, 4)),
    "scripted-submodules": Case(Scripted, x_of(6, 4), unbiased=True),
    "embedding-sparse": Case(
        SparseEmbedding, lambda g: torch.randint(0, 10, (3, 5), generator=g), vmap=False
    ),
    "embedding-scale-grad-by-freq": Case(  # 18 tokens of 4: every batch repeats some
        FreqScaledEmbedding, lambda g: torch.randint(0, 4, (3, 6), generator=g), unbiased=True
    ),
    "lstm-gru": Case(Recurrent, x_of(3, 6, 4)),
    "embedding-norms-mha": Case(TokenModel, lambda g: torch.randint(0, 10, (2, 5), generator=g)),
    "transformer-encoder-eval": Case(Encoder, x_of(3, 5, 8), train=False),
    "conv-transpose-conv3d-groupnorm": Case(MoreConvs, x_of(2, 2, 4, 4)),
    "gpt2-sdpa": Case(
        lambda: gpt2("sdpa"), _tokens, lambda o: o.logits, train=False, unbiased=True
    ),
    "gpt2-eager": Case(lambda: gpt2("eager"), _tokens, lambda o: o.logits, train=False),
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
