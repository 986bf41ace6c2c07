"""Bad inputs: every one gets a clear error naming the problem, and nothing passed is modified.

Each row of ``BAD`` is a mistake a user can make; it is tried on ``estimate``, ``exact``,
``probe`` and the ``with_fslr`` wrapper where the argument exists. After every call (failed or
not) the model's parameters, buffers and ``requires_grad`` flags, the ``delta`` and ``params``
tensors and the inputs are compared with copies taken before.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.probe.sampling import probe


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.norm = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.norm(self.body(x))))


def make() -> tuple[nn.Module, Tensor, dict[str, Tensor]]:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(6, 4)
    delta = {n: 1e-2 * torch.randn_like(p) for n, p in model.named_parameters()}
    return model, x, delta


@dataclass
class Snapshot:
    """Deep copies of everything a call could modify."""

    objects: dict[str, Any]
    flags: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module, **objects: Any) -> Snapshot:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        return cls({"state": state, **copy.deepcopy(objects)}, flags)

    def check(self, model: nn.Module, **objects: Any) -> None:
        now = Snapshot.of(model, **objects)
        assert now.flags == self.flags
        assert set(now.objects) == set(self.objects)
        for key, before in self.objects.items():
            assert_same(now.objects[key], before, key)


def assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.nan_to_num(1.5, 2.5, -2.5), b.nan_to_num(1.5, 2.5, -2.5)), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_same(u, v, f"{where}[{i}]")
    else:
        assert a == b, where


def bad_delta(change: Callable[[dict[str, Tensor]], Any]) -> Callable[..., dict[str, Any]]:
    def build(model: nn.Module, x: Tensor, delta: dict[str, Tensor]) -> dict[str, Any]:
        d = {n: t.clone() for n, t in delta.items()}
        return {"delta": change(d)}

    return build


def _rename(d: dict[str, Tensor], old: str, new: str) -> dict[str, Tensor]:
    d[new] = d.pop(old)
    return d


def _set(d: dict[str, Tensor], name: str, value: Any) -> dict[str, Tensor]:
    d[name] = value
    return d


def _poison(d: dict[str, Tensor], name: str, value: float) -> dict[str, Tensor]:
    d[name][0, 0] = value
    return d


# name -> (what to pass, functions it applies to, exception, message pattern)
FUNCS = ("estimate", "exact", "probe", "observe")
DELTA_ROWS: dict[str, tuple[Callable[..., dict[str, Any]], type[Exception], str]] = {
    "misspelled name": (
        bad_delta(lambda d: _rename(d, "head.weight", "head.wieght")),
        ValueError,
        r"'head\.wieght': did you mean \['head\.weight'",
    ),
    "unknown name": (
        bad_delta(lambda d: _set(d, "decoder.weight", torch.zeros(3, 5))),
        ValueError,
        r"(?s)not trainable parameters of the model.*'decoder\.weight'",
    ),
    "buffer name": (
        bad_delta(lambda d: _set(d, "norm.running_mean", torch.zeros(5))),
        ValueError,
        r"'norm\.running_mean'",
    ),
    "wrong shape": (
        bad_delta(lambda d: _set(d, "head.weight", torch.zeros(5, 3))),
        ValueError,
        r"'head\.weight': \(5, 3\) != \(3, 5\)",
    ),
    "NaN update": (
        bad_delta(lambda d: _poison(d, "body.weight", math.nan)),
        ValueError,
        r"NaN or Inf entries in \['body\.weight'\]",
    ),
    "Inf update": (
        bad_delta(lambda d: _poison(d, "head.weight", -math.inf)),
        ValueError,
        r"NaN or Inf entries in \['head\.weight'\]",
    ),
    "empty delta": (bad_delta(lambda d: {}), ValueError, "delta is empty"),
    "delta not a dict": (
        bad_delta(lambda d: list(d.values())),
        TypeError,
        "delta must be a dict",
    ),
    "delta value not a tensor": (
        bad_delta(lambda d: _set(d, "head.bias", [0.0, 0.0, 0.0])),
        TypeError,
        r"'head\.bias': list",
    ),
}


def call(func: str, model: nn.Module, x: Any, delta: Any, **kw: Any) -> Any:
    gen = torch.Generator().manual_seed(0)
    if func == "estimate":
        return ff.estimate(model, x, delta, samples=kw.pop("samples", 2), generator=gen, **kw)
    if func == "exact":
        return ff.exact(model, x, delta, **kw)
    if func == "probe":
        return probe(model, x, delta, samples=kw.pop("samples", 2), generator=gen, **kw)
    if func == "observe":
        return ff.with_fslr(model, samples=2, seed=0, **kw).observe(x, delta)
    raise AssertionError(func)


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("row", sorted(DELTA_ROWS))
def test_bad_delta(row: str, func: str) -> None:
    build, exc, pattern = DELTA_ROWS[row]
    model, x, delta = make()
    kwargs = build(model, x, delta)
    snap = Snapshot.of(model, x=x, kwargs=kwargs)
    with pytest.raises(exc, match=pattern):
        call(func, model, x, kwargs["delta"])
    snap.check(model, x=x, kwargs=kwargs)


@pytest.mark.parametrize("func", ["estimate", "exact", "probe"])
@pytest.mark.parametrize("row", ["misspelled name", "wrong shape", "NaN update", "Inf update"])
def test_bad_params_are_checked_like_delta(row: str, func: str) -> None:
    build, exc, pattern = DELTA_ROWS[row]
    model, x, delta = make()
    params = build(model, x, {n: p.detach().clone() for n, p in model.named_parameters()})
    snap = Snapshot.of(model, x=x, delta=delta, params=params)
    with pytest.raises(exc, match=pattern.replace("delta", "params")):
        call(func, model, x, delta, params=params["delta"])
    snap.check(model, x=x, delta=delta, params=params)


OPTION_ROWS: dict[str, tuple[tuple[str, ...], dict[str, Any], type[Exception], str]] = {
    "samples=0": (("estimate", "probe"), {"samples": 0}, ValueError, "samples must be a positive"),
    "samples=-3": (("estimate", "probe"), {"samples": -3}, ValueError, "samples must be"),
    "samples=2.5": (("estimate", "probe"), {"samples": 2.5}, ValueError, "samples must be"),
    "unknown estimator": (
        ("estimate",),
        {"estimator": "kfac"},
        ValueError,
        "unknown estimator 'kfac'; choose one of kron, full, iid",
    ),
    "unknown omega": (
        ("estimate", "probe"),
        {"omega": "uniform"},
        ValueError,
        "unknown omega 'uniform'; choose one of gaussian, rademacher",
    ),
    "unknown strategy": (
        ("estimate", "probe"),
        {"strategy": "jit"},
        ValueError,
        "unknown strategy 'jit'",
    ),
    "unknown grouping": (
        ("estimate", "probe"),
        {"grouping": "rows"},
        ValueError,
        "unknown grouping 'rows'; choose one of auto, dims, matrix",
    ),
    "bad grouping callable": (
        ("estimate", "probe"),
        {"grouping": lambda n, s: (7,)},
        ValueError,
        r"grouping\('body\.weight', \(5, 4\)\) did not return a view shape",
    ),
    "chunk_size=0": (("estimate", "probe"), {"chunk_size": 0}, ValueError, "chunk_size must be"),
    "unknown readout": (
        ("estimate", "probe"),
        {"readout": "haed"},
        ValueError,
        r"readout='haed' is not a module of the model; did you mean \['head'\]",
    ),
    "readout without weights": (
        ("estimate", "probe"),
        {"readout": ""},
        ValueError,
        r"readout='' is a Net without a weight or bias tensor of its own.*\['body', 'norm', "
        r"'head'\]",
    ),
    "forward_seed not an int": (
        ("estimate", "exact", "probe"),
        {"forward_seed": 1.5},
        TypeError,
        "forward_seed must be None or an int",
    ),
    "forward_seed outside torch's range": (
        ("estimate", "exact", "probe"),
        {"forward_seed": 2**64},
        ValueError,
        r"forward_seed must be in \[-2\*\*63, 2\*\*64\) \(a torch seed\)",
    ),
}


@pytest.mark.parametrize(
    ("row", "func"),
    [(row, func) for row, (funcs, *_) in sorted(OPTION_ROWS.items()) for func in funcs],
)
def test_bad_options(row: str, func: str) -> None:
    _, kwargs, exc, pattern = OPTION_ROWS[row]
    model, x, delta = make()
    snap = Snapshot.of(model, x=x, delta=delta)
    with pytest.raises(exc, match=pattern):
        call(func, model, x, delta, **kwargs)
    snap.check(model, x=x, delta=delta)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"samples": 0}, "samples must be a positive integer"),
        ({"estimator": "kfac"}, "unknown estimator 'kfac'"),
        ({"omega": "uniform"}, "unknown omega 'uniform'"),
        ({"strategy": "jit"}, "unknown strategy 'jit'"),
        ({"grouping": "rows"}, "unknown grouping 'rows'"),
        ({"beta": 1.0}, r"beta must be in \[0, 1\)"),
        ({"beta": -0.1}, r"beta must be in \[0, 1\)"),
        ({"beta": "0.9"}, r"beta must be in \[0, 1\), a number, got '0.9'"),
        ({"beta": math.nan}, r"beta must be in \[0, 1\)"),
        (
            {"forward_seed": -(2**63) - 1},
            r"forward_seed must be in \[-2\*\*63, 2\*\*64\) \(a torch seed\)",
        ),
        (
            {"seed": 2**64},
            r"seed must be in \[-2\*\*63, 2\*\*64\) \(a torch seed\), got 1844674407370955161",
        ),
    ],
)
def test_with_fslr_rejects_bad_options_at_construction(
    kwargs: dict[str, Any], pattern: str
) -> None:
    model, _, _ = make()
    snap = Snapshot.of(model)
    with pytest.raises(ValueError, match=pattern):
        ff.with_fslr(model, **kwargs)
    snap.check(model)


@pytest.mark.parametrize("func", ["estimate", "probe"])
@pytest.mark.parametrize("generator", [0, "cpu"])
def test_a_seed_passed_as_the_generator_is_a_clear_error(func: str, generator: Any) -> None:
    # It failed deep inside the sampling loop with "'int' object has no attribute 'device'".
    model, x, delta = make()
    fn = ff.estimate if func == "estimate" else probe
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator.*manual_seed"):
        fn(model, x, delta, generator=generator)


def test_a_model_without_trainable_parameters() -> None:
    model, x, delta = make()
    model.requires_grad_(False)
    snap = Snapshot.of(model, x=x, delta=delta)
    for func in ("estimate", "exact", "probe"):
        with pytest.raises(ValueError, match="no trainable parameters"):
            call(func, model, x, delta)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ff.with_fslr(model)
    snap.check(model, x=x, delta=delta)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ff.estimate(nn.ReLU(), x, {})


def test_inputs_of_the_wrong_kind() -> None:
    model, x, delta = make()
    snap = Snapshot.of(model, x=x, delta=delta)
    for func in ("estimate", "exact", "probe"):
        with pytest.raises(TypeError, match="inputs must be a Tensor, a tuple"):
            call(func, model, [x], delta)  # a list is not a tuple of arguments
        with pytest.raises(TypeError, match="inputs must be"):
            call(func, model, x.numpy(), delta)
    snap.check(model, x=x, delta=delta)


def test_inputs_the_model_rejects_raise_the_models_error() -> None:
    model, x, delta = make()
    for func in ("estimate", "exact"):
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            call(func, model, x[:, :3], delta)


def test_measure_with_an_optimiser_over_other_parameters() -> None:
    model, x, _ = make()
    fm = ff.with_fslr(model, samples=2, seed=0)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with (
        pytest.raises(ValueError, match="updates none of the module's trainable parameters"),
        fm.measure(other, x),
    ):
        pass
    frozen_lr = torch.optim.SGD(fm.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="every learning rate is 0"), fm.measure(frozen_lr, x):
        pass


def test_a_nan_step_is_reported_and_the_wrapper_state_is_unchanged() -> None:
    model, x, _ = make()
    fm = ff.with_fslr(model, samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    model(x).sum().backward()
    with fm.measure(opt, x):
        opt.step()
    ema = {k: v.clone() for k, v in fm.ema.value().items()}
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    with fm.measure(opt, x):  # a measured step reads nothing on the host: no error here
        opt.step()
    for k, v in fm.ema.value().items():
        torch.testing.assert_close(v, ema[k], rtol=0, atol=0)
    with pytest.warns(RuntimeWarning, match=r"not finite.*step 1: \['body\.weight'"):
        fslr = fm.fslr()  # reading the estimates reports the dropped probe
    assert fslr.keys() == ema.keys()


def test_successful_calls_modify_nothing_either() -> None:
    model, x, delta = make()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    snap = Snapshot.of(model, x=x, delta=delta, params=params)
    for func in FUNCS:
        kw = {} if func == "observe" else {"params": params}
        call(func, model, x, delta, **kw)
    ff.estimate(model, x, delta, samples=2, strategy="autograd", forward_seed=0)
    snap.check(model, x=x, delta=delta, params=params)


def test_complex_parameters_are_refused_not_silently_cast() -> None:
    class Complex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
            self.head = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head((x.to(torch.complex64) @ self.w).abs())

    model = Complex()
    x = torch.randn(5, 4)
    delta = {n: 1e-2 * torch.randn_like(p) for n, p in model.named_parameters()}
    snap = Snapshot.of(model, x=x, delta=delta)
    for func in ("estimate", "exact", "probe", "observe"):
        with pytest.raises(ValueError, match=r"complex parameters are not supported.*\['w'\]"):
            call(func, model, x, delta)
    snap.check(model, x=x, delta=delta)
    real = {n: d for n, d in delta.items() if n != "w"}
    assert set(ff.estimate(model, x, real, samples=2)) == set(real)  # the real ones are fine


def test_a_torchscript_model_is_refused_with_what_to_pass_instead() -> None:
    model, x, delta = make()
    scripted = torch.jit.script(model.eval())
    for func in ("estimate", "exact", "probe", "observe"):
        with pytest.raises(ValueError, match=r"TorchScript module.*Pass the eager module"):
            call(func, scripted, x, delta)
    with pytest.raises(ValueError, match=r"TorchScript module"):  # when built, not at a step
        ff.with_fslr(scripted)


def test_meta_tensors_are_refused_with_how_to_materialise_them() -> None:
    """Was: "Tensor.item() cannot be called on meta tensors" (and "META device type not an
    accelerator" from with_fslr), which says neither which tensor nor what to do."""
    model, x, delta = make()
    for func in ("estimate", "exact", "probe", "observe"):
        with pytest.raises(ValueError, match="positional input 0 is on the meta device"):
            call(func, model, x.to("meta"), delta)
        meta_delta = {n: d.to("meta") for n, d in delta.items()}
        with pytest.raises(ValueError, match=r"delta\['body.weight'\].*meta device"):
            call(func, model, x, meta_delta)
        with pytest.raises(ValueError, match=r"\['body.weight'.*meta device.*to_empty"):
            call(func, copy.deepcopy(model).to("meta"), x.to("meta"), meta_delta)


def test_an_input_that_requires_grad_changes_nothing_and_gets_no_grad() -> None:
    """Was: ``exact`` returned FSLRs carrying an autograd graph back to such an input."""
    model, x, delta = make()
    xr = x.clone().requires_grad_(True)
    for func in ("estimate", "exact"):
        plain, got = call(func, model, x, delta), call(func, model, xr, delta)
        for n, v in got.items():
            assert v.grad_fn is None and not v.requires_grad, (func, n)
            torch.testing.assert_close(v, plain[n], rtol=1e-6, atol=0)
    assert xr.grad is None and xr.requires_grad


def test_a_bool_update_is_refused_and_an_integer_one_is_an_update() -> None:
    # A bool tensor (a mask) was read as an update of 1 wherever it was True.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x = torch.randn(5, 4)
    mask = {"0.weight": torch.rand(6, 4) > 0.5}
    for func in ("estimate", "exact"):
        with pytest.raises(TypeError, match=r"bool tensors \(a mask\?\) for \['0.weight'\]"):
            call(func, model, x, mask)
    ints = {"0.weight": torch.randint(-2, 3, (6, 4))}
    torch.testing.assert_close(
        ff.exact(model, x, ints)["0.weight"],
        ff.exact(model, x, {"0.weight": ints["0.weight"].float()})["0.weight"],
    )


def test_options_are_checked_when_the_wrapper_and_recorder_are_built() -> None:
    """Bad options fail at construction, before optimizer.step() has run, not at the first
    probe after it."""
    from fslr_func.training.recorder import Recorder

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="chunk_size"):
        ff.with_fslr(model, chunk_size=0)
    with pytest.raises(TypeError, match="output_fn"):
        ff.with_fslr(model, output_fn=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"readout='nope' is not a module"):
        ff.with_fslr(model, readout="nope")
    for name, kind in (("1", "Tanh"), ("", "Sequential")):  # no readout estimator could apply
        with pytest.raises(ValueError, match=rf"readout='{name}' is a {kind} without a weight"):
            ff.with_fslr(model, readout=name)
    fm = ff.with_fslr(model)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="base_lr"):
            Recorder(fm, iter([]), base_lr=bad)


