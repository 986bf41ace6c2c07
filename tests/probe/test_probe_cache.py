"""The probe's per-model cache of structural checks (fslr_func.probe.forward_cache.probe_signature).

A second one-shot probe of the same model, parameters, shapes and options skips the
connectivity check, the readout search and the name checks; anything that could change
their outcome must make it run them again.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import math
import weakref
from collections.abc import Callable

import pytest
import torch
from conftest import MLP, random_delta
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import fslr_func as ff
from fslr_func.probe import forward_cache, vjp


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the forwards that ran the connectivity check (one CutFinder per checked
    forward)."""
    made: list[int] = []
    original = vjp.CutFinder

    def counting(tensors: dict[str, Tensor]) -> vjp.CutFinder:
        made.append(1)
        return original(tensors)

    monkeypatch.setattr(vjp, "CutFinder", counting)
    return made


def estimate(model: nn.Module, x: Tensor, delta: dict[str, Tensor], **kw) -> dict[str, Tensor]:
    return ff.estimate(model, x, delta, samples=3, generator=torch.Generator().manual_seed(0), **kw)


def test_a_second_probe_skips_the_checks_and_gives_the_same_numbers(checks):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 5)
    delta = random_delta(model)
    first = estimate(model, x, delta)
    assert len(checks) == 1
    second = estimate(model, x, delta)
    assert len(checks) == 1  # nothing checked again
    assert first.keys() == second.keys()
    for n in first:
        assert torch.equal(first[n], second[n])
    # The readout found on the first probe is used by the second (row-independent variant).
    r = ff.probe.probe(model, x, delta, samples=2)
    assert r.readout == {"out.weight": "weight", "out.bias": "bias"}


Setup = tuple[nn.Module, Tensor, dict[str, Tensor]]


def _frozen(m: nn.Module, x: Tensor, d: dict[str, Tensor]) -> Setup:
    m.inp.bias.requires_grad_(False)
    return m, x, {n: t for n, t in d.items() if n != "inp.bias"}


def _replaced_parameter(m: nn.Module, x: Tensor, d: dict[str, Tensor]) -> Setup:
    m.hidden.weight = nn.Parameter(m.hidden.weight.detach().clone())
    return m, x, d


def _hooked(m: nn.Module, x: Tensor, d: dict[str, Tensor]) -> Setup:
    m.hidden.register_forward_hook(lambda mod, args, out: out * 1.0)
    return m, x, d


def _replaced_submodule(m: nn.Module, x: Tensor, d: dict[str, Tensor]) -> Setup:
    m.out = nn.Linear(7, 3)
    return m, x, d


def _submodule_mode(m: nn.Module, x: Tensor, d: dict[str, Tensor]) -> Setup:
    m.hidden.eval()
    return m, x, d


CHANGES: dict[str, Callable[[nn.Module, Tensor, dict[str, Tensor]], Setup]] = {
    "training mode": lambda m, x, d: (m.eval(), x, d),
    "a submodule's mode": _submodule_mode,
    "input shape": lambda m, x, d: (m, x[:4], d),
    "dtype": lambda m, x, d: (m.double(), x.double(), {n: t.double() for n, t in d.items()}),
    "the tensors probed": lambda m, x, d: (m, x, {"out.weight": d["out.weight"]}),
    "a replaced parameter": _replaced_parameter,
    "a frozen parameter": _frozen,
    "a forward hook": _hooked,
    "a replaced submodule": _replaced_submodule,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_anything_the_checks_depend_on_makes_them_run_again(checks, change):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 5)
    delta = random_delta(model)
    estimate(model, x, delta)
    model, x, delta = CHANGES[change](model, x, delta)
    estimate(model, x, delta)
    assert len(checks) == 2


