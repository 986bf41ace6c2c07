"""Block policies (``share_blocks``, ``equal``) with frozen tensors and tensors unfrozen late,
and records whose names are another wrapper's form: the mapping is the one the record was
made under, never shifted by a tensor frozen in both runs, and never an error mid-run."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

import fslr_func as ff
from fslr_func import FLeRM, Recorder


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"fc1": nn.Linear(width, width), "fc2": nn.Linear(width, width)})
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b["fc2"](torch.tanh(b["fc1"](h)))
        return self.head(h)


def probes() -> Iterator[Tensor]:
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(16, 8, generator=g)


def run(
    freeze: Callable[[str], bool],
    depth: int = 2,
    base: ff.FSLRRecord | None = None,
    policy: str = "identity",
    unfreeze_at: int | None = None,
    steps: int = 3,
    **flerm: object,
) -> Recorder | FLeRM:
    torch.manual_seed(0)
    net = Net(16, depth)
    for n, p in net.named_parameters():
        p.requires_grad_(not freeze(n))
    fm = ff.with_fslr(net, samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    ctl: Recorder | FLeRM = (
        Recorder(fm, probes(), optimizer=opt, every=2, warmup_samples=8)
        if base is None
        else FLeRM(fm, opt, base, probe_batches=probes(), policy=policy, warmup_samples=8, **flerm)  # type: ignore[arg-type]
    )
    g = torch.Generator().manual_seed(5)
    for t in range(steps):
        if t == unfreeze_at:
            net.requires_grad_(True)
        opt.zero_grad()
        fm(torch.randn(16, 8, generator=g)).square().mean().backward()
        with ctl.step():
            opt.step()
    return ctl


def frozen_fc2(name: str) -> bool:
    return ".fc2." in name


def frozen_first_block(name: str) -> bool:
    return name.startswith("blocks.0.")


@pytest.mark.parametrize("freeze", [frozen_fc2, frozen_first_block])
@pytest.mark.parametrize("policy", ["share_blocks", "equal"])
def test_a_tensor_frozen_in_both_runs_is_in_neither_stack(
    freeze: Callable[[str], bool], policy: str
) -> None:
    """A frozen ``fc2`` beside a trained ``fc1`` read as the same kind (numbers blanked) and
    was refused as "another architecture"; a frozen first block, which the record lacks, was
    counted in the scaled stack only, shifting the blocks' mapping (ratio 0.5 on the same
    model). The same model frozen the same way gets the base's rates back."""
    base = run(freeze).record
    flerm = run(freeze, base=base, policy=policy)
    assert isinstance(flerm, FLeRM)
    if policy == "share_blocks":
        assert flerm.ratios == pytest.approx(dict.fromkeys(flerm.ratios, 1.0), rel=1e-6)
    assert not any(freeze(n) for n in flerm.ratios)


def test_a_tensor_frozen_only_in_the_scaled_run_keeps_its_block_in_the_stack() -> None:
    """Trained in the base and frozen in the scaled run, a block is still part of the
    architecture: the other blocks answer to the base blocks of their own position."""
    base = run(lambda n: False).record
    flerm = run(frozen_first_block, base=base, policy="share_blocks")
    assert isinstance(flerm, FLeRM)
    assert flerm.ratios["blocks.1.fc1.weight"] == pytest.approx(1.0, rel=1e-6)


def test_tensors_unfrozen_late_under_share_blocks_are_held_not_an_error_mid_run() -> None:
    """Gradual unfreezing: the blocks joined at step 3, of a role the record lacks (its
    Recorder's columns are the first row's); ``share_blocks`` raised at that step's set point,
    mid-run, where ``identity`` holds them at their group's rate."""
    everything: Callable[[str], bool] = lambda n: n.startswith("blocks.")  # noqa: E731
    base = run(everything, unfreeze_at=3, steps=6).record
    assert not any(n.startswith("blocks.") for n in base.names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flerm = run(
            everything, 4, base, "share_blocks", unfreeze_at=3, steps=6, mode="periodic", every=2
        )
    assert isinstance(flerm, FLeRM) and flerm.t == 6
    assert not any(n.startswith("blocks.") for n in flerm.ratios)
    assert flerm.lrs()["blocks.0.fc1.weight"] == 1e-2  # held at its group's rate


def test_feature_matching_and_the_readout_scale_read_a_record_in_another_wrappers_names() -> None:
    """A record made under DDP's ``module.`` names: ``match="features"`` found no hidden
    tensor (it read the record's shapes by their raw names) and ``scale_readout`` no readout
    shape."""
    torch.manual_seed(0)
    fm = ff.with_fslr(Net(16, 2), samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, probes(), optimizer=opt, warmup_samples=8, feature_gains=True)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        opt.zero_grad()
        fm(torch.randn(16, 8, generator=g)).square().mean().backward()
        with rec.step():
            opt.step()
    data = rec.record.to_dict()
    prefixed = ff.FSLRRecord.from_dict(
        {
            **data,
            "fslr": {f"module.{n}": v for n, v in data["fslr"].items()},
            "lrs": {f"module.{n}": v for n, v in data["lrs"].items()},
            "meta": {
                **data["meta"],
                "shapes": {f"module.{n}": s for n, s in data["meta"]["shapes"].items()},
                "feature_gain": {f"module.{n}": v for n, v in data["meta"]["feature_gain"].items()},
            },
        }
    )
    factors = []
    for record in (rec.record, prefixed):
        torch.manual_seed(0)
        wide = ff.with_fslr(Net(64, 2), samples=4, seed=0)
        assert ff.scale_readout(wide, record, next(probes())) == pytest.approx(0.5)
        wide_opt = torch.optim.Adam(wide.parameters(), lr=1e-2)
        flerm = FLeRM(
            wide, wide_opt, record, probe_batches=probes(), warmup_samples=8, match="features"
        )
        wide_opt.zero_grad()
        wide(next(probes())).square().mean().backward()
        with flerm.step():
            wide_opt.step()
        factors.append(flerm.feature_factors)
    assert factors[0] and factors[0] == factors[1]


def test_in_a_deeper_model_the_trainable_stacks_are_mapped_whichever_block_is_frozen() -> None:
    """Base: 2 blocks, all trained; scaled: 4, one frozen in the scaled run only. By name
    alone a frozen ``blocks.1`` (recorded) stayed in the stack and ``blocks.3`` (not) left
    it: the other blocks' targets depended on which one was frozen."""
    base = run(lambda n: False).record
    stacks = []
    for frozen in ("blocks.1.", "blocks.3."):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flerm = run(lambda n, f=frozen: n.startswith(f), 4, base, "share_blocks")  # type: ignore[misc]
        assert isinstance(flerm, FLeRM)
        targets = flerm.history[0].targets
        stacks.append(
            [targets[f"blocks.{i}.fc1.weight"] for i in range(4) if f"blocks.{i}." != frozen]
        )
    assert stacks[0] == pytest.approx(stacks[1], rel=1e-9)
