"""Recorder and FLeRM driven by optimiser step hooks: equal to the ``with`` forms, exact
detaching (also after an exception), several optimisers, wrapped optimisers, LBFGS."""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _device import DEVICE, autocast, grad_scaler
from _tiny import backward, model, stream

import fslr_func as ff
from fslr_func.io.record import FSLRRecord
from fslr_func.training.recorder import Recorder
from fslr_func.training.step_hooks import StepHooks


def train(
    fm: ff.FSLRModule,
    opts: list[torch.optim.Optimizer],
    steps: int,
    around: Callable[[], Any] | None = None,
) -> None:
    for t in range(steps):
        for o in opts:
            o.zero_grad()
        backward(fm, t)
        with around() if around is not None else _nothing():
            for o in opts:
                o.step()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def base_record() -> FSLRRecord:
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)
    with rec.attach():
        train(fm, [opt], 5)
    return rec.record


def test_attached_recorder_records_what_the_with_form_records() -> None:
    records = []
    for hooks in (False, True):
        fm = model()
        opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
        rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)
        if hooks:
            handle = rec.attach()
            train(fm, [opt], 5)
            handle.detach()
        else:
            train(fm, [opt], 5, around=rec.step)
        records.append(rec.record)
    assert records[0] == records[1]
    assert records[0].steps == [0, 2, 4]


def test_attached_flerm_equals_the_with_form_and_detaches_exactly() -> None:
    base = base_record()
    out = []
    for hooks in (False, True):
        fm = model(width=20)
        opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
        groups = opt.param_groups
        flerm = ff.FLeRM(fm, opt, base, probe_batches=stream(3), warmup_samples=8)
        if hooks:
            with flerm.attach() as handle:
                train(fm, [opt], 3)
            assert not handle.attached
        else:
            train(fm, [opt], 3, around=flerm.step)
        assert opt.param_groups is groups and len(groups) == 1
        out.append([p.detach().clone() for p in fm.parameters()])
        assert [p.step for p in flerm.history] == [0]
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_attaching_twice_is_refused_until_the_first_hooks_are_detached() -> None:
    # twice attached, every step would run through the controller twice (it raised "fm.measure
    # blocks cannot be nested" at the first step, naming a call the user never made)
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)
    first = rec.attach()
    with pytest.raises(RuntimeError, match="attached already"):
        rec.attach()
    first.detach()
    with rec.attach():
        train(fm, [opt], 3)
    assert rec.record.steps == [0, 2]


def test_a_with_block_on_an_attached_or_open_controller_is_refused() -> None:
    # both counted every training step twice: t went 0, 2, 4 and a set point at step 3 was
    # never reached, silently
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)
    with rec.attach(), pytest.raises(RuntimeError, match="is attached: its hooks already"):
        rec.step()
    backward(fm, 0)
    with rec.step():
        with pytest.raises(RuntimeError, match=r"step\(\) blocks cannot be nested"), rec.step():
            pass
        opt.step()
    train(fm, [opt], 2, around=rec.step)  # the refused blocks left nothing open
    assert rec.t == 3


