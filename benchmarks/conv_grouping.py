"""Which grouping of a conv weight's dims makes ``kron`` closest to ``exact``?

The paper's tensor-normal estimator gives each dim of a weight its own Kronecker factor. For a
conv weight ``(out, in, kh, kw)`` that assumes the covariance of ``Z = dW * g`` factorises over
input channels and the two kernel offsets separately, which input patches do not satisfy. This
script measures candidate groupings (:func:`fslr_func.stats.estimator.grouped_shape`) against the
linearised ground truth :func:`fslr_func.probe.exact`:

* ``dims``: ``(out, in, kh, kw)`` (rank-3 for Conv1d: ``(out, in, k)``), the paper's;
* ``matrix``: ``(out, in * kh * kw)``, output channels by input patches (as in KFC);
* ``out_in_k``: ``(out, in, kh * kw)``, kernel offsets merged (Conv2d only);
* ``in_last``: ``(out * in, kh * kw)``, a pairing of filters against kernel offsets.

Protocol, per seed: a small conv net is initialised, trained with Adam for ``--steps`` steps
on training batches; the next Adam step's unit-learning-rate update ``dW`` is measured on a
held-out probe batch at the pre-step weights. Every grouping is probed with the same omega
draws (the same generator seed), with ``--samples`` samples, so the remaining noise of the
ratio is small next to the differences between groupings; ``full`` (unbiased) is printed as a
check of that noise. The ratio reported is ``estimate / exact`` of the FSLR (1 is exact).

Run: ``python benchmarks/conv_grouping.py`` (a few minutes on 2 CPU cores); ``--quick`` for a
smoke run. The figures in ``docs/grouping.md`` come from the default settings.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.probe.sampling import probe
from fslr_func.stats.estimator import fslr_from_log, log_sq_norm, mean_log_stats


def grouping_candidates() -> dict[str, Callable[[str, tuple[int, ...]], tuple[int, ...]] | str]:
    """The groupings measured: two built in, two as callables."""

    def out_in_k(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], shape[1], math.prod(shape[2:])) if len(shape) >= 4 else shape

    def in_last(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0] * shape[1], math.prod(shape[2:])) if len(shape) >= 3 else shape

    return {"dims": "dims", "matrix": "matrix", "out_in_k": out_in_k, "in_last": in_last}


class Conv2dNet(nn.Module):
    """Conv2d layers of several shapes on 8x8 digits: 3x3, 5x5 strided, grouped, depthwise."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 5, padding=2, stride=2)
        self.c3 = nn.Conv2d(32, 32, 3, padding=1, groups=4)
        self.c4 = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.c5 = nn.Conv2d(32, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = x.reshape(-1, 1, 8, 8)
        for conv in (self.c1, self.c2, self.c3, self.c4, self.c5):
            h = torch.relu(conv(h))
        return self.head(h.mean(dim=(2, 3)))


class Conv1dNet(nn.Module):
    """Conv1d layers on MNIST-1D (40 points): kernel 5 strided, kernel 3, grouped."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(1, 16, 5, padding=2, stride=2)
        self.c2 = nn.Conv1d(16, 32, 3, padding=1)
        self.c3 = nn.Conv1d(32, 32, 3, padding=1, groups=4)
        self.head = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = x.reshape(x.shape[0], 1, -1)
        for conv in (self.c1, self.c2, self.c3):
            h = torch.relu(conv(h))
        return self.head(h.mean(dim=2))


def data(kind: str) -> tuple[Tensor, Tensor]:
    """Inputs and labels: digits (8x8) for Conv2d, MNIST-1D for Conv1d, float32."""
    from fslr_func.experiments import digits, mnist1d

    split = digits() if kind == "conv2d" else mnist1d(num_samples=2000)
    return split.x_train.float(), split.y_train


def batches(x: Tensor, y: Tensor, size: int, g: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
    while True:
        idx = torch.randint(0, len(y), (size,), generator=g)
        yield x[idx], y[idx]


def measure(kind: str, seed: int, steps: int, samples: int, batch: int, lr: float) -> dict:
    """Ratios estimate / exact of every conv weight, for every grouping, at one seed."""
    torch.manual_seed(seed)
    model: nn.Module = Conv2dNet() if kind == "conv2d" else Conv1dNet()
    x, y = data(kind)
    it = batches(x, y, batch, torch.Generator().manual_seed(seed))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.functional.cross_entropy
    for _ in range(steps):
        xb, yb = next(it)
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        opt.step()
    xb, yb = next(it)
    probe_x, _ = next(it)
    opt.zero_grad()
    loss_fn(model(xb), yb).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    convs = [n for n, p in model.named_parameters() if p.dim() >= 3]
    delta = {n: (p.detach() - before[n]) / lr for n, p in model.named_parameters() if n in convs}
    exact = ff.exact(model, probe_x, delta, params=before)
    out: dict[str, dict[str, float]] = {n: {} for n in convs}
    small: dict[str, dict[str, float]] = {n: {} for n in convs}
    for label, grouping in grouping_candidates().items():
        r = probe(
            model,
            probe_x,
            delta,
            params=before,
            samples=samples,
            generator=torch.Generator().manual_seed(10_000 + seed),
            grouping=grouping,
            readout=None,
        )
        for n in convs:
            ls = r.log_stats[n]
            kinds = [("kron", label)] + (
                [("full", "full"), ("iid", "iid")] if label == "dims" else []
            )
            for estimator, key in kinds:
                log_e = mean_log_stats(ls)
                out[n][key] = float(fslr_from_log(log_sq_norm(log_e, estimator)) / exact[n])
                # One probe of the default S = 8 samples: bias and variance together.
                chunks = ls[: len(ls) // 8 * 8].reshape(-1, 8, ls.shape[1])
                errors = [
                    abs(float(0.5 * log_sq_norm(mean_log_stats(c), estimator) - exact[n].log()))
                    for c in chunks
                ]
                small[n][key] = statistics.mean(errors)
    shapes = {n: tuple(before[n].shape) for n in convs}
    return {"ratios": out, "shapes": shapes, "s8_log_error": small}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, nargs="+", default=[3, 30])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--quick", action="store_true", help="2 seeds, 100 samples, 3 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.samples, args.steps = 2, 100, [3]
    torch.set_num_threads(1)  # small convs: a second thread only adds contention on CPU
    labels = [*grouping_candidates(), "full", "iid"]
    all_ratios: dict[str, list[float]] = {label: [] for label in labels}
    all_s8: dict[str, list[float]] = {label: [] for label in labels}
    print(
        f"ratio estimate/exact of the FSLR; mean (sd) over {args.seeds} seeds; "
        f"{args.samples} samples per probe, probe batch {args.batch}, Adam lr {args.lr}"
    )
    for kind in ("conv2d", "conv1d"):
        for steps in args.steps:
            start = time.time()
            runs = [
                measure(kind, s, steps, args.samples, args.batch, args.lr)
                for s in range(args.seeds)
            ]
            print(f"\n{kind}, after {steps} Adam steps ({time.time() - start:.0f} s)")
            print("| layer | shape | " + " | ".join(labels) + " |")
            print("|---|---|" + "---|" * len(labels))
            for n, shape in runs[0]["shapes"].items():
                cells = []
                for label in labels:
                    vals = [run["ratios"][n][label] for run in runs]
                    all_ratios[label] += vals
                    all_s8[label] += [run["s8_log_error"][n][label] for run in runs]
                    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                    cells.append(f"{statistics.mean(vals):.2f} ({sd:.2f})")
                print(f"| {n} | {'x'.join(map(str, shape))} | " + " | ".join(cells) + " |")

    print(
        f"\nover every conv weight, seed and step count: mean |log(estimate / exact)| with "
        f"{args.samples} samples (the bias), its worst ratio, and mean |log(estimate / exact)| "
        f"of single probes of 8 samples (bias and variance):"
    )
    print("| estimate | mean abs log error | worst ratio | single-probe (S=8) abs log error |")
    print("|---|---|---|---|")
    for label, ratios in all_ratios.items():
        errors = [abs(math.log(r)) for r in ratios]
        worst = max(ratios, key=lambda r: abs(math.log(r)))
        s8 = statistics.mean(all_s8[label])
        print(f"| {label} | {statistics.mean(errors):.3f} | {worst:.2f} | {s8:.3f} |")


if __name__ == "__main__":
    main()
