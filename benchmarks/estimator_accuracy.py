"""Bias and spread of the estimators against the jvp ground truth, per tensor kind.

Run: ``python benchmarks/estimator_accuracy.py --plot docs/img/estimator_accuracy.png``
(about 5 minutes on 2 CPU cores; ``--probes 20`` for a quick look). For a ResMLP on mnist1d
and a small PreNorm transformer on byte-level text, both after a few Adam steps, the
unit-learning-rate Adam update of the next step is measured by ``exact`` and by ``--probes``
independent one-probe estimates with S samples each (no EMA), for every estimator and both
omega kinds. Printed per tensor kind: the median of ``estimate / exact`` (bias) and its 10th
and 90th percentiles (spread). This is the paper's appendix "bias and variance under different
covariance assumptions", on this library.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.experiments import ResMLP, Transformer, batches, lm_batches, mnist1d, pydoc_text
from fslr_func.probe.sampling import probe
from fslr_func.stats.estimator import SAMPLED_ESTIMATORS


def kind_of(name: str) -> str:
    """Coarse tensor kind for grouping (paper figure 1's bands)."""
    if name.startswith(("input", "embed", "pos")):
        return "input/embedding"
    if name.startswith("readout"):
        return "readout " + ("bias" if name.endswith("bias") else "weight")
    if name.endswith("bias"):
        return "hidden bias"
    if re.search(r"attn\.(q|k)\.", name):
        return "QK weight"
    if re.search(r"attn\.(v|o)\.", name):
        return "VO weight"
    return "hidden weight"


def adam_update(
    model: nn.Module, loss: Callable[[], Tensor], steps: int, lr: float
) -> dict[str, Tensor]:
    """Train ``steps`` Adam steps, then return the unit-lr update of one more step."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    loss().backward()
    opt.step()
    delta = {n: (p.detach() - before[n]) / lr for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    return delta


def setups() -> dict[str, tuple[nn.Module, object, dict[str, Tensor]]]:
    torch.manual_seed(0)
    data = mnist1d(num_samples=2000, seed=0)
    mlp = ResMLP(data.in_features, data.num_classes, width=64, depth=4)
    train = batches(data.x_train, data.y_train, 128, generator=0)

    def mlp_loss() -> Tensor:
        x, y = next(train)
        return nn.functional.cross_entropy(mlp(x), y)

    mlp_delta = adam_update(mlp, mlp_loss, steps=20, lr=2**-8)
    mlp_probe = next(batches(data.x_train, data.y_train, 128, generator=1))[0]

    text = pydoc_text()
    tf = Transformer(vocab_size=256, d_model=32, n_heads=2, d_ff=128, depth=2, seq_len=32)
    stream = lm_batches(text, batch_size=8, seq_len=32, generator=0)

    def tf_loss() -> Tensor:
        x, y = next(stream)
        return nn.functional.cross_entropy(tf(x).reshape(-1, 256), y.reshape(-1))

    tf_delta = adam_update(tf, tf_loss, steps=20, lr=2**-8)
    tf_probe = next(lm_batches(text, batch_size=8, seq_len=32, generator=1))[0]
    return {"ResMLP": (mlp, mlp_probe, mlp_delta), "Transformer": (tf, tf_probe, tf_delta)}


def measure(probes: int, samples: int) -> dict[tuple[str, str, str, str], list[float]]:
    """(model, kind, estimator, omega) -> ratios estimate / exact over probes and tensors."""
    ratios: dict[tuple[str, str, str, str], list[float]] = defaultdict(list)
    for model_name, (model, x, delta) in setups().items():
        truth = ff.exact(model, x, delta)
        for omega in ("gaussian", "rademacher"):
            g = torch.Generator().manual_seed(0)
            for _ in range(probes):
                result = probe(model, x, delta, samples=samples, omega=omega, generator=g)
                for est in SAMPLED_ESTIMATORS:
                    for n, value in result.fslr(est).items():
                        key = (model_name, kind_of(n), est, omega)
                        ratios[key].append(float(value / truth[n]))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--plot", default=None, help="write a figure to this PNG path")
    args = parser.parse_args()
    ratios = measure(args.probes, args.samples)
    print(f"estimate / exact over {args.probes} probes of S={args.samples} (no EMA)")
    header = f"{'model':<12} {'tensor kind':<16} {'estimator':<6} {'omega':<10}"
    print(f"{header} {'median':>7} {'p10':>6} {'p90':>6}")
    for (model_name, kind, est, omega), values in sorted(ratios.items()):
        qs = statistics.quantiles(values, n=10)
        print(
            f"{model_name:<12} {kind:<16} {est:<6} {omega:<10} {statistics.median(values):7.3f}"
            f" {qs[0]:6.3f} {qs[-1]:6.3f}"
        )
    if args.plot:
        plot(ratios, args.plot)


def plot(ratios: dict[tuple[str, str, str, str], list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({k[0] for k in ratios})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models) + 1.0, 4.2), squeeze=False)
    colours = {"kron": "tab:blue", "full": "tab:orange", "iid": "tab:green"}
    for ax, model_name in zip(axes[0], models, strict=True):
        kinds = sorted({k[1] for k in ratios if k[0] == model_name})
        width = 0.25
        for i, est in enumerate(SAMPLED_ESTIMATORS):
            data = [ratios[(model_name, kind, est, "gaussian")] for kind in kinds]
            pos = [j + (i - 1) * width for j in range(len(kinds))]
            parts = ax.boxplot(
                data,
                positions=pos,
                widths=width * 0.9,
                whis=(10, 90),
                showfliers=False,
                patch_artist=True,
            )
            for box in parts["boxes"]:
                box.set_facecolor(colours[est])
                box.set_alpha(0.6)
            ax.plot([], [], color=colours[est], lw=6, alpha=0.6, label=est)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(kinds)))
        ax.set_xticklabels(kinds, rotation=20, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("estimate / exact  (one probe, S = 8)")
        ax.set_title(f"{model_name}: FSLR estimators vs jvp ground truth")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="estimator")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