class LoggedAdam(torch.optim.Adam):
    """A subclass whose ``step`` calls ``super().step()``: torch runs its step hooks twice,
    one call inside the other, once ``Adam`` itself has been built in the process."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return super().step(closure)


def test_an_optimiser_subclass_calling_super_step_is_one_step_in_the_hooks_form() -> None:
    # the inner hooks were read as a step that raised: a warning at every step, twice the
    # probe batches, other FSLRs than Adam's
    torch.optim.Adam(model().parameters())  # Adam.step wrapped, as after any Adam run
    records = []
    for cls in (torch.optim.Adam, LoggedAdam):
        fm = model()
        opt = cls(fm.parameters(), lr=1e-2)
        rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)
        with rec.attach():
            train(fm, [opt], 5)
        assert rec.probes_used == 4
        records.append(rec.record)
    assert records[0].fslr == records[1].fslr and records[1].steps == [0, 2, 4]


class Boom(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError("boom")


@pytest.mark.filterwarnings("ignore:FLeRM's base record was made")  # Boom on an Adam record
def test_exception_in_step_leaves_groups_alone_and_records_nothing() -> None:
    base = base_record()
    fm = model(width=20)
    opt = Boom(fm.parameters(), lr=1e-2)
    groups = opt.param_groups
    flerm = ff.FLeRM(fm, opt, base, probe_batches=stream(3), warmup_samples=8)
    handle = flerm.attach()
    backward(fm, 0)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert opt.param_groups is groups  # FLeRM never swaps the groups, even while a step is open
    handle.detach()
    assert opt.param_groups is groups and flerm.t == 0 and not flerm.history
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    # and the next step after a failure abandons the open one with a warning
    flerm.attach()
    with pytest.raises(RuntimeError):
        opt.step()
    with pytest.warns(RuntimeWarning, match="did not finish"), pytest.raises(RuntimeError):
        opt.step()


def test_two_optimisers_are_one_recorded_step() -> None:
    fm = model()
    matrices = [p for p in fm.parameters() if p.dim() == 2]
    vectors = [p for p in fm.parameters() if p.dim() < 2]
    muon_like = torch.optim.SGD(matrices, lr=0.05, momentum=0.9)
    adamw = torch.optim.AdamW(vectors, lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=[muon_like, adamw], warmup_samples=8, every=2)
    calls: list[int] = []
    fold = fm.fold
    fm.fold = lambda *a, **k: calls.append(1) or fold(*a, **k)  # type: ignore[method-assign]
    with rec.attach():
        train(fm, [muon_like, adamw], 3)
    assert rec.record.steps == [0, 2] and rec.t == 3
    assert rec.record.meta["optimizer"] == "SGD+AdamW"  # FLeRM checks each against it
    assert sorted(rec.record.names) == sorted(n for n, _ in fm.module.named_parameters())
    assert len(calls) == 2  # one probe round per recorded step, not one per optimiser
    assert rec.record.lrs_at(2)["0.weight"] == 0.05 and rec.record.lrs_at(2)["0.bias"] == 1e-2
    # FLeRM: one per optimiser from the same record (each drives the tensors it holds)
    fm2 = model(width=20)
    m2 = [p for p in fm2.parameters() if p.dim() == 2]
    v2 = [p for p in fm2.parameters() if p.dim() < 2]
    o1, o2 = torch.optim.SGD(m2, lr=0.05, momentum=0.9), torch.optim.AdamW(v2, lr=1e-2)
    f1 = ff.FLeRM(fm2, o1, rec.record, probe_batches=stream(5), warmup_samples=8)
    f2 = ff.FLeRM(fm2, o2, rec.record, probe_batches=stream(6), warmup_samples=8)
    assert f1.names == ["0.weight", "2.weight"] and f2.names == ["0.bias", "2.bias"]
    with f1.attach(), f2.attach():
        train(fm2, [o1, o2], 2)
    assert sorted(f1.history[0].lrs) == ["0.weight", "2.weight"]
    assert all(v > 0 for v in f2.history[0].lrs.values())


def test_wrapped_optimiser_is_unwrapped_and_lbfgs_is_refused() -> None:
    base = base_record()
    fm = model(width=20)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)

    class Wrapper:  # accelerate's AcceleratedOptimizer keeps the optimiser as .optimizer
        optimizer = opt

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    flerm = ff.FLeRM(fm, Wrapper(), base, probe_batches=stream(), scheduler=sched)  # type: ignore[arg-type]
    assert flerm.optimizer is opt
    lbfgs = torch.optim.LBFGS(fm.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="LBFGS"):
        ff.FLeRM(fm, lbfgs, base, probe_batches=stream())
    with pytest.raises(ValueError, match="at least one"):
        StepHooks(lambda: _nothing(), [])  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("form", ["hooks", "with"])
@pytest.mark.parametrize("kind", ["Recorder", "FLeRM"])
def test_a_scaler_skipped_step_counts_the_same_for_fused_and_foreach_optimisers(
    kind: str, form: str
) -> None:
    """A ``GradScaler`` skips steps 1 and 3 (non-finite gradients): a ``foreach`` optimiser
    then calls no hook, a fused one is called with ``found_inf`` set; attached or around each
    step in a ``with`` block, both count the three steps taken, and record or set the same
    rates at them. Step 1 is a probed step: its probe moves to the next step taken."""
    base = base_record() if kind == "FLeRM" else None
    results = []
    for fused in (False, True):
        fm = model(width=20 if base is not None else 10)
        opt = torch.optim.Adam(fm.parameters(), lr=1e-2, fused=fused, foreach=not fused)
        controller: Recorder | ff.FLeRM = (
            Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=1)
            if base is None
            else ff.FLeRM(fm, opt, base, probe_batches=stream(3), warmup_samples=8)
        )
        scaler = grad_scaler(init_scale=2.0**4, growth_interval=1)
        hooks = controller.attach() if form == "hooks" else contextlib.nullcontext()
        noted = form == "with" and base is None  # the with form's probed step 1 is skipped
        note = pytest.warns(RuntimeWarning, match="skipped its step") if noted else _nothing()
        with hooks, note:
            for t in range(5):
                opt.zero_grad()
                x = torch.randn(
                    8, 6, generator=torch.Generator().manual_seed(t), dtype=torch.float64
                ).to(DEVICE)
                loss = fm(x).square().mean() * (torch.inf if t in (1, 3) else 1.0)
                scaler.scale(loss).backward()
                with controller.step() if form == "with" else contextlib.nullcontext():
                    scaler.step(opt)
                scaler.update()
        assert controller.t == 3, (fused, controller.t)
        results.append(
            controller.record.to_rows() if isinstance(controller, Recorder) else controller.lrs()
        )
    foreach, fused_result = results
    if kind == "Recorder":
        assert [r["step"] for r in foreach] == [r["step"] for r in fused_result] == [0, 1, 2]
        for a, b in zip(foreach, fused_result, strict=True):
            assert a.keys() == b.keys()
            assert all(a[k] == pytest.approx(b[k], rel=1e-9) for k in a)
    else:
        assert foreach.keys() == fused_result.keys()
        assert all(foreach[k] == pytest.approx(fused_result[k], rel=1e-9) for k in foreach)


def _scaled_run(form: str, skip: set[int], steps: int = 6) -> tuple[ff.FLeRM, list[torch.Tensor]]:
    """FLeRM on a float32 model under bfloat16 autocast, a fused AdamW and a ``GradScaler``
    whose steps in ``skip`` see an inf loss; driven by its hooks or by ``with`` blocks."""
    base = base_record()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3)).to(
        DEVICE
    )
    fm = ff.with_fslr(net, samples=4, seed=1, strategy="loop")
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2, fused=True)
    probes = (x.float() for x in stream(3))
    flerm = ff.FLeRM(fm, opt, base, probe_batches=probes, warmup_samples=8, mode="periodic")
    scaler = grad_scaler(init_scale=2.0**4)
    with flerm.attach() if form == "hooks" else contextlib.nullcontext():
        for t in range(steps):
            opt.zero_grad()
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(t)).to(DEVICE)
            with autocast(torch.bfloat16):
                loss = fm(x).float().square().mean() * (torch.inf if t in skip else 1.0)
            scaler.scale(loss).backward()
            with flerm.step() if form == "with" else contextlib.nullcontext():
                scaler.step(opt)
            scaler.update()
    return flerm, [p.detach().clone() for p in fm.parameters()]


def test_with_form_and_hooks_count_the_same_steps_under_bf16_a_fused_optimiser_and_a_scaler() -> (
    None
):
    """Steps 0 (FLeRM's first set point) and 3 are skipped: both forms take four steps, set
    the same rates and end with the same weights."""
    with pytest.warns(RuntimeWarning, match="skipped its step"):
        with_form, with_weights = _scaled_run("with", {0, 3})
    hooks, hooks_weights = _scaled_run("hooks", {0, 3})
    assert with_form.t == hooks.t == 4
    assert [p.step for p in with_form.history] == [p.step for p in hooks.history] == [0]
    assert with_form.lrs() == hooks.lrs()
    assert all(torch.equal(a, b) for a, b in zip(with_weights, hooks_weights, strict=True))


def test_a_with_block_is_a_skipped_step_only_when_the_scaler_skipped() -> None:
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=None)
    backward(fm, 0)
    with rec.step(), torch.no_grad():  # updated by hand, no optimizer.step(): counted
        for p in fm.parameters():
            p.sub_(1e-2 * p.grad)  # type: ignore[operator]
    assert rec.t == 1 and rec.record.steps == [0]
    scaler = grad_scaler()
    for counted in (1, 2):
        opt.zero_grad()
        scaler.scale(fm(next(stream())).sum() * torch.inf).backward()
        with rec.step():
            scaler.step(opt)  # skipped: a for-loop optimiser is not called
        scaler.update()
        assert rec.t == counted
        opt.zero_grad()
        backward(fm, counted)
        with rec.step():
            opt.step()
        assert rec.t == 1 + counted


def test_a_round_whose_fused_optimiser_the_scaler_skipped_closes_in_its_own_iteration() -> None:
    """Two fused optimisers; at iterations 1 and 3 only the first one's gradients are not
    finite, so the scaler skips it and steps the second. The round is still that
    iteration's: it closes when the second has stepped, ``t`` counts iterations, and the
    record's rows are the iterations probed."""
    fm = model()
    matrices = [p for p in fm.parameters() if p.dim() == 2]
    vectors = [p for p in fm.parameters() if p.dim() < 2]
    first = torch.optim.Adam(matrices, lr=1e-2, fused=True)
    second = torch.optim.AdamW(vectors, lr=1e-2, fused=True)
    rec = Recorder(fm, stream(), optimizer=[first, second], warmup_samples=8, every=2)
    scaler = grad_scaler(init_scale=2.0**4, growth_interval=1000)
    with rec.attach():
        for t in range(5):
            first.zero_grad()
            second.zero_grad()
            scaler.scale(fm(next(stream(t))).square().mean()).backward()
            if t in (1, 3):
                matrices[0].grad[0, 0] = torch.inf  # type: ignore[index]
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            assert rec.t == t + 1, t
    assert rec.record.steps == [0, 2, 4]


def test_the_with_form_records_what_the_hooks_form_records_around_skipped_probed_steps() -> None:
    """Every step is probed and the scaler skips steps 1, 3 and 4 (two in a row): both forms
    record the same rows, bit for bit (the skipped blocks' probe batches and omegas go to
    the next step taken)."""
    rows = []
    for form in ("hooks", "with"):
        fm = model()
        opt = torch.optim.Adam(fm.parameters(), lr=1e-2, foreach=True)
        rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=1)
        scaler = grad_scaler(init_scale=2.0**4, growth_interval=1)
        hooks = rec.attach() if form == "hooks" else contextlib.nullcontext()
        noted = pytest.warns(RuntimeWarning, match="skipped") if form == "with" else _nothing()
        with hooks, noted:
            for t in range(7):
                opt.zero_grad()
                g = torch.Generator().manual_seed(t)
                x = torch.randn(8, 6, generator=g, dtype=torch.float64).to(DEVICE)
                loss = fm(x).square().mean() * (torch.inf if t in (1, 3, 4) else 1.0)
                scaler.scale(loss).backward()
                with rec.step() if form == "with" else contextlib.nullcontext():
                    scaler.step(opt)
                scaler.update()
        rows.append(rec.record.to_rows())
    assert [r["step"] for r in rows[0]] == [0, 1, 2, 3]
    assert rows[0] == rows[1]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_attached_flerm_run_continues_as_the_original(how: str) -> None:
    """A copy of ``(fm, opt, flerm)`` (``copy.deepcopy``, pickle) lost what is keyed by object
    identity: torch drops the copied optimiser's hooks (the copy's steps skipped FLeRM while
    it believed itself attached), the copied optimiser was not in the scaling registry (a
    second wrapper measuring it divided by the group's rate: 1.33 for 4.84), and ``lrs()``
    was empty until the next step. The copy now steps, rates and measures as the original."""
    batches = [x for x, _ in zip(stream(3), range(30), strict=False)]
    fm = model(width=20)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    flerm = ff.FLeRM(fm, opt, base_record(), probe_batches=batches, warmup_samples=8)
    hooks = flerm.attach()
    train(fm, [opt], 3)
    copied = (
        copy.deepcopy((fm, opt, flerm))
        if how == "deepcopy"
        else pickle.loads(pickle.dumps((fm, opt, flerm)))
    )
    fm2, opt2, flerm2 = copied
    assert flerm2.lrs() == flerm.lrs() != {}
    watchers = [ff.with_fslr(f.module, samples=4, seed=5) for f in (fm, fm2)]
    for t in range(3, 6):
        for f, o, w in ((fm, opt, watchers[0]), (fm2, opt2, watchers[1])):
            o.zero_grad()
            backward(f, t)
            with w.measure(o, batches[t]):  # a second wrapper, through the registry's rates
                o.step()
    assert flerm.t == flerm2.t == 6
    assert all(torch.equal(a, b) for a, b in zip(fm.parameters(), fm2.parameters(), strict=True))
    assert watchers[0].fslr().keys() == watchers[1].fslr().keys()
    assert all(torch.equal(v, watchers[1].fslr()[n]) for n, v in watchers[0].fslr().items())
    hooks.detach()
    assert flerm2._hooks is not None and flerm2._hooks.attached
    flerm2._hooks.detach()


