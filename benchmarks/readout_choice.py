"""What ``readout_built_auto`` chooses on a matrix cell: the hidden tensors' mean feature
factor on muP's readout (the scaled model's feature gain over the base's, measured at the
first set point; below 1/2 they are matched in feature space, else in output space), per
seed, from the base record a variant run of the cell cached.

Run (after ``benchmarks/transfer_matrix.py --cells CELL --variant readout_built_auto``, or
another variant that records feature gains, named by ``--records-of``):
``python benchmarks/readout_choice.py --cell CELL --lr b`` (seconds a seed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_matrix import ALL_CELLS

from fslr_func.experiments.cli_args import parse_lrs
from fslr_func.experiments.configs import lr_key
from fslr_func.experiments.task import builtin_task
from fslr_func.experiments.train import make_optimizer, train
from fslr_func.experiments.variants import ReadoutWidthBuiltFLeRM
from fslr_func.io.record import FSLRRecord
from fslr_func.training.wrap import with_fslr


def choice(cell: str, lr: float, seed: int, records: Path) -> tuple[float, str]:
    """The mean factor and the matching ``readout_built_auto`` chooses at 8x, one seed."""
    config = ALL_CELLS[cell]
    task = builtin_task(config)
    base = FSLRRecord.load(records / f"lr={lr_key(lr)}_mean.json")
    torch.manual_seed(seed)
    model = task.build(8, seed)
    fm = with_fslr(model, seed=seed, output_fn=task.output_fn, samples=config.samples)
    opt = make_optimizer(config.optimizer, fm.parameters(), lr, config.weight_decay)
    flerm = ReadoutWidthBuiltFLeRM(
        fm,
        opt,
        base,
        probe_batches=task.probe_batches(seed),
        warmup_samples=config.warmup_samples,
        hidden_features=0.5,
    )
    train(fm, task.train_batches(seed), opt, 1, task.loss_fn, around_step=lambda t: flerm.step())
    assert flerm.hidden_factor is not None, "no hidden tensor has a feature gain"
    return flerm.hidden_factor, flerm.hidden_matched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", required=True, choices=sorted(ALL_CELLS))
    p.add_argument("--lr", required=True, help="the base rate b, e.g. 2^-6")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--out", default="fslr_runs/matrix")
    p.add_argument(
        "--records-of",
        default="readout_built_auto",
        help="the variant whose cached base records to read (any that records feature gains)",
    )
    args = p.parse_args()
    (lr,) = parse_lrs(args.lr)
    records = Path(args.out) / f"{args.cell}+{args.records_of}" / "records"
    for seed in (int(s) for s in args.seeds.split(",")):
        mean, matched = choice(args.cell, lr, seed, records)
        print(f"{args.cell} seed {seed}: mean factor {mean:.3f} -> {matched}")


if __name__ == "__main__":
    main()
