"""Reference models and offline data of ``fslr_func.experiments``."""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch

from fslr_func.experiments import (
    BLOCK_RE,
    ResMLP,
    Transformer,
    batches,
    block_index,
    byte_batches,
    digits,
    last_mean,
    lm_batches,
    lm_loss,
    mnist1d,
    pydoc_text,
    stdlib_source,
    train,
)

Norm = Literal["prenorm", "postnorm", "prenormpostmod"]
NORMS: tuple[Norm, ...] = ("prenorm", "postnorm", "prenormpostmod")


def _rel_var_error(w: torch.Tensor, expected_var: float) -> float:
    return abs(w.var().item() / expected_var - 1.0)


def _tolerance(n: int) -> float:
    # The sample variance of n i.i.d. Gaussians has relative standard deviation sqrt(2 / n):
    # 6 standard deviations makes a false failure astronomically unlikely (~1e-9).
    return 6.0 * math.sqrt(2.0 / n)


# ---------------------------------------------------------------- ResMLP


def test_resmlp_shapes_and_names() -> None:
    model = ResMLP(40, 10, width=32, depth=3)
    assert model(torch.randn(7, 40)).shape == (7, 10)
    assert model(torch.randn(7, 5, 8)).shape == (7, 10)  # inputs are flattened
    names = [n for n, _ in model.named_parameters()]
    assert names == [
        "input.weight",
        "input.bias",
        *[f"blocks.{i}.linear.{p}" for i in range(3) for p in ("weight", "bias")],
        "readout.weight",
        "readout.bias",
    ]
    assert sorted({block_index(n) for n in names} - {None}) == [0, 1, 2]  # type: ignore[type-var]
    assert BLOCK_RE.search("input.weight") is None


@pytest.mark.parametrize("init_scale", [1.0, 3.0])
def test_resmlp_kaiming_variance(init_scale: float) -> None:
    torch.manual_seed(0)
    width, depth, fan_in = 256, 4, 100
    model = ResMLP(fan_in, 10, width=width, depth=depth, init_scale=init_scale)
    w_in, w_out = model.get_parameter("input.weight"), model.get_parameter("readout.weight")
    assert _rel_var_error(w_in, 1.0 / fan_in) < _tolerance(w_in.numel())  # gain 1
    assert _rel_var_error(w_out, 1.0 / width) < _tolerance(w_out.numel())  # gain 1, not scaled
    for i in range(depth):
        w = model.get_parameter(
            f"blocks.{i}.linear.weight"
        )  # ReLU-fed: gain 2; 1/sqrt(depth) and init_scale on the std
        assert _rel_var_error(w, 2.0 / width / depth * init_scale**2) < _tolerance(w.numel())
        assert abs(w.mean().item()) < 6.0 * w.std().item() / math.sqrt(w.numel())
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0


def test_resmlp_depth_invariant_at_init() -> None:
    # With W_l ~ N(0, 2 / (width depth)), each block multiplies the residual stream's mean
    # square by (1 + 1/depth), so the output mean square is (1 + 1/L)^L * (input mean square):
    # 2.44 at L=4 and 2.64 at L=16, i.e. RMS ratio 1.04; without the 1/sqrt(L) factor it would
    # be 2^4 vs 2^16 (RMS ratio 16). Width 1024 and 256 inputs keep finite-size noise ~1%.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    rms = {}
    for depth in (4, 16):
        torch.manual_seed(depth)
        with torch.no_grad():
            h = ResMLP(64, 10, width=1024, depth=depth).features(x)
        rms[depth] = h.square().mean().sqrt().item()
        assert rms[depth] ** 2 == pytest.approx((1 + 1 / depth) ** depth, rel=0.1)
    assert rms[16] / rms[4] == pytest.approx(1.0, abs=0.1)


# ---------------------------------------------------------------- Transformer