def test_a_pickle_of_an_attached_run_from_before_the_copy_hooks_loads_attached() -> None:
    """Hooks pickled before they kept their optimisers in ``_hooked`` (their state: the
    instance dict, handles included) raised ``AttributeError`` on load; they load, and the
    copy's steps run through it."""
    from fslr_func.training.step_hooks import _OptimizerHooks

    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    batches = [x for x, _ in zip(stream(3), range(20), strict=False)]
    rec = Recorder(fm, batches, optimizer=opt, warmup_samples=8, every=1)
    hooks = rec.attach()
    train(fm, [opt], 2)
    hooks.close()  # the previous version's hooks: the bound methods themselves
    hooks._handles = [
        opt.register_step_pre_hook(hooks._pre),
        opt.register_step_post_hook(hooks._post),
    ]
    hooked = vars(hooks).pop("_hooked")
    methods = {k: vars(_OptimizerHooks)[k] for k in ("__getstate__", "__setstate__")}
    try:  # the state the previous version pickled
        for k in methods:
            delattr(_OptimizerHooks, k)
        data = pickle.dumps((fm, opt, rec))
    finally:
        for k, v in methods.items():
            setattr(_OptimizerHooks, k, v)
        hooks._hooked = hooked
    hooks.detach()
    fm2, opt2, rec2 = pickle.loads(data)
    train(fm2, [opt2], 1)
    assert rec2.t == 3


