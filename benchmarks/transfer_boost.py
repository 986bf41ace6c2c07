"""Which tensors does FLeRM under-set at width? Multiply some tensors' FLeRM rates by a factor.

For a matrix cell (``benchmarks/transfer_matrix.py``; its base records at the base's best rate
``b`` are read from the cell's folder), static FLeRM at 8x and rate ``b`` (the cell's own
runs: Adam, the seed-mean record), except that after the set point the rates of the tensors
whose names match a regex are multiplied by a factor (``FLeRM.ratios``, from step 1 on).
With ``--scales 1`` the same factor multiplies those tensors' rates in the base model
(standard training at ``b``): does the base itself want them moved more? Prints the loss per
factor (mean and each seed).

Run, e.g.: ``nice -n 15 python benchmarks/transfer_boost.py --cell resmlp-w32-s300 --regex
'blocks.*weight' --factors 1,2,2.83,4``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import fslr_func as ff
from fslr_func.experiments.configs import lr_key
from fslr_func.experiments.matrix import best_rate
from fslr_func.experiments.task import builtin_task
from fslr_func.experiments.train import last_mean, train

sys.path.insert(0, str(Path(__file__).parent))
from transfer_diagnosis import _cell_runs
from transfer_matrix import CELLS, EXTRA_CELLS


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", required=True)
    p.add_argument("--regex", required=True, help="tensors whose rate is multiplied (fullmatch)")
    p.add_argument("--factors", default="1,2,4")
    p.add_argument("--scales", default="8", help="1 (the base), 8 (FLeRM at 8x), or both")
    p.add_argument("--matrix", type=Path, default=Path("fslr_runs/matrix"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = {**CELLS, **EXTRA_CELLS}[args.cell]
    folder = args.matrix / args.cell
    b, _ = best_rate(_cell_runs(folder), "standard", config.base_scale, config.seeds)
    assert b is not None, "run the matrix cell first"
    base = ff.FSLRRecord.load(folder / "records" / f"lr={lr_key(b)}_mean.json")
    task = builtin_task(config)
    rx = re.compile(args.regex)

    def run(scale: float, k: float, seed: int) -> float:
        torch.manual_seed(seed)
        model = task.build(scale, seed)
        fm = ff.with_fslr(model, samples=config.samples, seed=seed, strategy=config.strategy)
        if scale == config.base_scale:
            groups = [
                {"params": [w], "lr": b * (k if rx.fullmatch(n) else 1.0)}
                for n, w in model.named_parameters()
            ]
            opt = torch.optim.Adam(groups, lr=b)
            losses = train(fm, task.train_batches(seed), opt, config.steps, task.loss_fn)
            return last_mean(losses, config.last)
        opt = torch.optim.Adam(fm.parameters(), lr=b)
        flerm = ff.FLeRM(
            fm,
            opt,
            base,
            probe_batches=task.probe_batches(seed),
            warmup_samples=config.warmup_samples,
        )

        def boost(t: int, m: object, o: object) -> None:
            if t == 0:
                for n in flerm.ratios:
                    if rx.fullmatch(n):
                        flerm.ratios[n] *= k

        losses = train(
            fm,
            task.train_batches(seed),
            opt,
            config.steps,
            task.loss_fn,
            around_step=lambda t: flerm.step(),
            on_step=boost,
        )
        return last_mean(losses, config.last)

    for scale in (float(s) for s in args.scales.split(",")):
        for k in (float(f) for f in args.factors.split(",")):
            ls = [run(scale, k, s) for s in range(config.seeds)]
            print(
                f"{args.cell} {scale:g}x {args.regex!r} x{k:g}: {statistics.fmean(ls):.4f} "
                f"(seeds {', '.join(f'{v:.3f}' for v in ls)})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
