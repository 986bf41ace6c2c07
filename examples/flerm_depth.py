"""FLeRM across depth: record a base ResMLP, then train a 4x deeper one with and without FLeRM.

For each learning rate of a small sweep, the base model (2 residual blocks) is trained on
scikit-learn's digits while a ``Recorder`` stores its FSLRs (mean over 2 seeds). A model with 4x
as many blocks is then trained at the same learning rate twice: plainly, and with ``FLeRM``
matching the base FSLRs under the ``share_blocks`` policy (paper section 3.3: the FSLR of base
block ``m`` is shared by the 4 deep blocks replacing it, each targeting a quarter of it; input
and readout layers map one to one). Static mode: rates set once, after the EMA warm-up at step
0. The table shows the training loss averaged over the last 25 steps (the paper's metric).

Run: ``python examples/flerm_depth.py`` (a few seconds on one CPU core).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

import fslr_func as ff
from fslr_func import FLeRM, FSLRRecord, Recorder
from fslr_func.experiments import ResMLP, batches, digits, last_mean

DATA = digits()


def probe_batches(seed: int) -> Iterator[Tensor]:
    """Probe inputs: their own shuffled stream, separate from the training batches."""
    return (x for x, _ in batches(DATA.x_train, DATA.y_train, 64, generator=1000 + seed))


def run(
    depth: int,
    lr: float,
    steps: int,
    seed: int,
    base: FSLRRecord | None = None,
    record: bool = False,
) -> tuple[float, FSLRRecord | None]:
    """Train one ResMLP in a plain loop; record its FSLRs or run FLeRM from ``base``."""
    torch.manual_seed(seed)
    fm = ff.with_fslr(ResMLP(DATA.in_features, DATA.num_classes, width=32, depth=depth), seed=seed)
    opt = torch.optim.Adam(fm.parameters(), lr=lr)
    recorder = Recorder(fm, probe_batches(seed), every=50, meta={"seed": seed}) if record else None
    flerm = None
    if base is not None:
        flerm = FLeRM(fm, opt, base, probe_batches=probe_batches(seed), policy="share_blocks")
    losses = []
    for x, y in itertools.islice(batches(DATA.x_train, DATA.y_train, 64, generator=seed), steps):
        opt.zero_grad()
        loss = F.cross_entropy(fm(x), y)
        loss.backward()
        losses.append(loss.item())
        if recorder is not None:
            with recorder.step(opt):
                opt.step()
        elif flerm is not None:
            with flerm.step():
                opt.step()
        else:
            opt.step()
    return last_mean(losses, 25), recorder.record if recorder is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--depth", type=int, default=2, help="base number of blocks")
    parser.add_argument("--mult", type=int, default=4, help="depth multiplier")
    parser.add_argument("--seeds", type=int, default=2, help="base seeds averaged")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    args = parser.parse_args()
    for name in ("steps", "depth", "mult", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)  # tiny models: one thread is fastest

    deep = args.depth * args.mult
    print(f"ResMLP on digits, {args.steps} Adam steps; loss = mean of the last 25 steps")
    print(
        f"{'lr':>8} | {'base L=' + str(args.depth):>10} | {'plain L=' + str(deep):>12} | "
        f"{'FLeRM L=' + str(deep):>12}"
    )
    table = []
    for lr in args.lrs:
        results = [run(args.depth, lr, args.steps, s, record=True) for s in range(args.seeds)]
        base = FSLRRecord.mean(r for _, r in results if r is not None)
        row = (
            sum(loss for loss, _ in results) / len(results),
            run(deep, lr, args.steps, seed=0)[0],
            run(deep, lr, args.steps, seed=0, base=base)[0],
        )
        table.append(row)
        print(f"{lr:8.0e} | {row[0]:10.4f} | {row[1]:12.4f} | {row[2]:12.4f}")
    best = [args.lrs[min(range(len(table)), key=lambda i: table[i][c])] for c in range(3)]
    print(f"{'best lr':>8} | {best[0]:10.0e} | {best[1]:12.0e} | {best[2]:12.0e}")


if __name__ == "__main__":
    main()
