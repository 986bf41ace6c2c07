"""Wrapper prefixes (``_orig_mod.``, ``module.``): records, FLeRM and state dicts meet on bare
names, so a record of any form of a model drives any other form (``fslr_func/names.py``)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.experiments import ResMLP
from fslr_func.probe.names import recorded_names, unwrapped

D_IN, CLASSES, LR0 = 8, 3, 1e-2


def stream(seed: int) -> Iterator[Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(16, D_IN, generator=g)


def batches(steps: int = 3) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(16, D_IN, generator=g), torch.randint(0, CLASSES, (16,), generator=g))
        for _ in range(steps)
    ]


def resmlp(depth: int = 2, *, width: int = 8, compiled: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = ResMLP(D_IN, CLASSES, width=width, depth=depth)
    return torch.compile(model, backend="eager") if compiled else model  # type: ignore[return-value]


def train(
    fm: ff.FSLRModule, controller: ff.Recorder | ff.FLeRM, opt: torch.optim.Optimizer
) -> None:
    with controller.attach():
        for x, y in batches():
            opt.zero_grad()
            nn.functional.cross_entropy(fm(x), y).backward()
            opt.step()


def record(model: nn.Module) -> ff.FSLRRecord:
    fm = ff.with_fslr(model, samples=2, seed=1)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    rec = ff.Recorder(fm, stream(3), optimizer=opt, warmup_samples=2, every=1)
    train(fm, rec, opt)
    return rec.record


def drive(model: nn.Module, base: ff.FSLRRecord, policy: str = "identity") -> ff.FLeRM:
    fm = ff.with_fslr(model, samples=2, seed=1)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = ff.FLeRM(
        fm,
        opt,
        base,
        probe_batches=stream(3),
        policy=policy,
        mode="periodic",
        every=1,
        warmup_samples=2,
    )
    train(fm, flerm, opt)
    return flerm


def renamed(rec: ff.FSLRRecord, prefix: str) -> ff.FSLRRecord:
    """``rec`` as if recorded on a wrapper adding ``prefix`` (a DDP model, an older record)."""
    data = rec.to_dict()
    text = repr(data)
    for name in rec.names:
        text = text.replace(repr(name), repr(prefix + name))
    return ff.FSLRRecord.from_dict(eval(text))


@pytest.fixture(scope="module")
def base() -> ff.FSLRRecord:
    return record(resmlp())


def rates(flerm: ff.FLeRM) -> list[float]:
    """FLeRM's rates at every set point, in one list."""
    return [lr for point in flerm.history for lr in point.lrs.values()]


def test_recorded_names_strip_only_leading_wrapper_prefixes() -> None:
    model = ["embed.weight", "blocks.0.module.weight", "head.weight"]
    assert recorded_names(
        ["module._orig_mod.embed.weight", "module._orig_mod.blocks.0.module.weight"], model
    ) == {
        "module._orig_mod.embed.weight": "embed.weight",
        "module._orig_mod.blocks.0.module.weight": "blocks.0.module.weight",
    }
    # a model whose own top-level submodule is called ``module``, recorded under DDP
    assert recorded_names(["module.module.w"], ["module.w"]) == {"module.module.w": "module.w"}
    assert recorded_names(["module.w"], ["module.w"]) == {"module.w": "module.w"}
    assert recorded_names(["other.w"], ["w"]) == {"other.w": "other.w"}  # left to the policy
    with pytest.raises(ValueError, match="read as one tensor"):
        recorded_names(["module.w", "_orig_mod.w"], ["v"])


def test_unwrapped_walks_compile_and_data_parallel_wrappers() -> None:
    inner = nn.Sequential(nn.Linear(2, 2))
    wrapped = torch.compile(nn.DataParallel(torch.compile(inner, backend="eager")), backend="eager")
    bare, prefix = unwrapped(wrapped)  # type: ignore[arg-type]
    assert bare is inner and prefix == "_orig_mod.module._orig_mod."
    assert {n for n, _ in wrapped.named_parameters()} == {
        prefix + n for n, _ in inner.named_parameters()
    }
    assert unwrapped(wrapped, data_parallel=False)[1] == "_orig_mod."  # type: ignore[arg-type]


def test_a_compiled_model_records_bare_names_and_the_same_values(base: ff.FSLRRecord) -> None:
    compiled = record(resmlp(compiled=True))
    assert compiled.names == base.names == [n for n, _ in resmlp().named_parameters()]
    assert compiled.meta["model"] == "ResMLP" and compiled.shapes == base.shapes
    for step in base.steps:
        assert compiled.at(step) == pytest.approx(base.at(step), rel=1e-6)