def test_an_attached_flerm_runs_under_a_compiled_optimiser_step() -> None:
    """``torch.compile(opt.step)`` traces into the optimiser's step hooks: FLeRM's probe ran
    inside the compiled region and failed ("attempted to set_stance in a torch.compile
    region"). The hooks run eagerly now, and the run is the uncompiled one's."""
    results = []
    for compiled in (False, True):
        fm = model(width=20)
        opt = torch.optim.SGD(fm.parameters(), lr=1e-2, momentum=0.9)
        flerm = ff.FLeRM(fm, opt, base_record(), probe_batches=stream(3), warmup_samples=8)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        with flerm.attach():
            for t in range(3):
                opt.zero_grad()
                backward(fm, t)
                step()
        results.append((flerm.t, flerm.lrs(), [p.detach().clone() for p in fm.parameters()]))
    (t0, lrs0, w0), (t1, lrs1, w1) = results
    assert t0 == t1 == 3 and lrs0.keys() == lrs1.keys()
    assert all(lrs1[n] == pytest.approx(v, rel=1e-6) for n, v in lrs0.items())
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(w0, w1, strict=True))


@pytest.mark.parametrize("every", [None, 50, 2])
def test_the_wrappers_buffers_are_freed_when_no_probe_is_due_soon(every: int | None) -> None:
    """The weights before a measured step and its updates, two copies of the trainable
    weights, were kept for the rest of the run after a probe at step 0 only."""
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=every)
    with rec.attach():
        for t in range(3):
            opt.zero_grad()
            backward(fm, t)
            opt.step()
    kept = len(fm._snapshots._buffers) + len(fm._updates._buffers)
    assert rec.record.steps[0] == 0
    assert kept == (8 if every == 2 else 0)  # 4 tensors, two buffers each


