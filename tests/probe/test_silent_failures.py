"""Silent zeros and NaNs become errors; a measured step never reads the device; a saved
wrapper state only loads into a wrapper of the same configuration (issues 10 and 13)."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import fslr_func as ff
from fslr_func.experiments.models import ResMLP
from fslr_func.training.flerm import FLeRM
from fslr_func.training.recorder import Recorder


class Checkpointed(nn.Module):
    """A three-layer net whose middle (or first) layer runs under activation checkpointing."""

    def __init__(self, *, reentrant: bool, first: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.reentrant, self.first = reentrant, first

    def forward(self, x: Tensor) -> Tensor:
        ckpt = lambda f, t: checkpoint(f, t, use_reentrant=self.reentrant)  # noqa: E731
        h = torch.tanh(ckpt(self.a, x) if self.first else self.a(x))
        h = torch.tanh(self.b(h) if self.first else ckpt(self.b, h))
        return self.c(h)


class NoGradLayer(nn.Module):
    """The middle layer runs under ``torch.no_grad``: its parameters leave the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            skip = self.b(h)
        return self.c(h + skip)


def updates(model: nn.Module) -> dict[str, Tensor]:
    torch.manual_seed(1)
    return {n: 1e-2 * torch.randn_like(p) for n, p in model.named_parameters()}


ONE_SHOT: dict[str, Callable[..., Any]] = {
    "estimate": lambda m, x, d, **kw: ff.estimate(m, x, d, samples=2, **kw),
    "exact": lambda m, x, d, **kw: ff.exact(m, x, d, **kw),
}


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
@pytest.mark.parametrize("first", [False, True])
def test_reentrant_checkpointing_is_an_error_not_a_zero(func: str, first: bool) -> None:
    """Was: the checkpointed layer read exactly 0. torch raises for the inner segment itself
    in plain autograd; the probe's own check names the cut tensors first."""
    torch.manual_seed(0)
    model, x = Checkpointed(reentrant=True, first=first), torch.randn(6, 4)
    with pytest.raises((ValueError, RuntimeError), match="use_reentrant=False"):
        ONE_SHOT[func](model, x, updates(model))


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_non_reentrant_checkpointing_measures_the_checkpointed_layer(func: str) -> None:
    torch.manual_seed(0)
    model, x = Checkpointed(reentrant=False, first=True), torch.randn(6, 4)
    got = ONE_SHOT[func](model, x, updates(model))
    assert all(float(v) > 0 for v in got.values())


def test_measure_with_reentrant_checkpointing_raises_before_touching_the_ema() -> None:
    torch.manual_seed(0)
    fm = ff.with_fslr(Checkpointed(reentrant=True, first=True), samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    fm(torch.randn(6, 4)).sum().backward()
    with (
        pytest.raises(ValueError, match=r"cut \['a\.bias', 'a\.weight'\]"),
        fm.measure(opt, torch.randn(6, 4)),
    ):
        opt.step()
    assert fm.ema.log_m == {}


@pytest.mark.parametrize("strategy", ["vmap", "loop", "autograd"])
def test_torch_no_grad_inside_the_model_is_an_error_for_the_probe(strategy: Any) -> None:
    """Reverse mode cannot see through no_grad: the probe would read 0 for ``b``."""
    torch.manual_seed(0)
    model, x = NoGradLayer(), torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"cut \['b\.bias', 'b\.weight'\]"):
        ff.estimate(model, x, updates(model), samples=2, strategy=strategy)


def test_exact_sees_through_no_grad() -> None:
    """Forward-mode AD ignores no_grad: ``exact`` measures ``b`` (the function does move)."""
    torch.manual_seed(0)
    model, x = NoGradLayer(), torch.randn(6, 4)
    got = ff.exact(model, x, updates(model))
    assert float(got["b.weight"]) > 0 and float(got["b.bias"]) > 0


class DetachedView(nn.Module):
    """Detaches a view of its weight: part of it (``part=True``) or the whole transpose."""

    def __init__(self, part: bool) -> None:
        super().__init__()
        self.w, self.part = nn.Parameter(0.5 * torch.randn(6, 4)), part
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        w = torch.cat([self.w[:3].detach(), self.w[3:]]) if self.part else self.w.t().detach().t()
        return self.head(torch.tanh(x @ w.t()))