def test_an_uncompiled_record_drives_a_compiled_model_and_back(base: ff.FSLRRecord) -> None:
    plain = drive(resmlp(width=32), base)
    compiled = drive(resmlp(width=32, compiled=True), base)
    assert compiled.names == [f"_orig_mod.{n}" for n in plain.names]  # the live model's names
    assert len(plain.history) == 3 and len(set(rates(plain))) > 3  # per-tensor rates
    assert rates(compiled) == pytest.approx(rates(plain), rel=1e-6)
    from_compiled = drive(resmlp(width=32), record(resmlp(compiled=True)))
    assert rates(from_compiled) == pytest.approx(rates(plain), rel=1e-6)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_a_record_with_wrapper_prefixes_drives_a_plain_model(
    base: ff.FSLRRecord, prefix: str
) -> None:
    wrapped = renamed(base, prefix)
    assert wrapped.names == [prefix + n for n in base.names]
    assert rates(drive(resmlp(width=32), wrapped)) == rates(drive(resmlp(width=32), base))


def test_a_prefixed_record_drives_a_deeper_compiled_model_by_blocks(base: ff.FSLRRecord) -> None:
    deeper = drive(resmlp(depth=4, compiled=True), renamed(base, "module."), "share_blocks")
    targets = deeper.history[0].targets
    first = base.at(base.steps[0])
    assert targets["_orig_mod.blocks.0.linear.weight"] == pytest.approx(
        first["blocks.0.linear.weight"] / 2
    )
    assert targets["_orig_mod.readout.weight"] == pytest.approx(first["readout.weight"])


