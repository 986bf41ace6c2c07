"""Does it matter whether a small readout is in place for the first gradient? muP's forward
and rates on a matrix cell's 8x model, the readout scaled by muP's ``1/sqrt(m)`` before the
first backward (muP itself) or after it (as ``ReadoutInitFLeRM`` did), in one run per seed.

Under Adam the first update is ``-lr sign(g)`` either way, but the optimiser's moments keep
the first gradient: taken on the unscaled model, the upstream tensors' gradient is about
``1/c`` times the scaled model's, and its square dominates Adam's second moment for many
steps. ``--regrad`` adds the approximate repair (the upstream gradients times ``c``).

Run: ``nice -n 15 python benchmarks/readout_first_gradient.py --cell conv1d-w32-s150
--lr 2^-6 --seeds 0,1`` (about a minute a seed on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_matrix import CELLS

from fslr_func.experiments.cli_args import parse_lrs
from fslr_func.experiments.mup import base_shapes, mup_groups, readouts
from fslr_func.experiments.task import builtin_task
from fslr_func.experiments.train import last_mean, make_optimizer, train

SCALE = 8


def run(cell: str, lr: float, seed: int, when: str) -> float:
    """Training loss of the 8x model under muP's rates, the readout scaled ``when``."""
    config = CELLS[cell]
    task = builtin_task(config)
    shapes = base_shapes(task.build, config.base_scale, seed)
    torch.manual_seed(seed)
    model = task.build(SCALE, seed)
    ((name, m),) = readouts(model, shapes).items()  # muP's readout and its width multiplier
    readout: Any = model.get_submodule(name)
    c = m**-0.5
    groups = mup_groups(model, shapes, lr)
    for g in groups:  # muP's readout rate lr / m is the divided forward's rate c^2 lr
        if g["name"] == f"{name}.weight":
            g["lr"] = lr * c * c
    upstream = [p for n, p in model.named_parameters() if not n.startswith(f"{name}.")]
    if when == "before":
        with torch.no_grad():
            readout.weight.mul_(c)
    opt = make_optimizer("adam", groups, lr, 0.0)

    @contextlib.contextmanager
    def scaled_after_first_backward(t: int) -> Iterator[None]:
        if t == 0 and when != "before":
            with torch.no_grad():
                readout.weight.mul_(c)
                if when == "after+regrad":
                    for p in upstream:
                        if p.grad is not None:
                            p.grad.mul_(c)
        yield

    losses = train(
        model,
        task.train_batches(seed),
        opt,
        config.steps,
        task.loss_fn,
        around_step=scaled_after_first_backward,
    )
    return last_mean(losses, config.last)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", default="conv1d-w32-s150", choices=sorted(CELLS))
    p.add_argument("--lr", default="2^-6", help="the base rate b, e.g. 2^-6")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--regrad", action="store_true", help="also: after, upstream grads times c")
    args = p.parse_args()
    (lr,) = parse_lrs(args.lr)
    seeds = [int(s) for s in args.seeds.split(",")]
    whens = ["before", "after"] + (["after+regrad"] if args.regrad else [])
    print(f"{args.cell}, 8x width, muP's rates at b = {args.lr}, seeds {args.seeds}")
    for when in whens:
        losses = [run(args.cell, lr, s, when) for s in seeds]
        per_seed = " ".join(f"{x:.3f}" for x in losses)
        print(
            f"readout scaled {when:13s} the first gradient: "
            f"{statistics.mean(losses):.3f} ({per_seed})"
        )


if __name__ == "__main__":
    main()
