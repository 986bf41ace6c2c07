"""Module coverage beyond the shared properties (``tests/probe/test_properties.py`` runs those
on every case of ``tests/cases.py``): ``estimate`` agrees with ``exact`` on the modules users
wrap.

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

from typing import Any

import pytest
import torch
from cases import CASES, Case, DictOut, TupleOut, build, jdw, mlp, quiet, x_of
from torch import nn

import fslr_func as ff
from fslr_func.probe.sampling import draw_omega, probe


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
        model, x, delta = build(Case(make, x_of(6, 4)))
        with pytest.raises(TypeError, match=hint):
            ff.estimate(model, x, delta)
        with pytest.raises(TypeError, match="output_fn"):
            ff.exact(model, x, delta)


def test_readout_is_found_through_dict_and_tuple_outputs() -> None:
    for make in (DictOut, TupleOut):
        model, x, delta = build(Case(make, x_of(6, 4)))
        fn = (lambda o: o["logits"]) if make is DictOut else (lambda o: o[0])
        r = probe(model, x, delta, samples=2, output_fn=fn)
        assert r.readout_module == "head"
        assert r.readout == {"head.weight": "weight", "head.bias": "bias"}


def test_a_forward_hook_that_replaces_the_heads_output_makes_it_no_readout() -> None:
    """Was: the readout search hooked after the user's hooks, saw the replaced output and
    took ``head`` as the readout, whose bias estimator then read 0.90 of ``exact`` for an
    output mixed across its rows; an observing hook (returning ``None``) changes nothing."""
    model, x, delta = build(Case(mlp, x_of(16, 4)))
    seen: list[torch.Tensor] = []
    handle = model[4].register_forward_hook(lambda m, i, o: seen.append(o))
    assert probe(model, x, delta, samples=2).readout_module == "4"
    handle.remove()
    mix = torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model[4].register_forward_hook(lambda m, i, o: o @ mix)
    r = probe(model, x, delta, samples=2)
    assert r.readout_module is None and r.readout == {} and seen
    est = ff.estimate(model, x, delta, samples=4000, generator=torch.Generator().manual_seed(0))
    exact = ff.exact(model, x, delta)
    # 4000 samples: the FSLR's relative standard error is about 1%; the readout bias
    # estimator's systematic error was 10%.
    assert abs(float(est["4.bias"] / exact["4.bias"]) - 1) < 0.05


class _NormalisedHead(nn.Linear):
    """A leaf head that normalises its own output units: no unit is a function of its row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).log_softmax(-1)


class _ScaledHead(nn.Linear):
    """muP's ``MuReadout``: the input scaled, each unit still a function of its own row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x / 4.0)


def test_a_leaf_head_that_mixes_its_output_units_gets_no_readout_estimators() -> None:
    """Was: any leaf with a ``(K, d)`` weight computing the output got the readout
    estimators, and the bias one read a uniform shift of a log-softmax head's bias as
    0.25-0.29 (``exact``: 0, the shift cancels). The head is still the readout layer (for
    ``scale_readout`` and feature gains); only the row-independent estimators are refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), _NormalisedHead(6, 5)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    shift = {"2.bias": torch.full((5,), 0.3, dtype=torch.float64)}
    found = probe(model, x, shift, samples=2)
    assert found.readout == {} and found.readout_module == "2"
    est = ff.estimate(model, x, shift, generator=torch.Generator().manual_seed(0))
    assert float(est["2.bias"]) < 1e-6 and float(ff.exact(model, x, shift)["2.bias"]) < 1e-6
    scaled = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), _ScaledHead(6, 5)).double()
    delta = {"2.weight": torch.randn(5, 6, dtype=torch.float64)}
    assert probe(scaled, x, delta, samples=2).readout == {"2.weight": "weight"}


class _CentredAfterHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(6, 6), nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.head(torch.tanh(self.body(x)))
        o -= o.mean(-1, keepdim=True)  # in place: the output is still the head's tensor
        return o


class _ReadoutReadAsEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.embedding(idx, self.head.weight))  # tied by a raw read