def test_nested_measure_blocks_are_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    fm = ff.with_fslr(model, samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    x = torch.randn(5, 3)
    fm(x).square().mean().backward()
    with fm.measure(opt, x):
        with pytest.raises(RuntimeError, match="cannot be nested"), fm.measure(opt, x):
            pass
        opt.step()
    assert {int(c) for c in fm.ema.counts.values()} == {1}  # the step was folded in once


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_a_probe_batch_the_model_cannot_take_says_so_beside_the_models_own_error() -> None:
    fm = ff.with_fslr(nn.Linear(3, 2), samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    rec = ff.Recorder(fm, [torch.randn(4, 7)], optimizer=opt, warmup_samples=2)
    fm(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as caught, rec.step():
        opt.step()
    notes = getattr(caught.value, "__notes__", [])
    assert any("probe batch of shapes (4, 7)" in n for n in notes), notes


@pytest.mark.parametrize("call", ["with_fslr", "estimate", "exact"])
def test_a_model_that_is_not_a_module_is_named(call: str) -> None:
    """``None`` as the model raised ``AttributeError`` from deep inside; every other argument
    of these functions gets a ``TypeError`` naming it."""
    with pytest.raises(TypeError, match=r"the model must be a torch\.nn\.Module, got NoneType"):
        if call == "with_fslr":
            ff.with_fslr(None)  # type: ignore[arg-type]
        else:
            getattr(ff, call)(None, torch.ones(2, 1), {"w": torch.ones(1)})
