"""``exact``: the jvp ground truth against closed forms."""

from __future__ import annotations

import pytest
import torch
from conftest import MLP, random_delta
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fslr_func as ff


@given(n=st.integers(1, 5), k=st.integers(1, 4), d=st.integers(1, 5), seed=st.integers(0, 999))
def test_exact_of_a_linear_layer_is_the_rms_of_x_dw_transposed(n, k, d, seed):
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(d, k).double()
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    dw = torch.randn(k, d, generator=g, dtype=torch.float64)
    db = torch.randn(k, generator=g, dtype=torch.float64)
    got = ff.exact(model, x, {"weight": dw, "bias": db})
    torch.testing.assert_close(got["weight"], (x @ dw.T).square().mean().sqrt())
    torch.testing.assert_close(got["bias"], db.square().mean().sqrt())


def test_exact_is_the_first_order_output_change(double):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 5)
    delta = random_delta(model, scale=1.0)
    got = ff.exact(model, x, delta)
    params = dict(model.named_parameters())
    eps = 1e-6
    for name, d in delta.items():
        with torch.no_grad():
            base = model(x)
            params[name].add_(eps * d)
            moved = model(x)
            params[name].sub_(eps * d)
        finite_difference = ((moved - base) / eps).square().mean().sqrt()
        torch.testing.assert_close(got[name], finite_difference, rtol=1e-4, atol=0)


def test_exact_at_other_params_and_with_dict_output():
    model = MLP()
    delta = random_delta(model)
    shifted = {n: p.detach() + 1.0 for n, p in model.named_parameters()}
    a = ff.exact(model, torch.randn(3, 5), delta, params=shifted)
    b = ff.exact(model, torch.randn(3, 5), delta)
    assert any(not torch.isclose(a[n], b[n]) for n in a)
    out = ff.exact(
        nn.Sequential(model),
        torch.randn(3, 5),
        {"0." + n: d for n, d in delta.items()},
        output_fn=lambda o: o[:, :2],
    )
    assert set(out) == {"0." + n for n in delta}


@given(exponent=st.integers(-40, 40), seed=st.integers(0, 999))
def test_exact_of_a_half_precision_model_is_finite_where_the_float64_value_is(exponent, seed):
    # J dW of a float16 layer computed in float16 overflowed to inf (and an update cast to
    # float16 did, past 65504): exact runs the jvp on the update scaled by a power of two
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(4, 3).half()
    x = torch.randn(5, 4, generator=g).half()
    dw = torch.randn(3, 4, generator=g) * 2.0**exponent
    got = ff.exact(model, x, {"weight": dw})["weight"]
    want = (x.double() @ dw.double().T).square().mean().sqrt()
    torch.testing.assert_close(got, want, rtol=4e-3, atol=0)


def test_a_forward_mode_overflow_inside_a_half_precision_layernorm_falls_back():
    # LayerNorm's tangent holds rstd**3: past float16's maximum for an input spread of 0.02
    # (GPT-2's and BERT's embeddings at initialisation), where J dW itself is about 0.05;
    # exact raised "not finite ... compute exact on a float32 copy"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    nn.init.normal_(model[0].weight, std=0.02)
    model = model.half()
    x = torch.randint(0, 32, (4, 8))
    g = torch.Generator().manual_seed(1)
    delta = {
        n: 1e-2 * torch.randn(p.shape, generator=g).half() for n, p in model.named_parameters()
    }
    with pytest.warns(RuntimeWarning, match="forward-mode AD overflowed in torch.float16"):
        got = ff.exact(model, x, delta)
    want = ff.exact(model.double(), x, {n: d.double() for n, d in delta.items()})
    for n in delta:  # float16's precision
        torch.testing.assert_close(got[n], want[n], rtol=0.05, atol=0)


def test_exact_raises_where_a_half_precision_product_overflows_at_any_scale():
    model = nn.Linear(3, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1e-3)  # a finite output, 180
    x = torch.full((1, 3), 60000.0).half()  # J dW = x dW: 9e4 for dW scaled to 1/2
    with pytest.raises(ValueError, match="float32 copy"):
        ff.exact(model, x, {"weight": torch.ones(1, 3)})