@pytest.mark.parametrize(
    ("make", "inputs", "readout", "output_fn"),
    [
        (_CentredAfterHead, lambda: torch.randn(8, 6), "auto", None),
        (_ReadoutReadAsEmbedding, lambda: torch.randint(0, 5, (8,)), "auto", None),
        # token 0 absent: moving row 0 alone moved nothing the embedding read
        (_ReadoutReadAsEmbedding, lambda: torch.randint(1, 5, (8,)), "auto", None),
        # the docs' advice for an output_fn that computes a new tensor: name the head
        (_CentredAfterHead, lambda: torch.randn(8, 6), "head", lambda o: o.log_softmax(-1)),
    ],
)
def test_output_units_mixed_after_the_head_give_no_readout_estimators(
    make: type[nn.Module], inputs: Any, readout: str, output_fn: Any
) -> None:
    """Was: the readout estimators read a shift of every logit, which the output ignores
    (``exact`` 0), as 0.9-1.1; the in-place centring, the raw read and the named head with a
    mixing ``output_fn`` all kept the row-independent estimators."""
    torch.manual_seed(0)
    model = make().double()
    x = inputs()
    if x.is_floating_point():
        x = x.double()
    # the head's weight is updated too: the check moves the tensors that would get a role
    shift = {"head.bias": torch.ones(5, dtype=torch.float64)}
    shift["head.weight"] = torch.zeros_like(model.head.weight)
    options = {"readout": readout, "output_fn": output_fn}
    assert probe(model, x, shift, samples=2, **options).readout == {}
    if make is _CentredAfterHead:  # the shift moves nothing there
        est = ff.estimate(model, x, shift, generator=torch.Generator().manual_seed(0), **options)
        assert float(est["head.bias"]) < 1e-6


class _InOutHead(nn.Module):
    """A square head stored as ``(in, out)``: ``h @ weight``, its rows are input units."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight


def test_a_square_head_whose_rows_are_input_units_gets_no_readout_estimators() -> None:
    """Input unit 0 is dead (a ReLU of a large negative): moving row 0 changed no output,
    so the check passed and the rows, which are not output units, got the estimators (0.64
    of ``exact`` on a rank-1 update)."""
    torch.manual_seed(0)
    body = nn.Linear(6, 5)
    with torch.no_grad():
        body.weight[0].zero_()
        body.bias[0] = -100.0
    model = nn.Sequential(body, nn.ReLU(), _InOutHead()).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    update = {"2.weight": torch.randn(5, 1, dtype=torch.float64) @ torch.randn(1, 5).double()}
    assert probe(model, x, update, samples=2).readout == {}


class _RunningNorm(nn.Module):
    """An input normaliser whose forward updates its buffer in place (train mode)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


def test_a_forward_updating_a_buffer_or_drawing_its_own_noise_keeps_the_readout() -> None:
    """The check of the output units ran its two forwards on one copy of the buffers (the
    second saw the first's update: every unit moved) and took a module's own generator's
    noise for mixing; a plain head lost its readout estimators for the whole run."""

    class OwnNoise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.generator = torch.Generator().manual_seed(0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0.1 * torch.randn(x.shape, generator=self.generator, dtype=x.dtype)

    for front in (_RunningNorm(6), OwnNoise()):
        torch.manual_seed(0)
        model = nn.Sequential(front, nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5)).double()
        delta = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        found = probe(model, torch.randn(8, 6, dtype=torch.float64), delta, samples=2)
        assert found.readout == {"3.weight": "weight", "3.bias": "bias"}


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


def test_a_scripted_submodule_stays_vmappable_after_torchscript_optimises_it() -> None:
    """Was: after two runs TorchScript's profiling executor swaps in a graph whose backward
    reads ``.data``, which vmap refuses: a pinned ``strategy="vmap"`` raised and ``"auto"``
    fell back to the loop, depending on how often the model had run before."""
    model, x, delta = build(CASES["scripted-submodules"])
    ref = probe(model, x, delta, samples=3, strategy="loop", generator=torch.Generator())
    for _ in range(4):  # the executor optimises the scripted graphs after their second run
        got = probe(model, x, delta, samples=3, strategy="vmap", generator=torch.Generator())
        for n, stats in ref.log_stats.items():
            torch.testing.assert_close(got.log_stats[n], stats, rtol=1e-10, atol=1e-12)
    assert ff.exact(model, x, delta).keys() == delta.keys()


