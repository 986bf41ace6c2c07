"""FLeRM on the training paths people run: a matrix of optimisers x GradScaler x precision x
scheduler x form (``with flerm.step()`` or ``flerm.attach()``), covered pairwise.

Each cell trains a FLeRM-driven model and, from the same initialisation and batches, a
*reference*: the same optimiser class over one param group per tensor, whose rates are set at
every step to the rates FLeRM reported for that step (its ``log_fn``), stepped the same way
(same scaler, autocast, clipping). The two must end at the same weights within float
tolerance; group state survives; with the run's own scheduler, FLeRM's rates between set
points move exactly as the group's rate does. Unsupported optimisers are refused at
construction. A new optimiser is one line in ``OPTIMISERS``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _device import DEVICE, autocast, grad_scaler
from _gloo import free_port
from torch import nn

import fslr_func as ff
from fslr_func.io.record import FSLRRecord

LR = 1e-2
STEPS = 5
EVERY = 2  # periodic set points at 0, 2, 4: rates change mid-run
D_IN, CLASSES = 6, 3


class CountingSGD(torch.optim.SGD):
    """SGD with momentum that keeps a step counter in each param group (group state, as
    schedule-free, Prodigy and D-Adaptation keep theirs)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
        return super().step(closure)


def _adafactor(params: Any) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(  # type: ignore[no-any-return]
        params, lr=LR, relative_step=False, scale_parameter=False, warmup_init=False
    )


def _zero(params: Any) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)


#: name -> (FLeRM run's optimiser; the reference's class, if not the same: ZeRO's inner AdamW)
OPTIMISERS: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], ...]] = {
    "SGD": (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9),),
    "Adam": (lambda p: torch.optim.Adam(p, lr=LR),),
    # a tensor rate, which ReduceLROnPlateau cuts in place (an initial_lr that was the same
    # tensor followed it: FLeRM and the Recorder saw a ratio of 1 after every cut)
    "Adam-tensor-lr": (lambda p: torch.optim.Adam(p, lr=torch.tensor(LR)),),
    "AdamW-forloop": (lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.1, foreach=False),),
    "AdamW-foreach": (lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.1, foreach=True),),
    "AdamW-fused": (lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.1, fused=True),),
    "SGD-fused": (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, fused=True),),
    "Adafactor": (_adafactor,),
    "CountingSGD": (lambda p: CountingSGD(p, lr=LR, momentum=0.9),),
    # one-process group; the reference is the AdamW that ZeRO shards
    "ZeRO": (_zero, lambda p: torch.optim.AdamW(p, lr=LR)),
}


def _warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, t / 2))


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any] | None] = {
    "none": None,
    "warmup-from-0": _warmup,
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=2 * LR, total_steps=20, cycle_momentum=False
    ),
    "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=2),
            torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7),
        ],
        milestones=[2],
    ),
    "chained": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
            torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5),
        ]
    ),
}
#: wrapped: the forward inside autocast (accelerate); params: bfloat16 parameters and inputs
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-wrapped", "bf16-params")
SCALERS = ("none", "gradscaler")
CLIPS = ("none", "clip")  # clip: unscale_ and clip before the step; none: the step unscales
FORMS = ("with", "hooks")


def pairwise(axes: dict[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """A covering array of strength 2: every pair of values of any two axes is in some row
    (greedy over random candidates from a fixed seed, so the cells are the same every run)."""
    names = list(axes)
    uncovered = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(names)), 2)
        for a in axes[names[i]]
        for b in axes[names[j]]
    }
    pairs = list(itertools.combinations(range(len(names)), 2))
    rng = random.Random(0)
    rows: list[tuple[str, ...]] = []
    while uncovered:
        i, a, j, b = min(uncovered)  # every candidate covers the first uncovered pair
        candidates = []
        for _ in range(60):
            row = [rng.choice(axes[n]) for n in names]
            row[i], row[j] = a, b
            candidates.append(tuple(row))

        best = max(
            candidates,
            key=lambda row: sum((x, row[x], y, row[y]) in uncovered for x, y in pairs),
        )
        rows.append(best)
        uncovered -= {(x, best[x], y, best[y]) for x, y in pairs}
    return rows