@pytest.mark.parametrize("func", ["vmap", "loop", "autograd", "exact"])
def test_a_detached_view_of_part_of_a_weight_warns_and_a_whole_one_is_an_error(
    func: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: ``w[:3].detach()`` made the movement of those rows read 0 in the probe and in
    ``exact`` with no word (a finite difference moves the output), and ``w.t().detach()``
    read ``w``'s FSLR as 0 instead of refusing it: views of a probed tensor were not
    followed."""
    import fslr_func.probe.fallback as fallback

    monkeypatch.setattr(fallback, "_warned", set())
    torch.manual_seed(0)
    x = torch.randn(6, 4)

    def run(model: nn.Module) -> dict[str, Tensor]:
        d = updates(model)
        if func == "exact":
            return ff.exact(model, x, d)
        return ff.estimate(model, x, d, samples=2, strategy=func)  # type: ignore[arg-type]

    with pytest.warns(RuntimeWarning, match=r"detached \['w'\].*read the movement"):
        assert float(run(DetachedView(part=True))["w"]) > 0
    with pytest.raises(ValueError, match=r"cut \['w'\]"):
        run(DetachedView(part=False))


class NormedUnderNoGrad(nn.Module):
    """Divides the head's output by its weight's norm, taken under ``torch.no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            norm = self.b.weight.norm()
        return self.b(torch.tanh(self.a(x))) / norm


def test_a_weight_used_under_no_grad_and_in_the_graph_warns_that_exact_disagrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Was silent: an update along ``b.weight`` moves the output only through the norm,
    which the probe cannot see (it read 2.2x exact, which matches a finite difference)."""
    import fslr_func.probe.fallback as fallback

    monkeypatch.setattr(fallback, "_warned", set())
    torch.manual_seed(0)
    model, x = NormedUnderNoGrad(), torch.randn(6, 4)
    with pytest.warns(RuntimeWarning, match=r"used \['b\.weight'\] under torch\.no_grad"):
        ff.estimate(model, x, updates(model), samples=2)


@pytest.mark.parametrize("strategy", ["vmap", "loop", "autograd"])
def test_module_backward_hooks_that_change_gradients_are_left_out_of_the_probe(
    strategy: Any,
) -> None:
    """Was: a backward hook scaling the gradient by 0.1 made every tensor before it read 0.1
    of ``exact`` (and a full backward hook made vmap fail over to plain autograd). The
    probe's forwards run without module backward hooks; the model keeps them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    calls: list[str] = []

    def scale(m: nn.Module, gi: Any, go: Any) -> tuple[Tensor]:
        calls.append("full")
        return (gi[0] * 0.1,)

    def scale_pre(m: nn.Module, go: Any) -> tuple[Tensor]:
        calls.append("pre")
        return (go[0] * 0.1,)

    model[1].register_full_backward_hook(scale)
    model[2].register_full_backward_pre_hook(scale_pre)
    x, delta = torch.randn(5, 4, dtype=torch.float64), updates(model)
    g = torch.Generator().manual_seed(0)
    est = ff.estimate(
        model, x, delta, samples=2000, estimator="full", generator=g, strategy=strategy
    )
    for n, want in ff.exact(model, x, delta).items():  # 2000 samples: ~3% sd of the FSLR
        torch.testing.assert_close(est[n], want, rtol=0.12, atol=0, msg=n)
    assert calls == []
    model(x).sum().backward()  # the model keeps its hooks
    assert calls == ["pre", "full"]


def test_a_tensor_hook_registered_in_the_forward_is_warned_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fslr_func.probe.fallback as fallback

    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.a(x))
            if h.requires_grad:
                h.register_hook(lambda grad: grad * 0.1)
            return self.b(h)

    monkeypatch.setattr(fallback, "_warned", set())
    torch.manual_seed(0)
    model, x = Hooked(), torch.randn(6, 4)
    with pytest.warns(RuntimeWarning, match=r"Tensor\.register_hook.*read 0\.1 of exact"):
        ff.estimate(model, x, updates(model), samples=2)


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_a_detached_output_fn_is_an_error(func: str) -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), torch.randn(6, 4)
    with pytest.raises(ValueError, match="does not depend on any of the measured parameters"):
        ONE_SHOT[func](model, x, updates(model), output_fn=lambda out: out.detach())