def test_reset_forgets_the_readout_found_before_a_change_of_model() -> None:
    """``fm.reset()``, the call the docs name after a change of model, kept the readout roles
    of the first probe: with a layer appended after the old head, its bias kept the
    row-independent estimator (2.07x ``exact``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    delta = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    fm = ff.with_fslr(model, samples=4, seed=0)
    fm.observe(x, delta)
    assert fm.readout_roles == {"2.weight": "weight", "2.bias": "bias"}
    model.append(nn.Linear(3, 3).double().requires_grad_(False))  # '2' no longer the readout
    fm.reset()
    fm.observe(x, delta)
    assert fm.readout_roles == {}


class _SharedSubmodule(nn.Module):
    """One ``Linear`` registered as ``a`` and as ``b`` (PEFT's trainable tokens on tied
    embeddings share one module the same way)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("call", ["estimate", "exact", "measure"])
def test_a_submodule_under_two_names_keeps_its_parameters(call: str) -> None:
    """torch's ``functional_call`` restores a shared module's attributes once per name, the
    second time with the substituted tensor: after a probe the model held plain tensors,
    which the optimiser no longer updates (and ``exact`` left them frozen)."""
    torch.manual_seed(0)
    model, x = _SharedSubmodule(), torch.randn(4, 3)
    before = dict(model.named_parameters())
    delta = {n: 1e-2 * torch.randn_like(p) for n, p in before.items()}
    if call == "measure":
        fm = ff.with_fslr(model, samples=2, seed=0)
        opt = torch.optim.SGD(fm.parameters(), lr=0.1)
        fm(x).square().sum().backward()
        with fm.measure(opt, x):
            opt.step()
    else:
        getattr(ff, call)(model, x, delta)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is p and isinstance(p, nn.Parameter) for n, p in before.items())


class _AliasedBiasHead(nn.Module):
    """BERT's masked-LM head: the decoder's bias is also registered on the module above it,
    under which name ``named_parameters()`` gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(5))
        self.body, self.decoder = nn.Linear(4, 6), nn.Linear(6, 5, bias=False)
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.body(x)))


def test_a_readout_bias_registered_first_on_a_parent_gets_its_role() -> None:
    """The role was looked up as ``decoder.bias``, a name ``named_parameters()`` never gives
    (it gives ``bias``): BERT, RoBERTa and ALBERT masked-LM heads lost the bias's role, and
    its estimate spread 0.68-1.27 of ``exact`` over probes of 8 samples instead of 0.95-1.09."""
    torch.manual_seed(0)
    model = _AliasedBiasHead()
    delta = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    assert "bias" in delta and "decoder.bias" not in delta
    roles = probe(model, torch.randn(8, 4), delta, samples=2).readout
    assert roles == {"decoder.weight": "weight", "bias": "bias"}


@pytest.mark.parametrize(("dtype", "scale"), [(torch.bfloat16, 512.0), (torch.float16, 4096.0)])
def test_the_readout_check_moves_large_16_bit_rows_too(dtype: torch.dtype, scale: float) -> None:
    """The check moved the rows by 1, which a bfloat16 entry from 256 up (float16: 2048)
    absorbs: nothing moved, the other units were trivially the same, and an ``output_fn``
    that centres the units passed it."""
    torch.manual_seed(0)
    head = nn.Linear(4, 6).to(dtype)
    with torch.no_grad():
        head.weight.copy_(scale * (1 + 0.25 * torch.randint(-2, 3, head.weight.shape)))
        head.bias.fill_(scale)
    delta = {n: 1e-2 * torch.ones_like(p) for n, p in head.named_parameters()}
    x = 0.01 * torch.randn(3, 4).to(dtype)
    centred = lambda o: o - o.mean(-1, keepdim=True)  # noqa: E731
    assert probe(head, x, delta, samples=2, output_fn=centred, readout="").readout == {}
    assert probe(head, x, delta, samples=2, readout="").readout == {
        "weight": "weight",
        "bias": "bias",
    }


def test_no_readout_check_runs_where_no_tensor_could_get_a_role() -> None:
    """A head tied to the embedding and without a bias (GPT-2, T5, tied Llama) can get no
    role, yet the check ran its three extra forwards at the first probe (12 of 44 ms on T5)."""
    calls = []

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            calls.append(idx)
            return self.head(torch.tanh(self.emb(idx)))

    model = Tied()
    delta = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    assert probe(model, torch.randint(0, 7, (3, 5)), delta, samples=2).readout == {}
    assert len(calls) == 1