AXES = {
    "optimiser": tuple(OPTIMISERS),
    "scheduler": tuple(SCHEDULERS),
    "precision": PRECISIONS,
    "scaler": SCALERS,
    "clip": CLIPS,
    "form": FORMS,
}
#: Triples the pairs may miss, kept on purpose: a fused optimiser unscaling inside its own step
#: (GradScaler, no unscale_ before it) under the hooks form, where the step's post-hook runs.
CELLS = pairwise(AXES) + [
    (fused, "none", "fp32", "gradscaler", "none", "hooks") for fused in ("SGD-fused", "AdamW-fused")
]


def net(width: int) -> nn.Module:
    torch.manual_seed(width)
    return nn.Sequential(nn.Linear(D_IN, width), nn.Tanh(), nn.Linear(width, CLASSES)).to(DEVICE)


def batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        x, y = torch.randn(16, D_IN, generator=g), torch.randint(0, CLASSES, (16,), generator=g)
        yield x.to(DEVICE), y.to(DEVICE)


def probes(dtype: torch.dtype = torch.float32) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    while True:
        yield torch.randn(16, D_IN, generator=g).to(DEVICE, dtype)


# one Adam record drives every optimiser of the matrix: what is tested is the update scaling
pytestmark = pytest.mark.filterwarnings("ignore:FLeRM's base record was made")


@pytest.fixture(scope="module")
def base() -> FSLRRecord:
    fm = ff.with_fslr(net(8), samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=LR)
    rec = ff.Recorder(fm, probes(), optimizer=opt, warmup_samples=8, every=1)
    data = batches(1)
    with rec.attach():
        for _ in range(STEPS):
            x, y = next(data)
            opt.zero_grad()
            nn.functional.cross_entropy(fm(x), y).backward()
            opt.step()
    return rec.record


@pytest.fixture(scope="module")
def one_process_group() -> Iterator[None]:
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        yield
        dist.destroy_process_group()
    else:
        yield


