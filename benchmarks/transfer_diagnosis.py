r"""Why FLeRM under-sets width rates (issue 23, item 2): per-tensor measurements on matrix cells.

For a cell of ``benchmarks/transfer_matrix.py`` (its base best rate :math:`b` and re-tuned 8x
rate :math:`b_8` read from the cell's folder, so run the matrix cell first), per seed, three
runs whose unit-rate FSLRs are probed every 10 steps, each probe its own estimate (``beta=0``,
32 omega samples; the sweeps' EMA across probes, ``beta=0.9`` at one probe every 10 steps,
averages every reading over about 100 steps): the base (1x, standard training at :math:`b`,
recorded), static FLeRM at 8x from that record at :math:`b`, standard training at 8x at
:math:`b_8`. Printed per tensor role (block index replaced by ``*``; geometric means over
seeds, blocks and the probes of a window of steps):

1. **Drift of the static set point**: static FLeRM's movement per step at 8x (its rate times
   the unit-rate FSLR) over the base's; 1 at step 0 by construction, below 1 where FLeRM
   under-moves the 8x model later.
2. **Re-tuned standard training**: the same ratio for standard training at 8x at :math:`b_8`.
3. **Adam's first step**: the unit-rate FSLR over its step-0 value (:math:`\mathrm{sign}(g)`),
   at 1x and at 8x: what static FLeRM's one measurement misses.
4. **Estimator bias**: at steps 0 and 50 of the base run and of the FLeRM run, every tensor's
   update probed with ``kron`` (the library's default; conv weights grouped
   ``out x (in * k)``) and ``full`` (256 samples) over :func:`fslr_func.probe.exact` (the jvp
   ground truth), on a held-out batch.

Run: ``nice -n 15 python benchmarks/transfer_diagnosis.py --cell conv1d-w16-s150 --seeds 0,1``
(writes ``fslr_runs/diagnosis/<cell>.json``, which a second call re-prints).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import fslr_func as ff
from fslr_func.experiments.configs import SweepConfig
from fslr_func.experiments.matrix import best_rate
from fslr_func.experiments.run import RunSpec
from fslr_func.experiments.task import Task, builtin_task
from fslr_func.probe.names import block_role

sys.path.insert(0, str(Path(__file__).parent))
from transfer_matrix import CELLS

BIAS_STEPS = (0, 50)


def _gmean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else math.nan


def by_role(values: Mapping[str, float]) -> dict[str, float]:
    """Geometric mean of ``values`` over the tensors of each role."""
    groups: dict[str, list[float]] = defaultdict(list)
    for name, v in values.items():
        groups[block_role(name)].append(v)
    return {role: _gmean(vs) for role, vs in groups.items()}


def _bias(model: torch.nn.Module, before: dict[str, torch.Tensor], probe: Any, seed: int) -> dict:
    """kron and full estimates over exact, per tensor, of the update ``params - before``."""
    params = dict(model.named_parameters())
    delta = {n: (p.detach() - before[n]) for n, p in params.items()}
    exact = ff.exact(model, probe, delta, params=before)
    out: dict[str, dict[str, float]] = {}
    for est in ("kron", "full"):
        g = torch.Generator().manual_seed(seed + 7)
        e = ff.estimate(model, probe, delta, params=before, estimator=est, generator=g, samples=256)
        out[est] = {n: float(e[n] / exact[n]) for n in delta if float(exact[n]) > 0 and n in e}
    return out


def trace(
    task: Task,
    config: SweepConfig,
    scale: float,
    lr: float,
    seed: int,
    base: ff.FSLRRecord | None,
) -> dict[str, Any]:
    """One run, its unit-rate FSLRs recorded every 10 steps (each probe's own: ``beta=0``):
    static FLeRM from ``base`` (``base`` given; the recorder inside FLeRM's step measures the
    optimiser's own update, whose direction FLeRM's scaling keeps) or standard training;
    the estimator's bias measured at :data:`BIAS_STEPS`."""
    torch.manual_seed(seed)
    model = task.build(scale, seed)
    # beta=0: every probe's own estimate, not an EMA across probes (beta=0.9 at one probe
    # every 10 steps averages over about 100 steps), with 4x the sweep's samples per probe
    fm = ff.with_fslr(
        model, samples=4 * config.samples, seed=seed, strategy=config.strategy, beta=0.0
    )
    opt = torch.optim.Adam(fm.parameters(), lr=lr)
    probes = task.probe_batches(seed)
    flerm = None
    if base is not None:
        flerm = ff.FLeRM(fm, opt, base, probe_batches=probes, warmup_samples=config.warmup_samples)
    rec = ff.Recorder(
        fm,
        task.probe_batches(seed + 999),
        optimizer=opt,
        warmup_samples=4 * config.samples,
        every=10,
        start_step=0 if flerm is None else 10,
    )
    held_out = next(iter(task.probe_batches(seed + 12345)))
    bias: dict[str, Any] = {}
    losses = []
    it = iter(task.train_batches(seed))
    for t in range(config.steps):
        x, y = next(it)
        opt.zero_grad(set_to_none=True)
        loss = task.loss_fn(fm(x), y)
        losses.append(loss.item())
        loss.backward()
        before = (
            {n: p.detach().clone() for n, p in model.named_parameters()}
            if t in BIAS_STEPS
            else None
        )
        with contextlib.ExitStack() as stack:
            if flerm is not None:
                stack.enter_context(flerm.step())
            if flerm is None or t >= 10:
                stack.enter_context(rec.step(opt))
            opt.step()
        if before is not None:
            bias[str(t)] = _bias(model, before, held_out, seed)
    record = rec.record
    steps, fslr = list(record.steps), {n: list(v) for n, v in record.fslr.items()}
    if flerm is not None:  # the set point's own measurement at step 0
        point = flerm.history[0]
        steps = [0, *steps]
        fslr = {n: [point.fslr[n], *v] for n, v in fslr.items()}
        lrs = point.lrs
    else:
        lrs = dict.fromkeys(fslr, lr)
    return {
        "bias": bias,
        "loss": statistics.fmean(losses[-config.last :]),
        "steps": steps,
        "fslr": fslr,
        "lrs": lrs,
        "base": record.to_dict(),
    }


def _cell_runs(out: Path) -> dict[str, dict[str, Any]]:
    runs = {}
    for f in (out / "runs").glob("*.json"):
        d = json.loads(f.read_text())
        runs[RunSpec(d["mode"], d["scale"], d["lr"], d["seed"]).key] = d
    return runs


def tuned_rates(folder: Path, config: SweepConfig) -> tuple[float, float]:
    """Re-tuned standard training's best rate at the base scale and at the largest, from the
    matrix cell's cached runs."""
    runs = _cell_runs(folder)
    b, _ = best_rate(runs, "standard", config.base_scale, config.seeds)
    b8, _ = best_rate(runs, "standard", config.scales[-1], config.seeds)
    assert b is not None and b8 is not None, "run the matrix cell first"
    return b, b8


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", required=True, choices=sorted(CELLS))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--matrix", type=Path, default=Path("fslr_runs/matrix"))
    p.add_argument("--out", type=Path, default=Path("fslr_runs/diagnosis"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = CELLS[args.cell]
    folder = args.matrix / args.cell
    b, b8 = tuned_rates(folder, config)
    task = builtin_task(config)
    seeds = [int(s) for s in args.seeds.split(",")]
    result: dict[str, Any] = {"cell": args.cell, "b": b, "b8": b8, "seeds": {}}
    path = args.out / f"{args.cell}.json"
    if path.exists():
        result = json.loads(path.read_text())
    for seed in seeds:
        if str(seed) in result["seeds"]:
            continue
        print(f"seed {seed}: base 1x, static FLeRM 8x, standard 8x at b8", flush=True)
        base1 = trace(task, config, config.base_scale, b, seed, None)
        base = ff.FSLRRecord.from_dict(base1.pop("base"))
        flerm8 = trace(task, config, config.scales[-1], b, seed, base)
        std8 = trace(task, config, config.scales[-1], b8, seed, None)
        del flerm8["base"], std8["base"]
        result["seeds"][str(seed)] = {"flerm8": flerm8, "base1": base1, "std8": std8}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    report(result, config)
    return 0


WINDOWS = ((0, 0), (10, 40), (50, 90), (100, 10**9))


def _window(run: Mapping[str, Any], lo: int, hi: int) -> dict[str, float]:
    """Per tensor, the mean over the probes in steps ``[lo, hi]`` of the run's movement per
    step, rate times unit-rate FSLR."""
    idx = [i for i, t in enumerate(run["steps"]) if lo <= t <= hi]
    return {n: run["lrs"][n] * statistics.fmean(v[i] for i in idx) for n, v in run["fslr"].items()}


def _wlabel(lo: int, hi: int) -> str:
    return f"t={lo}" if lo == hi else (f"t={lo}-{hi}" if hi < 10**9 else f"t>={lo}")


def report(result: Mapping[str, Any], config: SweepConfig) -> None:
    """Print the tables of the module docstring from a diagnosis file."""
    b, b8 = result["b"], result["b8"]
    seeds = list(result["seeds"].values())
    head = " ".join(f"{_wlabel(*w):>10}" for w in WINDOWS)

    def table(title: str, ratio: Any) -> None:
        print(f"\n{title}\n{'tensor':<28} {head}")
        acc: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in WINDOWS])
        for s in seeds:
            for k, w in enumerate(WINDOWS):
                for role, v in by_role(ratio(s, *w)).items():
                    acc[role][k].append(v)
        for role, cols in acc.items():
            print(f"{role:<28} " + " ".join(f"{_gmean(c):>10.2f}" for c in cols))

    print(
        f"\n{result['cell']}: b = 2^{math.log2(b):.0f}, re-tuned 8x b8 = 2^{math.log2(b8):.0f}, "
        f"{len(seeds)} seeds (geometric means over seeds, blocks and the probes of a window)"
    )

    def moved(run: str) -> Any:
        def ratio(s: Mapping[str, Any], lo: int, hi: int) -> dict[str, float]:
            m8, m1 = _window(s[run], lo, hi), _window(s["base1"], lo, hi)
            return {n: m8[n] / m1[n] for n in m8}

        return ratio

    table(
        "1. static FLeRM at 8x: movement per step over the base's (1 at t=0 by construction; "
        "below 1: FLeRM under-moves the 8x model)",
        moved("flerm8"),
    )
    table(
        f"2. re-tuned standard at 8x (2^{math.log2(b8):.0f}): movement per step over the base's",
        moved("std8"),
    )

    def decay(run: str) -> Any:
        def ratio(s: Mapping[str, Any], lo: int, hi: int) -> dict[str, float]:
            m, m0 = _window(s[run], lo, hi), _window(s[run], 0, 0)
            return {n: m[n] / m0[n] for n in m}

        return ratio

    table(
        "3a. Adam's first step, 1x: unit-rate FSLR over its step-0 value (sign(g))", decay("base1")
    )
    table("3b. Adam's first step, 8x (static FLeRM): the same", decay("flerm8"))
    print("\n4. estimator / exact (geometric mean over seeds and blocks)")
    cols = [
        (w, run, e, t)
        for w, run in (("1x", "base1"), ("8x", "flerm8"))
        for e in ("kron", "full")
        for t in BIAS_STEPS
    ]
    print(
        f"{'tensor':<28} " + " ".join(f"{w + ' ' + e + ' t=' + str(t):>15}" for w, _, e, t in cols)
    )
    for role in by_role(seeds[0]["flerm8"]["bias"][str(BIAS_STEPS[0])]["kron"]):
        vals = [
            _gmean([by_role(s[run]["bias"][str(t)][e]).get(role, math.nan) for s in seeds])
            for _, run, e, t in cols
        ]
        print(f"{role:<28} " + " ".join(f"{v:>15.3f}" for v in vals))
    loss = {k: statistics.fmean(s[k]["loss"] for s in seeds) for k in ("flerm8", "base1", "std8")}
    print(
        f"\nlosses (seed mean): static FLeRM 8x at b {loss['flerm8']:.4f}, base 1x at b "
        f"{loss['base1']:.4f}, standard 8x at b8 {loss['std8']:.4f}"
    )


if __name__ == "__main__":
    sys.exit(main())
