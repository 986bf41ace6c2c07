"""Fallbacks: where torch.func cannot run a model, a slower path gives the same numbers.

* The probe's vjp cannot be traced (in-place update of a captured tensor, an autograd
  Function without ``setup_context``): plain autograd, one backward per sample.
* vmap over the vjp fails (a backward with data-dependent Python, e.g. ``.item()``): a loop.
* ``exact``'s forward-mode AD fails (the same models; ops without a forward formula): a double
  vjp with plain autograd.

Each fallback warns once (per model class and kind) with the path taken and the reason, and
the results equal those of the path chosen explicitly. Asking for a strategy explicitly
(``strategy="vmap"``) never falls back silently: it raises.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

import fslr_func as ff
import fslr_func.probe.fallback as probe_module
from fslr_func.probe.sampling import probe


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which fallbacks have already warned."""
    monkeypatch.setattr(probe_module, "_warned", set())


# ---------------------------------------------------------------------------------------------
# Models torch.func cannot fully handle, and their plain twins
# ---------------------------------------------------------------------------------------------


class Plain(nn.Module):
    """The reference: the same function with ordinary ops."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def act(self, h: Tensor) -> Tensor:
        return torch.tanh(h)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.act(self.a(x)))


class CapturedInPlace(Plain):
    """Keeps a running mean of activations in a plain tensor attribute (not a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = torch.zeros(6)

    def act(self, h: Tensor) -> Tensor:
        y = torch.tanh(h)
        self.seen.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y


class OldStyleTanh(torch.autograd.Function):
    """An autograd Function written the pre-torch.func way (ctx in forward, no setup_context)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class OldStyleFunction(Plain):
    def act(self, h: Tensor) -> Tensor:
        return OldStyleTanh.apply(h)


class ClippedTanh(torch.autograd.Function):
    """torch.func-ready (setup_context, jvp), but its backward reads ``.item()``: no vmap."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Tensor) -> None:
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        scale = min(1.0, 1e6 / max(g.abs().max().item(), 1e-30))  # never < 1 here
        return g * (1 - y * y) * scale

    @staticmethod
    def jvp(ctx: Any, t: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return t * (1 - y * y)


class NoBatchingRule(Plain):
    def act(self, h: Tensor) -> Tensor:
        return ClippedTanh.apply(h)


class AutocastAttention(Plain):
    """A forward that enters autocast itself (as accelerate's wrapper and Trainer(bf16=True)
    do) around attention: torch.func traces it, its backward then fails, and the probe
    retries with plain autograd after drawing the first chunk's omegas."""

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)[None, None]
        attended = nn.functional.scaled_dot_product_attention(h, h, h)[0, 0].float()
        return self.b(torch.tanh(attended))


def weight_normed() -> nn.Module:
    m = Plain()
    nn.utils.parametrizations.weight_norm(m.a)
    return m


def setup(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module, Tensor, dict[str, Tensor]]:
    torch.manual_seed(0)
    model, plain = cls(), Plain()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    g = torch.Generator().manual_seed(1)
    delta = {n: 1e-2 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    return model, plain, x, delta


def fallback_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


# ---------------------------------------------------------------------------------------------
# The probe
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "path", "reason"),
    [
        (CapturedInPlace, "autograd", "in-place operation"),
        (OldStyleFunction, "autograd", "setup_context"),
        (NoBatchingRule, "loop", r"\.item\(\)"),
    ],
)
def test_probe_falls_back_with_one_warning_and_the_same_result(
    cls: type[nn.Module], path: str, reason: str
) -> None:
    model, plain, x, delta = setup(cls)

    def run(m: nn.Module, strategy: str) -> Any:
        return probe(
            m, x, delta, samples=4, strategy=strategy, generator=torch.Generator().manual_seed(2)
        )

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = run(model, "auto")
        again = run(model, "auto")  # a second probe: no second warning
    messages = fallback_warnings(record)
    assert len(messages) == 1, messages
    assert path in messages[0] and cls.__name__ in messages[0]
    assert re.search(reason, messages[0])
    assert got.strategy == again.strategy == path
    reference = run(plain, "loop")
    for n in delta:
        torch.testing.assert_close(got.log_stats[n], reference.log_stats[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seeded", ["generator", "global seed"])
def test_a_retry_after_a_failed_backward_draws_the_same_omegas(seeded: str) -> None:
    # The first probe falls back after its torch.func backward failed, by which time it had
    # drawn omegas; the retry must draw the same ones, or the first probe of a seeded run
    # differs from every later one (log statistics differed by up to 6.4 before).
    model, _, x, delta = setup(AutocastAttention)

    def run() -> Any:
        if seeded == "generator":
            return probe(model, x, delta, samples=4, generator=torch.Generator().manual_seed(2))
        torch.manual_seed(2)
        return probe(model, x, delta, samples=4)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first, second = run(), run()
    assert first.strategy == second.strategy == "autograd"
    assert "torch.func backward" in fallback_warnings(record)[0]
    for n in delta:
        torch.testing.assert_close(first.log_stats[n], second.log_stats[n], rtol=0, atol=0)


@pytest.mark.parametrize("cls", [CapturedInPlace, OldStyleFunction])
def test_explicit_strategies_do_not_fall_back_and_the_loop_needs_no_torch_func(
    cls: type[nn.Module],
) -> None:
    model, _, x, delta = setup(cls)
    with pytest.raises(RuntimeError):
        probe(model, x, delta, samples=2, strategy="vmap")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chosen: no warning needed
        r = probe(model, x, delta, samples=2, strategy="autograd")
        looped = probe(model, x, delta, samples=2, strategy="loop")  # a loop needs no torch.func
    assert r.strategy == "autograd" and looped.strategy == "loop"


def test_an_explicit_vmap_strategy_does_not_fall_back_to_the_loop() -> None:
    model, _, x, delta = setup(NoBatchingRule)
    with pytest.raises(RuntimeError, match="item"):
        probe(model, x, delta, samples=2, strategy="vmap")
    assert probe(model, x, delta, samples=2, strategy="loop").strategy == "loop"


# ---------------------------------------------------------------------------------------------
# exact
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (CapturedInPlace, "in-place operation"),
        (OldStyleFunction, "setup_context"),
        (weight_normed, "forward AD"),
    ],
)
def test_exact_falls_back_to_a_double_vjp_with_one_warning(make: Any, reason: str) -> None:
    torch.manual_seed(0)
    model = make()
    x = torch.randn(5, 4)
    g = torch.Generator().manual_seed(1)
    delta = {n: 1e-2 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = ff.exact(model, x, delta)
        ff.exact(model, x, delta)
    messages = fallback_warnings(record)
    assert len(messages) == 1, messages
    assert "double vjp" in messages[0] and reason in messages[0]
    # The reference: J dW by central finite differences in float64 (independent of autograd).
    model64 = make()
    model64.load_state_dict(model.state_dict())
    model64.double()
    x64, eps = x.double(), 1e-6
    params = {n: p.detach() for n, p in model64.named_parameters()}
    for n, d in delta.items():

        def f(w: Tensor, n: str = n) -> Tensor:
            state = {**params, n: w}
            return torch.func.functional_call(model64, state, (x64,)).reshape(-1)

        fd = (f(params[n] + eps * d.double()) - f(params[n] - eps * d.double())) / (2 * eps)
        torch.testing.assert_close(got[n], fd.square().mean().sqrt(), rtol=1e-4, atol=1e-9)


class OnceDifferentiableTanh(OldStyleTanh):
    """:class:`OldStyleTanh` whose backward cannot itself be differentiated."""

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return OldStyleTanh.backward(ctx, g)


class OnceDifferentiable(Plain):
    def act(self, h: Tensor) -> Tensor:
        return OnceDifferentiableTanh.apply(h)


def test_exact_raises_where_no_path_exists_and_the_probe_still_works() -> None:
    # No forward-mode formula and a backward that cannot be differentiated: exact has no
    # slower path, and says so instead of returning a silent 0 for the tensors upstream.
    model, plain, x, delta = setup(OnceDifferentiable)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="once_differentiable"):
        warnings.simplefilter("ignore", RuntimeWarning)
        ff.exact(model, x, delta)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = probe(model, x, delta, samples=3, generator=torch.Generator().manual_seed(0))
    assert got.strategy == "autograd" and len(fallback_warnings(record)) == 1
    ref = probe(plain, x, delta, samples=3, generator=torch.Generator().manual_seed(0))
    for n in delta:
        torch.testing.assert_close(got.log_stats[n], ref.log_stats[n], rtol=1e-5, atol=1e-6)