def test_a_detached_output_fn_is_refused_when_the_wrapper_is_used() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    fm = ff.with_fslr(net, samples=2, output_fn=lambda out: out.detach())
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    fm(torch.randn(6, 4)).sum().backward()
    with pytest.raises(ValueError, match="does not depend"), fm.measure(opt, torch.randn(6, 4)):
        opt.step()


class LoRA(nn.Module):
    """``y = base(x) + B A x`` with ``B = 0`` at init, and an unused head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 3)
        self.A = nn.Parameter(torch.randn(2, 4))
        self.B = nn.Parameter(torch.zeros(3, 2))
        self.unused = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + x @ self.A.T @ self.B.T


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_tensors_that_really_do_not_move_the_function_still_read_zero(func: str) -> None:
    """LoRA's A while B = 0, and a head the forward never uses: 0 is the right answer."""
    torch.manual_seed(0)
    model = LoRA()
    got = ONE_SHOT[func](model, torch.randn(6, 4), updates(model))
    assert float(got["A"]) == 0.0
    assert float(got["unused.weight"]) == 0.0
    assert float(got["B"]) > 0 and float(got["base.weight"]) > 0


class ScalesItsInput(nn.Module):
    """Normalises its input in place, as ``x.div_(255)`` in a vision or RL forward does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        x.div_(2.0)
        return self.b(torch.tanh(self.a(x)))


def test_a_forward_that_changes_its_input_in_place_neither_changes_nor_sees_a_changed_batch():
    # Every forward of the probe and of exact changed the caller's probe batch: exact (one
    # forward per tensor) measured each tensor on another input, and a probe batch reused
    # step after step drifted (here x / 2**k).
    torch.manual_seed(0)
    model, x = ScalesItsInput(), torch.randn(6, 4)
    kept, delta = x.clone(), updates(model)
    got = ff.exact(model, x, delta)
    assert torch.equal(x, kept)
    for name, update in delta.items():  # each tensor alone, on a fresh copy of the batch
        alone = ff.exact(model, kept.clone(), {name: update})[name]
        torch.testing.assert_close(got[name], alone, rtol=1e-12, atol=0)
    first = ff.estimate(model, x, delta, generator=torch.Generator().manual_seed(0))
    again = ff.estimate(model, x, delta, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, kept)
    assert all(torch.equal(first[n], again[n]) for n in delta)


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
@pytest.mark.parametrize("frozen", [False, True], ids=["probed", "frozen"])
def test_a_max_norm_embedding_keeps_its_weights(func: str, frozen: bool) -> None:
    # nn.Embedding(max_norm=...) renormalises the looked-up rows of its weight in place in
    # every forward: ff.estimate and ff.exact changed the caller's embedding (rows of norm
    # 1.2 to 2.7 cut to 1) for the tokens of the probe batch. Now they measure on a copy,
    # with the estimate of the renormalised function it computes.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6, max_norm=1.0), nn.Tanh(), nn.Linear(6, 3))
    ids = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(0))
    kept = model[0].weight.detach().clone()
    assert kept[ids.unique()].norm(dim=1).min() > 1.1  # the probe batch's rows would be cut
    delta = updates(model)
    if frozen:
        model[0].weight.requires_grad_(False)
        delta.pop("0.weight")
    got = ONE_SHOT[func](model, ids, delta)
    assert torch.equal(model[0].weight, kept)
    assert all(torch.isfinite(v) and v > 0 for v in got.values())


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_nan_inputs_are_named_and_an_inf_reaching_a_gradient_is_named(
    func: str,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(6, 4)
    x[2, 1] = math.nan
    with pytest.raises(ValueError, match="NaN entries in positional input 0"):
        ONE_SHOT[func](model, x, updates(model))
    with pytest.raises(ValueError, match="NaN entries in input x="):
        ONE_SHOT[func](model, {"x": x}, updates(model))
    x[2, 1] = math.inf  # tanh keeps the output finite; 0 * inf in the first weight's gradient
    with pytest.raises(ValueError, match=r"\['0.weight'\] are not finite.*Inf entries in \['posi"):
        ONE_SHOT[func](model, x, updates(model))


class MaskedAttention(nn.Module):
    """A causal self-attention language model's core: the mask, 0 and -inf, is an input."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 5)

    def forward(self, x: Tensor, mask: Tensor, memory: Tensor) -> Tensor:
        h = torch.cat([memory, x], dim=1)  # memory of length 0 at the sequence's start
        return self.head(self.layer(h, src_mask=mask))


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_an_infinite_mask_and_an_empty_memory_beside_the_batch_are_valid_inputs(
    func: str,
) -> None:
    """A causal mask of 0 and -inf (``generate_square_subsequent_mask``) and a memory of
    length 0 were refused as "NaN or Inf" and "an empty batch": the output is finite and the
    batch has examples. The FSLRs are those with the mask at a large finite negative."""
    torch.manual_seed(0)
    model = MaskedAttention().eval()
    x, memory = torch.randn(3, 5, 8), torch.zeros(3, 0, 8)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    assert torch.isinf(mask).any()
    delta = updates(model)

    def run(mask: Tensor) -> dict[str, Tensor]:
        seeded = {"generator": torch.Generator().manual_seed(0)} if func == "estimate" else {}
        inputs = {"x": x, "mask": mask, "memory": memory}
        return ONE_SHOT[func](model, inputs, delta, **seeded)  # type: ignore[no-any-return]

    got, want = run(mask), run(mask.clamp(min=-1e9))
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=0, msg=name)
    with pytest.raises(ValueError, match=r"probe batch is empty: input x="):
        ONE_SHOT[func](model, {"x": x[:0], "mask": mask[:0, :0], "memory": memory[:0]}, delta)


