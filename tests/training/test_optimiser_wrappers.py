"""Optimisers that step another one (Lookahead, SAM): the hooks form runs on the inner
optimiser's own step, so FLeRM's run is the wrapper around the inner optimiser at FLeRM's
per-tensor rates, and a Recorder records the inner step; a ``with`` block, which measures and
scales whatever the block moves, is refused with the way out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _tiny import backward, model, stream

import fslr_func as ff
from fslr_func.io.record import FSLRRecord
from fslr_func.training.recorder import Recorder


class Lookahead(torch.optim.Optimizer):
    """torch-optimizer's Lookahead (``.optimizer``), or timm's (``._base_optimizer``): every
    ``k`` steps the weights move half-way back to slow weights, a move that is no step of
    the inner optimiser."""

    def __init__(self, inner: torch.optim.Optimizer, attribute: str, k: int = 2) -> None:
        super().__init__(inner.param_groups, inner.defaults)
        setattr(self, attribute, inner)
        self.inner, self.k, self.count = inner, k, 0
        self.param_groups = inner.param_groups
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.inner.step()
        self.count += 1
        if self.count % self.k == 0:
            params = [p for g in self.param_groups for p in g["params"]]
            for p, s in zip(params, self.slow, strict=True):
                s.add_(p - s, alpha=0.5)
                p.copy_(s)


class SAM(torch.optim.Optimizer):
    """davda54/sam's two-call form: ``first_step`` moves the weights to ``w + e``,
    ``second_step`` puts them back and steps ``.base_optimizer``."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr, "rho": 0.05})
        self.base_optimizer = torch.optim.Adam(self.param_groups, lr=lr)
        self.param_groups = self.base_optimizer.param_groups
        self.old: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def first_step(self) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([p.grad.norm() for p in params]).norm()  # type: ignore[union-attr]
        for p in params:
            self.old[id(p)] = p.detach().clone()
            p.add_(p.grad * (0.05 / (norm + 1e-12)))  # type: ignore[operator]

    @torch.no_grad()
    def second_step(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in self.old:
                    p.copy_(self.old[id(p)])
        self.base_optimizer.step()


def sam_step(fm: torch.nn.Module, opt: SAM, t: int) -> None:
    opt.zero_grad()
    backward(fm, t)
    opt.first_step()
    opt.zero_grad()
    backward(fm, t)
    opt.second_step()


def lookahead_step(fm: torch.nn.Module, opt: Lookahead, t: int) -> None:
    opt.zero_grad()
    backward(fm, t)
    opt.step()


WRAPPERS: dict[str, tuple[Callable[..., Any], Callable[..., None]]] = {
    "Lookahead .optimizer": (
        lambda ps, lr: Lookahead(torch.optim.Adam(ps, lr=lr), "optimizer"),
        lookahead_step,
    ),
    "Lookahead ._base_optimizer": (
        lambda ps, lr: Lookahead(torch.optim.Adam(ps, lr=lr), "_base_optimizer"),
        lookahead_step,
    ),
    "SAM .base_optimizer": (SAM, sam_step),
}


def base_record(build: Callable[..., Any], step: Callable[..., None]) -> FSLRRecord:
    fm = model()
    opt = build(fm.parameters(), 1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)
    with rec.attach():
        for t in range(5):
            step(fm, opt, t)
    return rec.record


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_attached_flerm_is_the_wrapper_around_the_inner_step_at_flerms_rates(kind: str) -> None:
    """Static FLeRM without a schedule sets each tensor's rate once, at step 0: the run must
    be the wrapper around an inner optimiser with one param group per tensor at those rates.
    (Before, the hooks sat on SAM's own step, which its two-call form never calls: FLeRM
    never stepped; and a ``with`` block scaled Lookahead's move to its slow weights.)"""
    build, step = WRAPPERS[kind]
    base = base_record(build, step)
    fm = model(width=20)
    opt = build(fm.parameters(), 1e-2)
    flerm = ff.FLeRM(fm, opt, base, probe_batches=stream(3), warmup_samples=8)
    with flerm.attach():
        for t in range(5):
            step(fm, opt, t)
    assert flerm.t == 5
    lrs = flerm.history[0].lrs
    assert len(set(lrs.values())) > 1  # per-tensor rates, not the group's
    reference = model(width=20).module
    named = dict(reference.named_parameters())
    ref_opt = build([{"params": [named[n]], "lr": lr} for n, lr in lrs.items()], 1e-2)
    for t in range(5):
        step(reference, ref_opt, t)
    for name, p in fm.module.named_parameters():
        torch.testing.assert_close(p, named[name], rtol=1e-9, atol=1e-12, msg=name)


def test_attached_recorder_records_sams_inner_step_from_the_unperturbed_weights() -> None:
    """SAM's closure form (``step(closure)``: perturb, re-evaluate, restore, step) and its
    two-call form are one training run: attached, both record the same FSLRs."""
    two_call = base_record(*WRAPPERS["SAM .base_optimizer"])
    fm = model()
    opt = SAM(fm.parameters(), 1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)

    def closure_step(t: int) -> None:
        def closure() -> None:
            opt.zero_grad()
            backward(fm, t)

        closure()
        opt.first_step()
        closure()
        opt.second_step()

    with rec.attach():
        for t in range(5):
            closure_step(t)
    assert two_call.steps == rec.record.steps == [0, 2, 4]
    assert two_call == rec.record
    assert two_call.meta["optimizer"] == "Adam"  # the optimiser that steps


@pytest.mark.parametrize("kind", ["Recorder", "FLeRM"])
def test_a_with_block_around_a_stepping_wrapper_is_refused_with_attach_as_the_way(
    kind: str,
) -> None:
    build, _ = WRAPPERS["Lookahead .optimizer"]
    fm = model(width=20 if kind == "FLeRM" else 10)
    opt = build(fm.parameters(), 1e-2)
    controller: Recorder | ff.FLeRM = (
        ff.FLeRM(fm, opt, base_record(*WRAPPERS["SAM .base_optimizer"]), probe_batches=stream())
        if kind == "FLeRM"
        else Recorder(fm, stream(), optimizer=opt)
    )
    with pytest.raises(ValueError, match=r"Lookahead.*attach\(\)"):
        controller.step()
    plain = Recorder(model(), stream())
    with pytest.raises(ValueError, match=r"SAM.*attach\(\)"):
        plain.step(SAM(plain.fm.parameters(), 1e-2))  # type: ignore[arg-type]


def steps_recorded_in_with_blocks(
    fm: ff.FSLRModule, opt: torch.optim.Optimizer, wrapped: Any
) -> list[int]:
    """Three steps of ``opt``, each in a ``with`` block of a Recorder built over ``wrapped``."""
    rec = Recorder(fm, stream(), optimizer=wrapped, warmup_samples=8, every=2)
    for t in range(3):
        opt.zero_grad()
        backward(fm, t)
        with rec.step():
            opt.step()
    return rec.record.steps


def test_accelerates_and_lightnings_wrappers_still_work_in_a_with_block() -> None:
    """Wrappers that only delegate their step keep the ``with`` form."""
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    accelerated = type("AcceleratedOptimizer", (), {"__module__": "accelerate.optimizer"})()
    accelerated.optimizer = opt
    assert steps_recorded_in_with_blocks(fm, opt, accelerated) == [0, 2]


def test_lightnings_and_fabrics_own_wrapper_classes_keep_the_with_form() -> None:
    """Lightning and Fabric give each wrapper a class of its own (``LightningAdam``,
    ``FabricAdam``), which read as stepping wrappers and were refused in a ``with`` block."""
    lightning = pytest.importorskip("lightning")
    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    class Strategy:  # what the wrappers' step delegates to
        def optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            return optimizer.step(*args, **kwargs)

    assert lightning is not None
    for wrap in (LightningOptimizer, lambda o: _FabricOptimizer(o, Strategy())):
        fm = model()
        opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
        wrapped = wrap(opt)
        wrapped._strategy = Strategy()
        assert type(wrapped).__name__ in ("LightningAdam", "FabricAdam")
        assert steps_recorded_in_with_blocks(fm, opt, wrapped) == [0, 2]