def test_exact_without_a_fallback_matches_with_one() -> None:
    model, plain, x, delta = setup(OldStyleFunction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = ff.exact(model, x, delta)
    reference = ff.exact(plain, x, delta)
    for n in delta:
        torch.testing.assert_close(got[n], reference[n], rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------
# A training run never crashes where a slower path exists
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [CapturedInPlace, OldStyleFunction, NoBatchingRule])
def test_with_fslr_training_runs_through_with_one_warning(cls: type[nn.Module]) -> None:
    model, _, x, _ = setup(cls)
    fm = ff.with_fslr(model, samples=3, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    y = torch.randn(5, 3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            (fm(x) - y).square().mean().backward()
            with fm.measure(opt, [x, x]):
                opt.step()
    assert len(fallback_warnings(record)) == 1
    fslr = fm.fslr()
    assert set(fslr) == {n for n, _ in model.named_parameters()}
    assert all(bool(torch.isfinite(v)) and v > 0 for v in fslr.values())


class Checkpointed(Plain):
    """Activation checkpointing (non-reentrant): recomputes ``a`` and the activation."""

    def forward(self, x: Tensor) -> Tensor:
        def inner(x: Tensor) -> Tensor:
            return self.act(self.a(x))

        return self.b(torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False))


def test_activation_checkpointing_recomputes_with_the_probed_weights() -> None:
    # torch.func cannot run it; the autograd fallback's backward recomputes ``inner`` and
    # must see the probed weights (here the pre-step ones), not the module's current ones.
    model, plain, x, delta = setup(Checkpointed)
    g = torch.Generator().manual_seed(4)
    before = {
        n: p.detach() + 0.1 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()
    }
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = probe(
            model, x, delta, samples=3, params=before, generator=torch.Generator().manual_seed(0)
        )
        got_exact = ff.exact(model, x, delta, params=before)
    assert got.strategy == "autograd"
    assert ["could not trace" in w for w in fallback_warnings(record)] == [True]  # jvp runs
    ref = probe(
        plain, x, delta, samples=3, params=before, generator=torch.Generator().manual_seed(0)
    )
    ref_exact = ff.exact(plain, x, delta, params=before)
    for n in delta:
        torch.testing.assert_close(got.log_stats[n], ref.log_stats[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_exact[n], ref_exact[n], rtol=1e-5, atol=0)


def test_a_genuine_error_in_the_model_is_raised_not_hidden() -> None:
    class Broken(Plain):
        def act(self, h: Tensor) -> Tensor:
            return h @ torch.ones(7, 2)  # a shape bug: no path can run this

    model, _, x, delta = setup(Broken)
    for fn in (ff.estimate, ff.exact):
        with (
            pytest.raises(RuntimeError, match="shapes cannot be multiplied"),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore", RuntimeWarning)
            fn(model, x, delta)


def test_a_failed_collective_is_raised_not_retried_with_autograd() -> None:
    """A reduction whose collective fails must not be retried by the autograd fallback: the
    retry would issue collectives the other ranks never join."""
    import contextlib
    import warnings as _warnings

    import torch.distributed as dist

    from fslr_func.probe.sampling import OmegaSlice, probe

    class Failing:
        calls = 0

        def omega_slice(self, num_outputs, delta, samples, generator, chunk_size=None):  # type: ignore[no-untyped-def]
            return OmegaSlice(generator, num_outputs, 0, num_outputs)

        def reduce(self, grads):  # type: ignore[no-untyped-def]
            Failing.calls += 1
            raise dist.DistBackendError("the peer went away")

        def abort(self, delta, samples, chunk_size=None):  # type: ignore[no-untyped-def]
            pass

        def gathered(self, model, delta, params):  # type: ignore[no-untyped-def]
            return contextlib.nullcontext((delta, params))

    model = torch.nn.Linear(3, 2)
    delta = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    with _warnings.catch_warnings():
        _warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(dist.DistBackendError, match="went away"):
            probe(model, torch.randn(4, 3), delta, samples=4, reduction=Failing())
    assert Failing.calls == 1