class Overflows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * 1e38 * 1e38  # inf in float32


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_an_output_that_overflows_is_an_error(func: str) -> None:
    model = Overflows()
    with pytest.raises(ValueError, match="output has NaN or Inf entries"):
        ONE_SHOT[func](model, torch.randn(6, 4), updates(model))


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_logits_masked_with_minus_inf_say_how_to_measure_the_finite_entries(func: str) -> None:
    """Invalid actions' logits set to -inf, as RL policies and vocabulary masks do: the
    error says to measure the finite entries, and its advice works."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5)), torch.randn(6, 4)
    mask = torch.tensor([True, False, False, True, False])

    def masked(out: Tensor) -> Tensor:
        return out.masked_fill(mask, -math.inf)

    with pytest.raises(ValueError, match=r"masked with -inf.*output_fn"):
        ONE_SHOT[func](model, x, updates(model), output_fn=masked)
    got = ONE_SHOT[func](
        model, x, updates(model), output_fn=lambda out: masked(out).masked_fill(mask, 0)
    )
    assert all(torch.isfinite(v) and v > 0 for v in got.values())


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_a_zero_size_batch_is_an_error(func: str) -> None:
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"probe batch is empty: positional input 0 .*\(0, 4\)"):
        ONE_SHOT[func](model, torch.randn(0, 4), updates(model))


class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + (self.empty @ x.T).sum()


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_a_zero_size_parameter_is_named(func: str) -> None:
    model = WithEmpty()
    with pytest.raises(ValueError, match=r"zero-size tensors \['empty'\].*requires_grad_"):
        ONE_SHOT[func](model, torch.randn(5, 4), updates(model))


def test_the_wrapper_leaves_zero_size_parameters_out() -> None:
    fm = ff.with_fslr(WithEmpty(), samples=2, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    fm(torch.randn(5, 4)).sum().backward()
    with fm.measure(opt, torch.randn(5, 4)) as m:
        opt.step()
    assert set(m.fslr) == {"lin.weight", "lin.bias"}


# ---------------------------------------------------------------- no host round-trips


HOST_READS = ["item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__"]
"""Every way a tensor's value reaches the host (on a GPU, each one a synchronisation)."""