def _small_transformer(
    norm: Norm = "prenorm", width_mult: int = 1, affine: bool = False
) -> Transformer:
    return Transformer(
        d_model=32,
        n_heads=2,
        d_ff=64,
        depth=2,
        seq_len=16,
        norm=norm,
        width_mult=width_mult,
        affine=affine,
    )


def test_transformer_names_and_shapes() -> None:
    model = _small_transformer()
    names = {n for n, _ in model.named_parameters()}
    for i in range(2):
        for p in ("attn.q", "attn.k", "attn.v", "attn.o", "ff.up", "ff.down"):
            assert f"blocks.{i}.{p}.weight" in names
            assert f"blocks.{i}.{p}.bias" in names
    assert {"embed.weight", "pos.weight", "readout.weight"} <= names
    assert not any("norm" in n for n in names)  # no affine layer norms by default
    assert {block_index(n) for n in names} == {0, 1, None}
    tokens = torch.randint(0, 256, (3, 16))
    assert model(tokens).shape == (3, 16, 256)
    assert model(tokens[:, :5]).shape == (3, 5, 256)
    with pytest.raises(ValueError):
        model(torch.randint(0, 256, (1, 17)))


def test_transformer_width_mult_and_affine() -> None:
    model = _small_transformer(width_mult=2, affine=True)
    assert model.get_parameter("blocks.0.attn.q.weight").shape == (64, 64)
    assert model.get_parameter("blocks.0.ff.up.weight").shape == (128, 64)
    attn = model.get_submodule("blocks.0.attn")
    assert (attn.n_heads, attn.d_head) == (4, 16)
    names = {n for n, _ in model.named_parameters()}
    assert "blocks.0.attn.q_norm.weight" in names and "final_norm.bias" in names
    with pytest.raises(ValueError):
        _small_transformer(norm="sandwich")  # type: ignore[arg-type]


def test_transformer_kaiming_variance() -> None:
    torch.manual_seed(0)
    model = Transformer(d_model=128, n_heads=2, d_ff=512, depth=2, init_scale=2.0)
    checks = [
        ("blocks.0.attn.q.weight", 4.0 / 128),
        ("blocks.1.attn.o.weight", 4.0 / 128),
        ("blocks.0.ff.up.weight", 4.0 / 128),
        ("blocks.0.ff.down.weight", 2.0 * 4.0 / 512),  # ReLU-fed
        ("readout.weight", 1.0 / 128),  # init_scale does not apply
        ("embed.weight", 1.0),
    ]
    for name, var in checks:
        w = model.get_parameter(name)
        assert _rel_var_error(w, var) < _tolerance(w.numel()), name


@pytest.mark.parametrize("norm", NORMS)
def test_transformer_causal_and_finite(norm: Norm) -> None:
    torch.manual_seed(0)
    model = _small_transformer(norm).eval()
    tokens = torch.randint(0, 256, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[:, :7], b[:, :7])  # the past does not see the future
    assert not torch.allclose(a[:, 7:], b[:, 7:])
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("norm", NORMS)
def test_transformer_depth_factor(norm: Norm) -> None:
    # The 1/sqrt(L) branch factor keeps the residual stream (before the final norm) of the same
    # order at depth 2 and depth 16 for every placement.
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    rms = {}
    for depth in (2, 16):
        torch.manual_seed(depth)
        model = Transformer(d_model=64, n_heads=2, d_ff=128, depth=depth, seq_len=16, norm=norm)
        x = model.embed(tokens) + model.pos(torch.arange(16))
        with torch.no_grad():
            for block in model.blocks:
                x = block(x)
        rms[depth] = x.square().mean().sqrt().item()
    assert 0.6 < rms[16] / rms[2] < 1.5


# ---------------------------------------------------------------- data and training


