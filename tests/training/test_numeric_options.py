"""Numeric options given as numpy scalars (a config loaded with numpy, a sweep grid) are taken
as the plain numbers they stand for, and saved as plain numbers; bools, strings, NaN, tensors
and values out of range are still refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _tiny import backward, model, stream

import fslr_func as ff
from fslr_func.stats.checks import integer, real


def test_numpy_scalars_are_taken_and_saved_as_plain_numbers() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    fm = ff.with_fslr(
        net.double(), samples=np.int64(2), beta=np.float64(0.5), seed=np.int64(1),
        chunk_size=np.int32(1), strategy="loop",
    )  # fmt: skip
    assert type(fm.samples) is int and type(fm.beta) is float and type(fm.seed) is int
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = ff.Recorder(
        fm, stream(), optimizer=opt, warmup_samples=np.int64(2), every=np.int64(2),
        start_step=np.int64(1), base_lr=np.float64(1e-2),
    )  # fmt: skip
    with rec.attach():
        for t in range(4):
            opt.zero_grad()
            backward(fm, t)
            opt.step()
    assert rec.record.steps == [1, 3]
    meta = rec.record.meta
    for key in ("warmup_samples", "every", "start_step", "samples"):
        assert type(meta[key]) is int, key
    assert type(meta["base_lr"]) is float and type(meta["beta"]) is float
    json.dumps(rec.record.to_dict())  # np.int64 is not JSON serialisable
    assert all(type(v) is int for k, v in rec.state_dict()["config"].items() if k == "every")
    fm2 = model(width=12)
    opt2 = torch.optim.Adam(fm2.parameters(), lr=1e-2)
    flerm = ff.FLeRM(
        fm2, opt2, rec.record, probe_batches=stream(2), mode="periodic", every=np.int64(3),
        warmup_samples=np.int64(4), min_fslr=np.float64(0.0), feature_power=np.float32(1.0),
        policy=ff.policies.equal(total=np.float64(1.0)),
    )  # fmt: skip
    config = flerm.state_dict()["config"]
    assert type(config["every"]) is int and type(config["min_fslr"]) is float
    assert flerm.plan.every == 3
    x = torch.randn(5, 6, dtype=torch.float64)
    delta = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    assert set(ff.estimate(net, x, delta, samples=np.int64(2), chunk_size=np.int64(1))) == set(
        delta
    )


@pytest.mark.parametrize(
    "bad", [True, "2", 2.0, np.float64(2.0), torch.tensor(2), np.int64(0), float("nan")]
)
def test_integer_options_still_refuse_bools_strings_floats_tensors_and_zero(bad: object) -> None:
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="every must be None or a positive integer"):
        ff.Recorder(fm, stream(), optimizer=opt, every=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="samples must be a positive integer"):
        ff.with_fslr(torch.nn.Linear(2, 2), samples=bad)  # type: ignore[arg-type]


def test_real_options_refuse_bools_nan_and_out_of_range() -> None:
    for bad in (True, float("nan"), np.float64("inf"), "0.5", np.float64(1.0), -0.1):
        with pytest.raises(ValueError, match="beta must be in"):
            ff.with_fslr(torch.nn.Linear(2, 2), beta=bad)  # type: ignore[arg-type]
    assert real(np.float32(0.25), "x", low=0.0) == 0.25
    with pytest.raises(ValueError, match=r"a tensor: pass a Python number, t.item\(\)"):
        integer(torch.tensor(3), "every", low=1)
    with pytest.raises(ValueError, match="min_fslr must be a finite number >= 0"):
        ff.FLeRM(model(), torch.optim.SGD(model().parameters(), lr=0.1), ff.FSLRRecord(),
                 probe_batches=stream(), min_fslr=np.float64(-1.0))  # fmt: skip


def test_options_that_would_change_nothing_are_refused() -> None:
    # both were accepted and silently ignored: periodic mode without a period ran as static,
    # and a feature power with output matching changed no rate
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    base = ff.FSLRRecord(steps=[0], fslr={n: [1.0] for n, _ in fm.named_parameters()})
    base.meta["base_lr"] = 1e-2
    with pytest.raises(ValueError, match=r"mode='periodic' sets the rates every `every` steps"):
        ff.FLeRM(fm, opt, base, probe_batches=stream(), mode="periodic", every=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"feature_power=3 applies to .*match='features'"):
        ff.FLeRM(fm, opt, base, probe_batches=stream(), feature_power=3.0)