@contextlib.contextmanager
def watching_host_reads(*, refuse: bool) -> Iterator[list[str]]:
    """Records every host read inside the block; with ``refuse``, each one raises."""
    saved = {n: getattr(Tensor, n) for n in HOST_READS}
    calls: list[str] = []

    def watched(name: str) -> Callable[..., Any]:
        def method(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            if refuse:
                raise AssertionError(f"Tensor.{name} called inside a probe: a host round-trip")
            return saved[name](self, *args, **kwargs)

        return method

    for n in HOST_READS:
        setattr(Tensor, n, watched(n))
    try:
        yield calls
    finally:
        for n, f in saved.items():
            setattr(Tensor, n, f)


def resmlp(strategy: str) -> ff.FSLRModule:
    torch.manual_seed(0)
    return ff.with_fslr(ResMLP(6, 3, width=16, depth=2), samples=4, seed=0, strategy=strategy)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
def test_a_measured_step_never_reads_the_device(strategy: str) -> None:
    fm = resmlp(strategy)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for _ in range(2):  # the first probe (strategy, readout detection) and a later one
        opt.zero_grad()
        nn.functional.cross_entropy(fm(x), y).backward()
        batches = [torch.randn(8, 6), torch.randn(8, 6)]
        with contextlib.ExitStack() as after_the_step, fm.measure(opt, batches) as m:
            opt.step()  # Adam reads its step count: not the probe's doing
            after_the_step.enter_context(watching_host_reads(refuse=True))
    with watching_host_reads(refuse=False) as calls:
        fslr = m.fslr
        assert m.left_out == ()
    assert calls == ["tolist"]  # reading the estimates: one synchronisation
    assert set(fslr) == set(m.delta) and all(v.device.type == "cpu" for v in fslr.values())
    assert {g for g in fm.generators} == {"cpu"}


def test_flerm_synchronises_once_per_set_point_and_never_between() -> None:
    base_fm = resmlp("vmap")
    # SGD reads nothing on the host itself (Adam reads its step count).
    opt = torch.optim.SGD(base_fm.parameters(), lr=1e-2, momentum=0.9)
    probes = (torch.randn(8, 6) for _ in range(1000))
    rec = Recorder(base_fm, probes, warmup_samples=4, every=2, optimizer=opt)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def train(fm: ff.FSLRModule, opt: torch.optim.Optimizer, ctl: Any) -> list[int]:
        reads = []
        for _ in range(4):
            opt.zero_grad()
            nn.functional.cross_entropy(fm(x), y).backward()
            with watching_host_reads(refuse=False) as calls, ctl.step():
                opt.step()
            reads.append(len(calls))
        return reads

    assert train(base_fm, opt, rec) == [1, 0, 1, 0]  # each recorded row: one read
    fm = resmlp("vmap")
    opt = torch.optim.SGD(fm.parameters(), lr=1e-2, momentum=0.9)
    probes = (torch.randn(8, 6) for _ in range(1000))
    flerm = FLeRM(fm, opt, rec.record, probe_batches=probes, mode="periodic", every=2)
    assert train(fm, opt, flerm) == [1, 0, 1, 0]


def test_two_wrappers_with_one_seed_draw_the_same_omegas() -> None:
    a, b = resmlp("vmap"), resmlp("vmap")
    x = torch.randn(8, 6)
    delta = {n: 1e-2 * torch.ones_like(p) for n, p in a.module.named_parameters()}
    assert a.observe(x, delta) == b.observe(x, delta)


# ---------------------------------------------------------------- state checked on load


def test_a_state_of_another_configuration_is_refused_unless_strict_is_off() -> None:
    """Was: a state saved with beta=0.9 loaded into with_fslr(beta=0.5) silently set 0.9."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    saved = ff.with_fslr(net, beta=0.9, samples=2, seed=0)
    saved.observe(torch.randn(6, 4), updates(net))
    state = saved.state_dict()
    other = ff.with_fslr(net, beta=0.5, samples=4, seed=0)
    with pytest.raises(ValueError, match=r"beta: this wrapper 0\.5, saved 0\.9; samples"):
        other.load_state_dict(state)
    assert other.ema.log_m == {}
    other.load_state_dict(state, strict=False)
    assert other.beta == 0.5 and other.ema.log_m.keys() == saved.ema.log_m.keys()
    same = ff.with_fslr(net, beta=0.9, samples=2, seed=5)
    same.load_state_dict(state)
    assert same.fslr() == saved.fslr()
    assert same.probes == 1


class SharedGradient(nn.Module):
    """``w`` and ``v`` enter the forward as ``w + v.view(...)``: autograd hands ``w`` the
    gradient of the sum and ``v`` a view of the same memory (as ``nn.LSTM`` hands its two
    biases one tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.v = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(12))
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(x @ (self.w + self.v.view(3, 4))))


