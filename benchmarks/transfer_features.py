r"""Feature movement against output movement at width (issue 23): why matching each hidden
tensor's *output* movement to the base's starves feature learning in the standard
parametrisation.

For a matrix cell (ResMLP or conv net: models with ``features(x)``, the readout's input), at
steps 0, 50 and 100 of four runs, every tensor's actual update :math:`\Delta W` (rate
included) is pushed through the linearised model with :func:`fslr_func.probe.exact` twice: to the
output (:math:`\|J_f \Delta W\|_\mathrm{RMS}`, the FSLR times the rate) and to the features
(:math:`\|J_h \Delta W\|_\mathrm{RMS}`, RMS over samples and feature coordinates). Runs: the
base (1x, standard training at its best rate :math:`b`), and at 8x static FLeRM at :math:`b`,
standard training at its re-tuned best :math:`b_8` and muP at :math:`b`. Printed per tensor
role: each 8x run's movement over the base's, output and features (geometric means over
seeds, blocks and the three steps).

Run: ``nice -n 15 python benchmarks/transfer_features.py --cell resmlp-w32-s300`` (after the
matrix cell; seeds 0 and 1).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fslr_func as ff
from fslr_func.experiments.configs import lr_key
from fslr_func.experiments.mup import apply_mup, base_shapes
from fslr_func.probe.names import block_role

sys.path.insert(0, str(Path(__file__).parent))
from transfer_diagnosis import tuned_rates
from transfer_matrix import CELLS

from fslr_func.experiments.task import builtin_task

STEPS = (0, 50, 100)


class Features(nn.Module):
    """``model.features`` as a module's output (the readout's input)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m.features(x)  # type: ignore[operator,no-any-return]


def trace(
    task: Any,
    config: Any,
    scale: float,
    lr: float,
    seed: int,
    mode: str,
    base: ff.FSLRRecord | None,
) -> dict[int, dict[str, tuple[float, float]]]:
    """Per measured step, tensor -> (output movement, feature movement) of its update."""
    torch.manual_seed(seed)
    model = task.build(scale, seed)
    params: Any = model.parameters()
    if mode == "mup":
        params = apply_mup(model, base_shapes(task.build, config.base_scale, seed), lr)
    fm = ff.with_fslr(model, samples=config.samples, seed=seed, strategy=config.strategy)
    opt = torch.optim.Adam(params, lr=lr)
    flerm = None
    if mode == "flerm":
        assert base is not None
        flerm = ff.FLeRM(
            fm,
            opt,
            base,
            probe_batches=task.probe_batches(seed),
            warmup_samples=config.warmup_samples,
        )
    held_out = next(iter(task.probe_batches(seed + 12345)))
    feats = Features(model)
    out: dict[int, dict[str, tuple[float, float]]] = {}
    it = iter(task.train_batches(seed))
    for t in range(max(STEPS) + 1):
        x, y = next(it)
        opt.zero_grad(set_to_none=True)
        task.loss_fn(fm(x), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if flerm is not None:
            with flerm.step():
                opt.step()
        else:
            opt.step()
        if t in STEPS:
            delta = {n: p.detach() - before[n] for n, p in model.named_parameters()}
            o = ff.exact(model, held_out, delta, params=before)
            f = ff.exact(
                feats,
                held_out,
                {f"m.{n}": d for n, d in delta.items()},
                params={f"m.{n}": v for n, v in before.items()},
            )
            out[t] = {n: (float(o[n]), float(f[f"m.{n}"])) for n in delta}
    return out


def _gmean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else math.nan


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", required=True, choices=sorted(CELLS))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--matrix", type=Path, default=Path("fslr_runs/matrix"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = CELLS[args.cell]
    folder = args.matrix / args.cell
    b, b8 = tuned_rates(folder, config)
    base = ff.FSLRRecord.load(folder / "records" / f"lr={lr_key(b)}_mean.json")
    task = builtin_task(config)
    top = config.scales[-1]
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for seed in (int(s) for s in args.seeds.split(",")):
        ref = trace(task, config, config.base_scale, b, seed, "standard", None)
        for label, lr, mode in (
            ("flerm", b, "flerm"),
            ("std-retuned", b8, "standard"),
            ("mup", b, "mup"),
        ):
            got = trace(task, config, top, lr, seed, mode, base)
            for t in STEPS:
                for n, (o, f) in got[t].items():
                    ro, rf = ref[t][n]
                    ratios[block_role(n)][f"{label} out"].append(o / ro)
                    ratios[block_role(n)][f"{label} feat"].append(f / rf if rf else math.nan)
        print(f"seed {seed} done", flush=True)
    cols = [f"{m} {k}" for m in ("flerm", "std-retuned", "mup") for k in ("out", "feat")]
    print(
        f"\n{args.cell}: 8x movement over the base's (b = 2^{math.log2(b):.0f}, b8 = "
        f"2^{math.log2(b8):.0f}), exact, steps {STEPS}, seeds {args.seeds}"
    )
    print(f"{'tensor':<26} " + " ".join(f"{c:>16}" for c in cols))
    for role, vals in ratios.items():
        print(f"{role:<26} " + " ".join(f"{_gmean(vals[c]):>16.2f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