def test_an_unseeded_wrapper_resumed_before_its_first_probe_draws_the_saved_runs_omegas() -> None:
    """The wrapper's seed was not in its state, and its omega generators are made at the
    first probe: a run checkpointed before it (a late ``start_step``) and resumed into a
    wrapper built without ``seed=`` after another RNG state probed with other omegas."""
    torch.manual_seed(0)
    net = model().module
    first = ff.with_fslr(net, samples=4)
    state = first.state_dict()
    torch.manual_seed(1)  # the resumed process's RNG is elsewhere
    resumed = ff.with_fslr(net, samples=4)
    assert resumed.seed != first.seed
    resumed.load_state_dict(state)
    assert resumed.seed == first.seed


def test_a_state_loaded_back_into_a_run_drawing_from_a_generator_is_refused() -> None:
    """A rollback (the step-2 state loaded into the live objects at step 6) skipped the used
    batches from where the generator stood, not from its start: other probe batches, other
    rates, silently. A one-shot iterator cannot start again: refused, nothing changed."""
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=1)
    with rec.attach():
        train(fm, [opt], 2)
        saved = rec.state_dict()
        train(fm, [opt], 2)
    t, record = rec.t, rec.record.to_dict()
    with pytest.raises(ValueError, match=r"one-shot iterator .* cannot start again"):
        rec.load_state_dict(saved)
    assert rec.t == t and rec.record.to_dict() == record
    rec.load_state_dict(rec.state_dict())  # its own position: nothing to rewind