@pytest.mark.parametrize("strategy", ["vmap", "loop", "autograd"])
@pytest.mark.parametrize("model", ["view", "lstm"])
def test_tensors_sharing_one_gradient_get_the_same_estimate(strategy: str, model: str) -> None:
    """Equal gradients and equal updates give equal estimates. The probe turned each
    gradient into its product with the update in place, so the second of two names sharing
    the gradient's memory read the first one's product: ``v`` read 0.67 of ``exact`` and an
    LSTM's ``bias_hh`` 0.2 of it."""
    torch.manual_seed(0)
    net: nn.Module
    if model == "view":
        net, x, fn, pair = SharedGradient(), torch.randn(5, 3), None, ("w", "v")
    else:
        net, x, pair = (
            nn.LSTM(3, 4, batch_first=True),
            torch.randn(2, 5, 3),
            ("bias_ih_l0", "bias_hh_l0"),
        )
        fn = lambda o: o[0]  # noqa: E731
    delta = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    delta[pair[1]] = delta[pair[0]].reshape(delta[pair[1]].shape).clone()
    est = ff.estimate(
        net, x, delta, samples=16, estimator="full", output_fn=fn, strategy=strategy,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    exact = ff.exact(net, x, delta, output_fn=fn)
    assert float(exact[pair[1]]) == pytest.approx(float(exact[pair[0]]), rel=1e-6)
    assert float(est[pair[1]]) == pytest.approx(float(est[pair[0]]), rel=1e-6)


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_a_parametrization_cache_of_the_users_is_not_read_by_the_probe(func: str) -> None:
    """Inside ``torch.nn.utils.parametrize.cached()`` (torch's advice for RNN loops) the
    forward read the weight cached from the module's parameter, not the one computed from
    the tensor the probe substitutes: the parametrization's FSLR read exactly 0."""
    parametrize = torch.nn.utils.parametrize
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    torch.nn.utils.parametrizations.orthogonal(model[2])
    x, delta = torch.randn(8, 4), updates(model)

    def run() -> dict[str, Tensor]:
        seeded = {"generator": torch.Generator().manual_seed(0)} if func == "estimate" else {}
        return ONE_SHOT[func](model, x, delta, **seeded)  # type: ignore[no-any-return]

    outside = run()
    with parametrize.cached():
        model(x)  # the user's forward fills the cache
        cached = parametrize._cache.copy()
        inside = run()
        assert parametrize._cache.keys() == cached.keys()  # the user's cache is kept
        assert all(parametrize._cache[k] is v for k, v in cached.items())
    name = "2.parametrizations.weight.original"
    assert float(outside[name]) > 0
    for n in outside:
        torch.testing.assert_close(inside[n], outside[n], rtol=1e-6, atol=0, msg=n)


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_params_of_another_floating_dtype_are_cast_and_integers_refused(func: str) -> None:
    """A float32 master copy of a bfloat16 model's weights as ``params`` raised torch's
    "mat1 and mat2 must have the same dtype" from inside the model; integer ``params`` raised
    "only Tensors of floating point dtype can require gradients"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.bfloat16)
    x, delta = torch.randn(6, 4, dtype=torch.bfloat16), updates(model)
    master = {n: p.detach().float() + 0.01 for n, p in model.named_parameters()}

    def run(params: dict[str, Tensor]) -> dict[str, Tensor]:
        seeded = {"generator": torch.Generator().manual_seed(0)} if func == "estimate" else {}
        return ONE_SHOT[func](model, x, delta, params=params, **seeded)  # type: ignore[no-any-return]

    got = run(master)
    want = run({n: p.to(torch.bfloat16) for n, p in master.items()})
    assert got == want
    with pytest.raises(ValueError, match=r"floating tensors; got '0.weight' \(torch.int64\)"):
        run(dict(master, **{"0.weight": master["0.weight"].long()}))


def test_observe_names_an_infinite_input_that_reaches_a_gradient_and_takes_a_mask() -> None:
    """``fm.observe`` (strict) refused every Inf input before; with masks allowed it must not
    drop a tensor whose statistics an Inf input made NaN with only a warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    fm = ff.with_fslr(model, samples=4, seed=0)
    x = torch.randn(6, 4)
    x[2, 1] = math.inf
    with pytest.raises(ValueError, match=r"\['0.weight'\] are not finite.*Inf entries in \['posi"):
        fm.observe(x, updates(model))
    masked = ff.with_fslr(MaskedAttention().eval(), samples=4, seed=0)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    inputs = {"x": torch.randn(3, 5, 8), "mask": mask, "memory": torch.zeros(3, 0, 8)}
    got = masked.observe(inputs, updates(masked.module))
    assert all(bool(torch.isfinite(v)) for v in got.values())


class Spelled(nn.Module):
    """A weight taken out of the graph by a spelling other than ``.detach()``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.how = how

    def forward(self, x: Tensor) -> Tensor:
        w = {
            "data": lambda: self.a.weight.data,
            "new_tensor": lambda: x.new_tensor(self.a.weight),
        }[self.how]()
        return self.b(torch.tanh(x @ w.T + self.a.bias))


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
@pytest.mark.parametrize("how", ["data", "new_tensor"])
def test_a_weight_read_through_data_or_copied_out_of_the_graph_is_refused(
    func: str, how: str
) -> None:
    """``w.data`` and ``x.new_tensor(w)`` read 0 silently, where ``w.detach()`` is refused."""
    model = Spelled(how)
    with pytest.raises(ValueError, match=r"cut \['a.weight'\] out of the autograd graph"):
        ONE_SHOT[func](model, torch.randn(5, 4), updates(model))


class StraightThrough(nn.Module):
    """A vector-quantising straight-through estimator: the codebook reaches the output only
    through ``(z_q - z).detach()`` (its own loss trains it)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.codebook, self.dec = (
            nn.Linear(4, 3),
            nn.Parameter(torch.randn(5, 3)),
            nn.Linear(3, 2),
        )

    def forward(self, x: Tensor) -> Tensor:
        z = self.enc(x)
        z_q = self.codebook[torch.cdist(z, self.codebook).argmin(-1)]
        return self.dec(z + (z_q - z).detach())


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_tensors_behind_a_detached_activation_are_named_once_and_training_goes_on(
    func: str,
) -> None:
    """``h.detach()`` on an activation (or ``h`` used under ``no_grad``) left the tensors
    behind it reading 0 without a word; a straight-through estimator does it by design, so
    it is a warning naming them, not an error."""
    torch.manual_seed(0)
    model = type(f"StraightThrough_{func}", (StraightThrough,), {})()  # warned once per class
    with pytest.warns(RuntimeWarning, match=r"activation of \['codebook'\] out of the autograd"):
        got = ONE_SHOT[func](model, torch.randn(6, 4), updates(model))
    assert float(got["codebook"]) == 0.0 and float(got["enc.weight"]) > 0
    fm = ff.with_fslr(StraightThrough(), samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            opt.zero_grad()
            fm(torch.randn(6, 4)).square().mean().backward()
            with fm.measure(opt, torch.randn(6, 4)):
                opt.step()
    assert fm.fslr()["enc.weight"] > 0


class SqrtWhere(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(torch.where(h > 0, h.sqrt(), torch.zeros_like(h)))


def test_an_estimate_that_comes_out_nan_from_finite_values_is_an_error() -> None:
    """``torch.where(h > 0, h.sqrt(), 0)``: sqrt's backward is NaN where ``h < 0``, so the
    estimate returned NaN, silently, from a finite batch, update and output."""
    torch.manual_seed(0)
    model = SqrtWhere()
    with pytest.raises(ValueError, match=r"not finite although the inputs.*clamp\(min=0\)"):
        ff.estimate(model, torch.randn(8, 4), updates(model), samples=2)


class ReadsMetadata(nn.Module):
    """A device-tracking parameter read for its dtype and device only (``.data.dtype``,
    ``new_tensor([...])``), and a weight whose statistic is logged through ``.data``."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.dummy.new_tensor([1.0, 2.0, 3.0])
        ones = torch.ones(3, dtype=self.dummy.data.dtype)
        self.logged = self.lin.weight.data.norm()  # a logged statistic, a value of .data
        return self.lin(x) * scale + ones + self.dummy


@pytest.mark.parametrize("func", sorted(ONE_SHOT))
def test_reading_a_weights_dtype_through_data_or_new_tensor_is_not_a_cut(func: str) -> None:
    """The first rule for ``.data`` and ``new_tensor`` refused any read of them, a dtype or
    a device included: a device-tracking parameter stopped the run at its first probe."""
    torch.manual_seed(0)
    model = type(f"ReadsMetadata_{func}", (ReadsMetadata,), {})()
    with pytest.warns(RuntimeWarning, match=r"detached \['lin.weight'\]"):
        got = ONE_SHOT[func](model, torch.randn(5, 4), updates(model))
    assert float(got["dummy"]) > 0 and float(got["lin.weight"]) > 0
