"""Parameters that join or leave a FLeRM run: adapters added after FLeRM was built (matched at
the next set point, or held at their group's rate with a note when the base record lacks
them), and tensors frozen in the scaled run (not "another architecture")."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import fslr_func as ff
from fslr_func.io.record import FSLRRecord

LR = 1e-2


class Net(nn.Module):
    def __init__(self, width: int, adapter: bool) -> None:
        super().__init__()
        torch.manual_seed(width)
        self.body = nn.Linear(6, width)
        self.head = nn.Linear(width, 3)
        self.adapter = nn.Linear(width, width) if adapter else None

    def add_adapter(self) -> nn.Linear:
        torch.manual_seed(1)
        self.adapter = nn.Linear(self.body.out_features, self.body.out_features)
        return self.adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if self.adapter is not None:
            h = h + self.adapter(h)
        return self.head(h)


def probes() -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    while True:
        yield torch.randn(16, 6, generator=g)


def step(fm: nn.Module, opt: torch.optim.Optimizer, ctl: ff.FLeRM | ff.Recorder, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(fm(x), y).backward()
    with ctl.step(opt) if isinstance(ctl, ff.Recorder) else ctl.step():
        opt.step()


def base(adapter: bool) -> FSLRRecord:
    fm = ff.with_fslr(Net(8, adapter), samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=LR)
    rec = ff.Recorder(fm, probes(), optimizer=opt, warmup_samples=8, every=1)
    for t in range(6):
        step(fm, opt, rec, t)
    return rec.record


def test_an_adapter_added_after_flerm_was_built_joins_at_the_next_set_point() -> None:
    net = Net(32, adapter=False)
    fm = ff.with_fslr(net, samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=LR)
    flerm = ff.FLeRM(
        fm, opt, base(adapter=True), probe_batches=probes(), warmup_samples=8,
        mode="periodic", every=2,
    )  # fmt: skip
    step(fm, opt, flerm, 0)
    assert "adapter.weight" not in flerm.names
    opt.add_param_group({"params": list(net.add_adapter().parameters())})
    for t in range(1, 3):
        step(fm, opt, flerm, t)
    assert [p.step for p in flerm.history] == [0, 2]
    assert {"adapter.weight", "adapter.bias"} <= set(flerm.ratios)
    assert flerm.history[-1].held == ()


def test_an_added_tensor_the_base_lacks_keeps_its_group_rate_with_a_note() -> None:
    net = Net(32, adapter=False)
    fm = ff.with_fslr(net, samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=LR)
    flerm = ff.FLeRM(
        fm, opt, base(adapter=False), probe_batches=probes(), warmup_samples=8,
        mode="periodic", every=2,
    )  # fmt: skip
    step(fm, opt, flerm, 0)
    opt.add_param_group({"params": list(net.add_adapter().parameters())})
    step(fm, opt, flerm, 1)
    with pytest.warns(RuntimeWarning, match=r"\['adapter.weight', 'adapter.bias'\] have no base"):
        step(fm, opt, flerm, 2)
    assert set(flerm.history[-1].held) == {"adapter.weight", "adapter.bias"}
    assert flerm.lrs()["adapter.weight"] == LR  # its group's rate
    assert "body.weight" in flerm.ratios  # the others are matched


def test_a_tensor_of_the_model_that_joins_the_optimiser_later_is_held_like_an_adapter() -> None:
    # Gradual unfreezing: the tensor is in the model from the start, but reaches the
    # optimiser by add_param_group after FLeRM was built, and the base record lacks it. The
    # set point after it joined raised the identity policy's "different tensors" error in
    # the middle of the run; it is held at its group's rate with a note, as a late adapter.
    net = Net(32, adapter=True)
    fm = ff.with_fslr(net, samples=4, seed=0)
    adapter = list(net.adapter.parameters())  # type: ignore[union-attr]
    opt = torch.optim.Adam([*net.body.parameters(), *net.head.parameters()], lr=LR)
    flerm = ff.FLeRM(
        fm, opt, base(adapter=False), probe_batches=probes(), warmup_samples=8,
        mode="periodic", every=2,
    )  # fmt: skip
    step(fm, opt, flerm, 0)
    opt.add_param_group({"params": adapter, "lr": 2 * LR})
    step(fm, opt, flerm, 1)
    with pytest.warns(RuntimeWarning, match=r"\['adapter.weight', 'adapter.bias'\] have no base"):
        step(fm, opt, flerm, 2)
    assert set(flerm.history[-1].held) == {"adapter.weight", "adapter.bias"}
    assert flerm.lrs()["adapter.weight"] == 2 * LR  # its group's rate
    assert "body.weight" in flerm.ratios


def test_a_tensor_frozen_in_the_scaled_run_is_not_another_architecture() -> None:
    net = Net(32, adapter=False)
    net.body.bias.requires_grad_(False)
    fm = ff.with_fslr(net, samples=4, seed=0)
    opt = torch.optim.Adam([p for p in fm.parameters() if p.requires_grad], lr=LR)
    record = base(adapter=False)
    # under every policy (share_blocks and equal refused it as "base tensors outside blocks
    # absent from the scaled model")
    for policy in ("identity", "share_blocks", "equal"):
        flerm = ff.FLeRM(fm, opt, record, probe_batches=probes(), warmup_samples=8, policy=policy)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(fm, opt, flerm, 0)
        assert set(flerm.ratios) == {"body.weight", "head.weight", "head.bias"}


def test_a_run_with_a_late_tensor_resumes_exactly_when_rebuilt_as_it_was_built() -> None:
    """Rebuilt with the late tensor's group in the optimiser from the start, FLeRM refuses the
    base record (it lacks that tensor) and says how to resume; rebuilt the way the run was
    (FLeRM first, the group added after), the resumed run matches the uninterrupted one."""
    record = base(adapter=False)

    def build(late_group: bool) -> tuple[Net, nn.Module, torch.optim.Optimizer]:
        net = Net(32, adapter=True)
        fm = ff.with_fslr(net, samples=4, seed=0)
        opt = torch.optim.Adam([*net.body.parameters(), *net.head.parameters()], lr=LR)
        if late_group:
            opt.add_param_group({"params": list(net.adapter.parameters()), "lr": 2 * LR})
        return net, fm, opt

    def flerm(fm: nn.Module, opt: torch.optim.Optimizer) -> ff.FLeRM:
        return ff.FLeRM(
            fm, opt, record, probe_batches=probes(), warmup_samples=8, mode="periodic", every=2
        )  # type: ignore[arg-type]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the held adapter's note
        net, fm, opt = build(late_group=False)
        ctl = flerm(fm, opt)
        step(fm, opt, ctl, 0)
        opt.add_param_group({"params": list(net.adapter.parameters()), "lr": 2 * LR})
        for t in (1, 2, 3):
            step(fm, opt, ctl, t)
        state = copy.deepcopy(
            {"fm": fm.state_dict(), "opt": opt.state_dict(), "flerm": ctl.state_dict()}
        )  # a checkpoint: the live state dicts hold the tensors that train on
        for t in (4, 5):
            step(fm, opt, ctl, t)

        _, fm2, opt2 = build(late_group=True)
        with pytest.raises(ValueError, match=r"adapter\.weight.*Build FLeRM as that run did"):
            flerm(fm2, opt2)

        net3, fm3, opt3 = build(late_group=False)
        resumed = flerm(fm3, opt3)
        opt3.add_param_group({"params": list(net3.adapter.parameters()), "lr": 2 * LR})
        fm3.load_state_dict(state["fm"])
        opt3.load_state_dict(state["opt"])
        resumed.load_state_dict(state["flerm"])
        for t in (4, 5):
            step(fm3, opt3, resumed, t)
    assert resumed.lrs() == ctl.lrs()
    for (n, p), (_, q) in zip(fm.named_parameters(), fm3.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_a_tensor_renamed_mid_run_keeps_its_rate_and_says_so() -> None:
    """``torch.nn.utils.prune`` renames ``0.weight`` to ``0.weight_orig`` (the same parameter,
    still in the optimiser). FLeRM went on reading the wrapper's average under the old name,
    which nothing updates any more, and set the rate from that frozen FSLR at every later set
    point, silently. It now keeps the tensor's rate and says why, once."""
    import torch.nn.utils.prune as prune

    def batches(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(8, 4, generator=g) for _ in range(30)]

    def train(fm: ff.FSLRModule, opt: torch.optim.Optimizer, ctl: Any, steps: range) -> None:
        for t in steps:
            opt.zero_grad()
            fm(batches(t)[0]).square().mean().backward()
            with ctl.step():
                opt.step()

    def net(width: int) -> nn.Module:
        torch.manual_seed(width)
        return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))

    small = ff.with_fslr(net(8), samples=2, seed=0)
    opt = torch.optim.Adam(small.parameters(), lr=1e-2)
    rec = ff.Recorder(small, batches(99), optimizer=opt, warmup_samples=2, every=2)
    train(small, opt, rec, range(8))
    fm = ff.with_fslr(net(32), samples=2, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    flerm = ff.FLeRM(
        fm, opt, rec.record, probe_batches=batches(98), mode="periodic", every=2, warmup_samples=2
    )
    train(fm, opt, flerm, range(2))
    rate = flerm.lrs()["0.weight"]
    prune.l1_unstructured(fm.module[0], "weight", amount=0.75)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(fm, opt, flerm, range(2, 7))
    said = [str(w.message) for w in seen if "no longer the model's tensors" in str(w.message)]
    assert len(said) == 1 and "'0.weight'" in said[0]
    assert [p.step for p in flerm.history] == [0, 2, 4, 6]
    assert all("0.weight" in p.held for p in flerm.history[1:])
    assert flerm.lrs()["0.weight"] == pytest.approx(rate)