class Inner(nn.Module):
    """A model with its own submodules called ``module``, at the top and inside a block."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(D_IN, 6)
        self.norm = nn.BatchNorm1d(6)
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].module = nn.Linear(6, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks[0].module(self.norm(self.module(x)))


def trained(model: nn.Module, seed: int = 1) -> ff.FSLRModule:
    fm = ff.with_fslr(model, samples=2, seed=seed)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    x, y = batches(1)[0]
    nn.functional.cross_entropy(fm(x), y).backward()
    with fm.measure(opt, x):
        opt.step()
    return fm


def test_state_dict_keys_are_the_bare_models_and_load_both_ways() -> None:
    torch.manual_seed(0)
    fm = trained(Inner())
    state = fm.state_dict()
    assert list(state) == list(Inner().state_dict())  # inner `module.` names kept
    bare = Inner()
    assert not bare.load_state_dict(state).missing_keys  # strict: into the bare model
    assert all(torch.equal(v, state[k]) for k, v in bare.state_dict().items())
    other = ff.with_fslr(Inner(), samples=2, seed=5)
    other.load_state_dict(bare.state_dict())  # a bare model's: weights, no wrapper state
    assert torch.equal(other.module.module.weight, fm.module.module.weight) and other.fslr() == {}
    compiled = ff.with_fslr(torch.compile(Inner(), backend="eager"), samples=2, seed=5)
    assert list(compiled.state_dict()) == list(state)
    compiled.load_state_dict(state)  # the wrapper's state comes too, via the metadata
    assert compiled.generators["cpu"].get_state().equal(fm.generators["cpu"].get_state())
    assert compiled.fslr().keys() == {f"_orig_mod.{n}" for n in fm.fslr()}


def test_the_wrapper_state_round_trips_through_torch_save_and_a_parent_module() -> None:
    torch.manual_seed(0)
    fm = trained(Inner())
    buffer = io.BytesIO()
    torch.save(fm.state_dict(), buffer)
    buffer.seek(0)
    other = ff.with_fslr(Inner(), samples=2, seed=5)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert other.fslr() == fm.fslr()
    assert other.generators["cpu"].get_state().equal(fm.generators["cpu"].get_state())
    parent, twin = (
        nn.ModuleDict({"fm": fm}),
        nn.ModuleDict({"fm": ff.with_fslr(Inner(), samples=2)}),
    )
    assert list(parent.state_dict()) == [f"fm.{k}" for k in Inner().state_dict()]
    twin.load_state_dict(parent.state_dict())
    assert twin["fm"].fslr() == fm.fslr()


def test_a_wrapper_inside_a_wrapped_model_round_trips_its_state() -> None:
    """A backbone watched by its own wrapper inside the wrapped model: the inner wrapper's
    state was saved (in the metadata, under its bare path) but not restored, since torch
    looks a module's metadata up under its full path, behind the outer ``module.``."""

    def build(seed: int) -> ff.FSLRModule:
        torch.manual_seed(seed)
        inner = ff.with_fslr(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), seed=0)
        return ff.with_fslr(nn.Sequential(inner, nn.Tanh(), nn.Linear(3, 3)), samples=2, seed=1)

    outer = build(0)
    opt = torch.optim.SGD(outer.parameters(), lr=0.1)
    outer(torch.randn(16, 4)).square().mean().backward()
    with outer.measure(opt, torch.randn(8, 4)), outer.module[0].measure(opt, torch.randn(8, 4)):
        opt.step()
    buffer = io.BytesIO()
    torch.save(outer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    for _ in range(2):  # the dict is the user's: a second load of it works too
        loaded = build(5)
        loaded.load_state_dict(state)
        assert loaded.fslr() == outer.fslr() != {}
        assert loaded.module[0].fslr() == outer.module[0].fslr() != {}
        assert loaded.module[0].probes == outer.module[0].probes == 1
    # the wrapped model inside a parent module, which is what is loaded (a LightningModule)
    parent, twin = nn.ModuleDict({"fm": outer}), nn.ModuleDict({"fm": build(5)})
    twin.load_state_dict(parent.state_dict())
    assert twin["fm"].module[0].fslr() == outer.module[0].fslr() != {}


def test_a_state_of_another_configuration_needs_strict_false() -> None:
    fm = trained(Inner())
    other = ff.with_fslr(Inner(), samples=3)
    with pytest.raises(ValueError, match="another configuration"):
        other.load_state_dict(fm.state_dict())
    other.load_state_dict(fm.state_dict(), strict=False)
    assert other.fslr() == fm.fslr() and other.samples == 3


def test_a_state_saved_in_the_wrapper_form_still_loads() -> None:
    """Before names were bare, keys had ``module.`` and the wrapper's state was a key."""
    fm = trained(Inner())
    old = {f"module.{k}": v for k, v in fm.state_dict().items()}
    old["_extra_state"] = fm.get_extra_state()
    other = ff.with_fslr(Inner(), samples=2, seed=5)
    other.load_state_dict(old)
    assert other.fslr() == fm.fslr() and torch.equal(
        other.module.module.bias, fm.module.module.bias
    )
    plain: dict[str, Any] = {}  # a destination without metadata gets that form too
    assert set(fm.state_dict(destination=plain)) == set(old)
    ff.with_fslr(Inner(), samples=2).load_state_dict(plain)


def checkpointed(model: nn.Module) -> nn.Module:
    """``model`` with every block under ``checkpoint_wrapper`` (the FSDP recipe), which puts
    ``_checkpoint_wrapped_module.`` inside the blocks' tensor names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    blocks = set(model.blocks)  # type: ignore[arg-type]
    apply_activation_checkpointing(model, check_fn=lambda m: m in blocks)
    return model


def test_recorded_names_see_through_submodule_wrappers() -> None:
    wrapped = ["embed.weight", "layers.0._checkpoint_wrapped_module.w", "layers.1._orig_mod.w"]
    plain = ["embed.weight", "layers.0.w", "layers.1.w"]
    assert recorded_names(plain, wrapped) == dict(zip(plain, wrapped, strict=True))
    assert recorded_names(wrapped, plain) == dict(zip(wrapped, plain, strict=True))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the probe's fallback to autograd
def test_a_record_drives_a_model_with_activation_checkpoint_wrappers(
    base: ff.FSLRRecord,
) -> None:
    # FLeRM refused the wrapped model: "the base record and the scaled model have different
    # tensors: scaled tensors missing from the base record: ['blocks.0._checkpoint_wrapped_
    # module.linear.weight', ...]". Checkpointing changes no number: the rates are the plain
    # model's, and a record of the wrapped model drives the plain one.
    model = checkpointed(resmlp())
    assert any("_checkpoint_wrapped_module." in n for n, _ in model.named_parameters())
    want = rates(drive(resmlp(), base))
    torch.testing.assert_close(rates(drive(model, base)), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        rates(drive(resmlp(), record(checkpointed(resmlp())))), want, rtol=1e-6, atol=0
    )