def test_digits_and_mnist1d() -> None:
    d = digits()
    assert d.x_train.shape == (1438, 64) and d.y_train.shape == (1438,)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert d.in_features == 64 and d.num_classes == 10
    torch.testing.assert_close(d.x_train.mean(0), torch.zeros(64), atol=1e-5, rtol=0)
    torch.testing.assert_close(digits().x_test, d.x_test)  # fixed split
    m = mnist1d(num_samples=200, seed=3)
    assert m.x_train.shape == (160, 40) and m.x_test.shape == (40, 40)
    assert m.num_classes == 10
    torch.testing.assert_close(mnist1d(num_samples=200, seed=3).x_train, m.x_train)
    assert not torch.equal(mnist1d(num_samples=200, seed=4).x_train, m.x_train)


def test_classification_batches_deterministic() -> None:
    x, y = torch.randn(50, 3), torch.arange(50)
    first = [b[1] for b, _ in zip(batches(x, y, 16, 7), range(6), strict=False)]
    again = [b[1] for b, _ in zip(batches(x, y, 16, 7), range(6), strict=False)]
    other = [b[1] for b, _ in zip(batches(x, y, 16, 8), range(6), strict=False)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    # one epoch = 3 full batches without repetition, the next epoch reshuffles
    assert len(torch.cat(first[:3]).unique()) == 48
    assert not torch.equal(first[0], first[3])


def test_byte_corpora_and_windows() -> None:
    docs, code = pydoc_text(), stdlib_source(max_bytes=50_000)
    for text in (docs, code):
        assert text.dtype == torch.int64 and text.dim() == 1
        assert int(text.min()) >= 0 and int(text.max()) < 256
    assert len(code) == 50_000 and len(docs) > 100_000
    assert b"def " in bytes(code[:5000].tolist())
    w1 = next(byte_batches(docs, 4, 32, 5))
    w2 = next(byte_batches(docs, 4, 32, torch.Generator().manual_seed(5)))
    assert w1.shape == (4, 33) and torch.equal(w1, w2)
    x, y = next(lm_batches(docs, 4, 32, 5))
    assert torch.equal(x, w1[:, :-1]) and torch.equal(y, w1[:, 1:])


def test_train_hooks_and_last_mean() -> None:
    torch.manual_seed(0)
    d = digits()
    model = ResMLP(64, 10, width=16, depth=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    events: list[str] = []

    class Ctx:
        def __init__(self, step: int) -> None:
            self.step = step

        def __enter__(self) -> None:
            events.append(f"enter{self.step}")

        def __exit__(self, *exc: object) -> None:
            events.append(f"exit{self.step}")

    losses = train(
        model,
        batches(d.x_train, d.y_train, 64, 0),
        opt,
        30,
        around_step=Ctx,
        on_step=lambda step, m, o: events.append(f"after{step}"),
    )
    assert len(losses) == 30 and last_mean(losses, 5) < losses[0]
    assert events[:3] == ["enter0", "exit0", "after0"] and events[-1] == "after29"
    # divergence stops the run and scores inf
    model = ResMLP(64, 10, width=16, depth=2)
    sgd = torch.optim.SGD(model.parameters(), lr=1e6)
    losses = train(model, batches(d.x_train, d.y_train, 64, 0), sgd, 50)
    assert len(losses) < 50 and last_mean(losses, 10) == math.inf


def test_data_fractions_and_loss_windows_out_of_range_are_refused():
    # a negative test fraction split silently, train_split 1.5 gave an empty test set, and
    # last_mean(losses, 0) averaged the whole list (losses[-0:])
    from fslr_func.experiments.data import digits, split_bytes
    from fslr_func.experiments.train import last_mean

    with pytest.raises(ValueError, match=r"test_fraction must be a number in \(0, 1\)"):
        digits(test_fraction=-0.5)
    with pytest.raises(ValueError, match="test_fraction"):
        split_bytes(torch.arange(10), 1.5)
    for k in (0, -1):
        with pytest.raises(ValueError, match="k must be an int >= 1"):
            last_mean([1.0, 2.0, 3.0], k)