def autocast_for(precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision in ("bf16", "fp16"):
        return autocast(torch.bfloat16 if precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    precision: str,
    scaler: torch.amp.GradScaler | None,
    clip: str,
    sched: Any,
    step: Callable[[int], contextlib.AbstractContextManager[Any]],
    before_step: Callable[[int], None],
    after_step: Callable[[int], None],
) -> None:
    """The user's loop: autocast forward, scaled backward, clipping, step, scheduler."""
    data = batches(2)
    for t in range(STEPS):
        x, y = next(data)
        x = x.to(next(model.parameters()).dtype)
        opt.zero_grad()
        with autocast_for(precision):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip == "clip":
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before_step(t)
        with step(t):
            scaler.step(opt) if scaler is not None else opt.step()
        after_step(t)
        if scaler is not None:
            scaler.update()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(float(t))  # a rising metric: the plateau cuts the rate every step
        elif sched is not None:
            sched.step()


def nothing(t: int) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


class Reference:
    """The reference step: before FLeRM's step, a copy of the optimiser (its class, state and
    group hyperparameters, via ``state_dict``) over copies of the weights and gradients, and
    of the scaler; after it, the copy is split into one param group per tensor at the rates
    FLeRM reported for that step and stepped the same way (the scaler's ``step``, or a plain
    step after the loop's own ``unscale_``)."""

    def __init__(
        self, opt: torch.optim.Optimizer, build: Callable[[Any], Any], names: dict[int, str]
    ):
        self.opt, self.build, self.names = getattr(opt, "optim", opt), build, names  # ZeRO: inner
        self.copy: torch.optim.Optimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.params: dict[str, nn.Parameter] = {}

    def before(self, scaler: torch.amp.GradScaler | None, unscaled: bool) -> None:
        self.params = {}
        groups = []
        for g in self.opt.param_groups:
            copies = []
            for p in g["params"]:
                c = nn.Parameter(p.detach().clone())
                c.grad = None if p.grad is None else p.grad.clone()
                self.params[self.names[id(p)]] = c
                copies.append(c)
            groups.append({"params": copies})
        self.copy = self.build(groups)
        self.copy.load_state_dict(copy.deepcopy(self.opt.state_dict()))
        self.scaler = None
        if scaler is not None and not unscaled:  # the same scale, before this step's update
            self.scaler = grad_scaler()
            self.scaler._scale = scaler._scale.clone()  # type: ignore[union-attr]
            self.scaler._growth_tracker = scaler._growth_tracker.clone()  # type: ignore[union-attr]
        self.skip = (
            unscaled
            and scaler is not None
            and not all(
                torch.isfinite(c.grad).all() for c in self.params.values() if c.grad is not None
            )
        )

    def step(self, rates: dict[str, float]) -> dict[str, nn.Parameter]:
        assert self.copy is not None
        name = {id(p): n for n, p in self.params.items()}
        self.copy.param_groups = [
            {**g, "params": [p], "lr": rates[f"flerm_lr/{name[id(p)]}"]}
            for g in self.copy.param_groups
            for p in g["params"]
        ]
        if self.scaler is not None:
            self.scaler.step(self.copy)
        elif not self.skip:
            self.copy.step()
        return self.params


def run_cell(base: FSLRRecord, cell: tuple[str, ...]) -> None:
    optimiser, scheduler, precision, scaling, clip, form = cell
    if DEVICE.type == "cuda" and precision == "bf16-params" and scaling == "gradscaler":
        pytest.skip("torch's CUDA GradScaler does not unscale bfloat16 gradients")
    build, *reference_build = OPTIMISERS[optimiser]
    model = net(16).to(torch.bfloat16 if precision == "bf16-params" else torch.float32)
    if precision == "bf16-wrapped":  # as accelerate and Trainer(bf16=True) do
        model.forward = autocast(torch.bfloat16)(model.forward)  # type: ignore[method-assign]
    fm = ff.with_fslr(model, samples=4, seed=0)
    opt = build(fm.parameters())
    sched = SCHEDULERS[scheduler](opt) if SCHEDULERS[scheduler] else None
    logged: dict[int, dict[str, float]] = {}
    group_lrs: dict[int, float] = {}
    flerm = ff.FLeRM(
        fm, opt, base, probe_batches=probes(next(model.parameters()).dtype), warmup_samples=8,
        mode="periodic", every=EVERY,
        scheduler=sched, log_fn=lambda t, s: logged.__setitem__(t, s),
    )  # fmt: skip
    scaler = grad_scaler(init_scale=2.0**8) if scaling == "gradscaler" else None
    params = dict(model.named_parameters())
    reference = Reference(
        opt, reference_build[0] if reference_build else build, {id(p): n for n, p in params.items()}
    )

    def before_step(t: int) -> None:
        group_lrs[t] = float(opt.param_groups[0]["lr"])
        reference.before(scaler, unscaled=clip == "clip")

    def after_step(t: int) -> None:
        before = {n: c.detach().clone() for n, c in reference.params.items()}
        expected = reference.step(logged[t])
        for n, p in params.items():
            # FLeRM's step is the optimiser's step at the group's rate with its displacement
            # scaled by c = rate / group rate: exact up to c times that step's rounding
            c = logged[t][f"flerm_lr/{n}"] / group_lrs[t] if group_lrs[t] else 1.0
            eps = torch.finfo(p.dtype).eps
            bound = (c + 4) * eps * (before[n].abs() + expected[n].detach().abs())
            err = (p.detach() - expected[n].detach()).abs()
            assert bool((err <= bound).all()), (cell, t, n, float((err - bound).max()))

    with warnings_ignored():
        if form == "hooks":
            with flerm.attach():
                train(fm, opt, precision, scaler, clip, sched, nothing, before_step, after_step)
        else:
            step = lambda t: flerm.step()  # noqa: E731
            train(fm, opt, precision, scaler, clip, sched, step, before_step, after_step)
    assert len(flerm.history) >= 2, "the periodic set points were taken"
    assert any(
        r != group_lrs[t] for t, rs in logged.items() for k, r in rs.items() if "flerm_lr" in k
    ), "FLeRM set rates other than the group's"
    # group state survived; with the run's own scheduler FLeRM's rates follow the group's
    if optimiser == "CountingSGD":
        assert opt.param_groups[0]["k"] == STEPS
    if sched is not None:
        points = {p.step for p in flerm.history}
        for t in range(1, STEPS):
            if t not in points and group_lrs[t - 1] > 0:
                ratio = group_lrs[t] / group_lrs[t - 1]
                for n in params:
                    now, then = logged[t][f"flerm_lr/{n}"], logged[t - 1][f"flerm_lr/{n}"]
                    assert now == pytest.approx(then * ratio, rel=1e-9), (cell, t, n)
    if optimiser == "ZeRO":
        opt.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # an ordinary optimiser throughout


@contextlib.contextmanager
def warnings_ignored() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_the_pairwise_cells_cover_every_pair() -> None:
    names = list(AXES)
    for (i, x), (j, y) in itertools.combinations(enumerate(names), 2):
        seen = {(c[i], c[j]) for c in CELLS}
        assert seen == set(itertools.product(AXES[x], AXES[y])), (x, y)
    assert len(CELLS) < 90


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_matches_per_tensor_groups_at_flerms_rates(
    base: FSLRRecord, cell: tuple[str, ...], request: pytest.FixtureRequest
) -> None:
    if cell[0] == "ZeRO":
        request.getfixturevalue("one_process_group")
    run_cell(base, cell)


def _schedulefree(p: Any) -> torch.optim.Optimizer:
    import schedulefree

    return schedulefree.AdamWScheduleFree(p, lr=LR)  # type: ignore[no-any-return]


def _prodigy(p: Any) -> torch.optim.Optimizer:
    import prodigyopt

    return prodigyopt.Prodigy(p, lr=1.0)  # type: ignore[no-any-return]


def _adafactor_no_lr(p: Any) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(p, lr=None)  # type: ignore[no-any-return]


def _adafactor_momentum(p: Any) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(  # type: ignore[no-any-return]
        p, lr=LR, beta1=0.9, relative_step=False, scale_parameter=False, warmup_init=False
    )


REFUSED: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], str]] = {
    "LBFGS": (lambda p: torch.optim.LBFGS(p), "closure"),
    "Rprop": (lambda p: torch.optim.Rprop(p), "clipped"),
    "ASGD": (lambda p: torch.optim.ASGD(p), "depend on lr"),
    "torch-Adafactor": (lambda p: torch.optim.Adafactor(p), r"min\(lr, 1/sqrt\(t\)\)"),
    "hf-Adafactor-lr-None": (_adafactor_no_lr, "relative_step=False"),
    # its first moment averages lr * update: its state depends on the rate
    "hf-Adafactor-beta1": (_adafactor_momentum, "beta1=0.9.*beta1=None"),
    "schedule-free": (_schedulefree, "average of its own iterates"),
    "Prodigy": (_prodigy, "one step size for all the tensors"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_optimisers_are_refused_at_construction(base: FSLRRecord, name: str) -> None:
    build, why = REFUSED[name]
    fm = ff.with_fslr(net(16), samples=4)
    with pytest.raises(ValueError, match=why):
        ff.FLeRM(fm, build(fm.parameters()), base, probe_batches=probes())


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_subclass_of_an_unsupported_optimiser_is_refused_as_it_is(
    base: FSLRRecord, name: str
) -> None:
    """``class Mine(torch.optim.LBFGS): pass`` steps as LBFGS does (1.81x its displacement
    for twice the rate): it was accepted, its class name and module being the user's."""
    build, why = REFUSED[name]
    fm = ff.with_fslr(net(16), samples=4)
    opt = build(fm.parameters())
    opt.__class__ = type("Mine", (type(opt),), {"__module__": "my_training"})
    with pytest.raises(ValueError, match=why):
        ff.FLeRM(fm, opt, base, probe_batches=probes())


def test_state_dict_taken_in_a_step_post_hook_is_the_users_and_loads(base: FSLRRecord) -> None:
    fm = ff.with_fslr(net(16), samples=4, seed=0)
    opt = torch.optim.AdamW(fm.parameters(), lr=LR)
    flerm = ff.FLeRM(fm, opt, base, probe_batches=probes(), warmup_samples=8)
    saved: list[dict[str, Any]] = []
    with flerm.attach():
        opt.register_step_post_hook(lambda o, a, k: saved.append(copy.deepcopy(o.state_dict())))
        with warnings_ignored():
            train(fm, opt, "fp32", None, "none", None, nothing, lambda t: None, lambda t: None)
    assert len(saved) == STEPS and flerm.history
    for state in saved:
        assert len(state["param_groups"]) == 1 and state["param_groups"][0]["lr"] == LR
        torch.optim.AdamW(net(16).parameters(), lr=LR).load_state_dict(state)