class Switchable(nn.Module):
    """Reads a plain flag in its forward: with ``cut`` set, the middle layer runs without
    gradients (a reentrant-checkpoint-like cut, chosen after a first probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.cut = False

    def forward(self, x: Tensor) -> Tensor:
        if self.cut:
            with torch.no_grad():
                h = torch.tanh(self.a(x))
        else:
            h = torch.tanh(self.a(x))
        return self.b(h)


def test_a_flag_the_forward_branches_on_is_part_of_the_key():
    """Was a risk of the cache: a cut introduced after a first probe would read 0."""
    torch.manual_seed(0)
    model, x = Switchable(), torch.randn(5, 4)
    delta = random_delta(model)
    assert all(float(v) > 0 for v in estimate(model, x, delta).values())
    model.cut = True
    with pytest.raises(ValueError, match=r"cut \['a\.bias', 'a\.weight'\]"):
        estimate(model, x, delta)


class Mode(enum.Enum):
    PLAIN = 1
    CUT = 2


class EnumSwitchable(nn.Module):
    """:class:`Switchable` with its flag kept as an Enum."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.mode = Mode.PLAIN

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad() if self.mode is Mode.CUT else contextlib.nullcontext():
            h = torch.tanh(self.a(x))
        return self.b(h)


def test_an_enum_mode_the_forward_branches_on_is_part_of_the_key():
    """A mode kept as an Enum was invisible to the key: the first probe's checks were
    reused after the mode changed (a cut read 0; a readout whose units the new mode mixes
    kept its row-independent estimators, 1.7x ``exact``)."""
    torch.manual_seed(0)
    model, x = EnumSwitchable(), torch.randn(5, 4)
    delta = random_delta(model)
    assert all(float(v) > 0 for v in estimate(model, x, delta).values())
    model.mode = Mode.CUT
    with pytest.raises(ValueError, match=r"cut \['a\.bias', 'a\.weight'\]"):
        estimate(model, x, delta)


def test_values_are_checked_on_every_call():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 5)
    delta = random_delta(model)
    estimate(model, x, delta)
    bad = dict(delta, **{"hidden.weight": torch.full_like(delta["hidden.weight"], math.nan)})
    with pytest.raises(ValueError, match=r"NaN or Inf entries in \['hidden\.weight'\]"):
        estimate(model, x, bad)
    with pytest.raises(ValueError, match="probe batch has NaN"):
        estimate(model, torch.full_like(x, math.nan), delta)
    with pytest.raises(ValueError, match="did you mean"):
        estimate(model, x, {"hiden.weight": delta["hidden.weight"]})


def test_the_cache_does_not_keep_a_model_alive():
    model = MLP()
    estimate(model, torch.randn(8, 5), random_delta(model))
    assert model in forward_cache._known
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_at_most_a_few_signatures_are_kept_per_model():
    model = MLP()
    delta = random_delta(model)
    for batch in range(1, forward_cache.KNOWN_PER_MODEL + 4):
        estimate(model, torch.randn(batch, 5), delta)
    assert len(forward_cache._known[model]) == forward_cache.KNOWN_PER_MODEL
    forward_cache.forget(model)
    assert model not in forward_cache._known


def test_the_least_recently_used_signature_is_forgotten_first(
    checks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of varying lengths each have a signature; one probed again and again (the
    common length) stays known while others come and go."""
    monkeypatch.setattr(forward_cache, "KNOWN_PER_MODEL", 3)
    model = MLP()
    delta = random_delta(model)
    for batch in (1, 2, 3, 1, 4):  # 1 used again before 4 arrives: 2 is forgotten, not 1
        estimate(model, torch.randn(batch, 5), delta)
    before = len(checks)
    estimate(model, torch.randn(1, 5), delta)
    assert len(checks) == before  # known
    estimate(model, torch.randn(2, 5), delta)
    assert len(checks) == before + 1  # forgotten


class NonReentrant(nn.Module):
    """Activation checkpointing torch.func cannot trace (saved-tensor hooks): plain autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(checkpoint(self.a, x, use_reentrant=False)))


def test_a_model_torch_func_cannot_trace_goes_to_autograd_at_once_next_time(monkeypatch):
    torch.manual_seed(0)
    model, x = NonReentrant(), torch.randn(5, 4)
    delta = random_delta(model)
    tries: list[int] = []
    original = vjp._func_vjp

    def counting(*args, **kwargs):
        tries.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(vjp, "_func_vjp", counting)
    with pytest.warns(RuntimeWarning, match="falls back to plain autograd"):
        first = estimate(model, x, delta)
    second = estimate(model, x, delta)
    assert len(tries) == 1
    for n in first:
        assert torch.equal(first[n], second[n])
