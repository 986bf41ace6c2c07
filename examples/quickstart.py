"""Quickstart: measure the function-space learning rates of a small ResMLP during Adam steps.

Run: ``python examples/quickstart.py``. Prints one row per parameter tensor with its FSLR
(the RMS change of the network's outputs caused by that tensor's update at learning rate 1),
the learning rate in force and their product (the actual output movement per step).
"""

from __future__ import annotations

import torch
from torch import nn

import fslr_func as ff
from fslr_func.experiments import ResMLP, batches, digits


def main(steps: int = 20, lr: float = 1e-3, seed: int = 0) -> dict[str, float]:
    torch.manual_seed(seed)
    data = digits()
    model = ResMLP(data.in_features, data.num_classes, width=128, depth=4)
    fm = ff.with_fslr(model, samples=8, seed=seed)  # fm(x) == model(x)
    opt = torch.optim.Adam(fm.parameters(), lr=lr)
    train = batches(data.x_train, data.y_train, batch_size=64, generator=seed)
    probe = batches(data.x_train, data.y_train, batch_size=64, generator=seed + 1)

    for step in range(steps):
        x, y = next(train)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(fm(x), y)
        loss.backward()
        # Warm the EMAs up with 5 probe batches on the first step, then one per step.
        probe_inputs = [next(probe)[0] for _ in range(5 if step == 0 else 1)]
        with fm.measure(opt, probe_inputs) as m:
            opt.step()

    fslr = {n: float(v) for n, v in fm.fslr().items()}
    print(f"after {steps} Adam steps (lr={lr}), loss {loss.item():.3f}")
    print(f"{'tensor':<22} {'FSLR (lr=1)':>12} {'lr':>8} {'FSLR x lr':>10}")
    for name, value in fslr.items():
        print(f"{name:<22} {value:>12.4g} {m.lrs[name]:>8.0e} {value * m.lrs[name]:>10.3g}")
    return fslr


if __name__ == "__main__":
    main()
