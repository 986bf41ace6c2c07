"""scale_readout: muP's readout scale sqrt(n_base / n) on the readout's weight, once, before
the first gradient; every input it cannot scale correctly is refused with the reason."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fslr_func as ff
from fslr_func.training.feature_gains import NoReadoutError


def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, width), nn.ReLU(), nn.Linear(width, 3))


def _base(**shapes: list[int]) -> ff.FSLRRecord:
    """A record with only the base's shapes: ``_base(w2=[3, 8])`` for ``"2.weight"``."""
    return ff.FSLRRecord(meta={"shapes": {_name(k): v for k, v in shapes.items()}})


def _name(key: str) -> str:
    """``w2`` -> ``2.weight``, ``body_w2`` -> ``body.2.weight``."""
    prefix, _, layer = key.rpartition("w")
    return prefix.replace("_", ".") + f"{layer}.weight"


X = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))


def test_scales_only_the_readout_weight_by_the_root_of_the_fan_in_ratio():
    model, reference = _mlp(32), _mlp(32)
    scale = ff.scale_readout(ff.with_fslr(model), _base(w0=[8, 5], w2=[3, 8]), X)
    assert scale == pytest.approx(0.5)  # sqrt(8 / 32)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        expected = scale * q if name == "2.weight" else q
        assert torch.equal(p.detach(), expected.detach()), name


def test_a_convolution_readout_counts_channels_times_kernel_as_its_fan_in():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 64, 3), nn.ReLU(), nn.Conv1d(64, 4, 3))
    scale = ff.scale_readout(ff.with_fslr(model), _base(w2=[4, 8, 3]), torch.randn(2, 1, 9))
    assert scale == pytest.approx(math.sqrt(8 * 3 / (64 * 3)))


def test_a_weight_stored_in_out_counts_its_first_dim_as_the_fan_in():
    # ConvTranspose (in, out, k) and Hugging Face's Conv1D (in, out): the scale was
    # computed from out x k, 1.0 here, and the readout silently left as it was
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 32, 3), nn.ReLU(), nn.ConvTranspose1d(32, 4, 3))
    before = model[2].weight.detach().clone()
    scale = ff.scale_readout(ff.with_fslr(model), _base(w2=[8, 4, 3]), torch.randn(2, 1, 9))
    assert scale == pytest.approx(math.sqrt(8 * 3 / (32 * 3)))
    torch.testing.assert_close(model[2].weight.detach(), before * scale)


def test_an_unchanged_fan_in_changes_nothing():
    model, reference = _mlp(8), _mlp(8)  # depth, init scale, LoRA rank: the base's readout
    assert ff.scale_readout(ff.with_fslr(model), _base(w2=[3, 8]), X) == 1.0
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


def test_finding_the_readout_leaves_no_trace_in_buffers_or_random_streams():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 3))
    stats = {n: b.clone() for n, b in model.named_buffers()}
    fm = ff.with_fslr(model)
    torch.manual_seed(5)
    ff.scale_readout(fm, _base(w3=[3, 8]), X)
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))  # dropout's draws were not taken from the stream
    assert all(torch.equal(b, stats[n]) for n, b in model.named_buffers())


def test_a_second_call_is_refused_rather_than_scaling_twice():
    fm, base = ff.with_fslr(_mlp(32)), _base(w2=[3, 8])
    ff.scale_readout(fm, base, X)
    weight = fm.module[2].weight.detach().clone()
    with pytest.raises(ValueError, match="already scaled"):
        ff.scale_readout(fm, base, X)
    assert torch.equal(fm.module[2].weight, weight)


def test_a_named_readout_needs_no_example_batch_and_auto_does():
    base = _base(w2=[3, 8])
    assert ff.scale_readout(ff.with_fslr(_mlp(32), readout="2"), base) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="example batch"):
        ff.scale_readout(ff.with_fslr(_mlp(32)), base)
    with pytest.raises(ValueError, match="not a module"):
        ff.scale_readout(ff.with_fslr(_mlp(32), readout="head"), base)


def test_a_model_without_a_readout_layer_is_refused():
    with pytest.raises(NoReadoutError, match="readout=None"):
        ff.scale_readout(ff.with_fslr(_mlp(32), readout=None), _base(w2=[3, 8]), X)

    class Doubled(nn.Module):  # the output is computed after the last layer
        def __init__(self) -> None:
            super().__init__()
            self.body = _mlp(32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.body(x)

    with pytest.raises(NoReadoutError, match="found no readout"):
        ff.scale_readout(ff.with_fslr(Doubled()), _base(body_w2=[3, 8]), X)


def test_weights_it_cannot_scale_alone_are_refused():
    tied = nn.Sequential(nn.Embedding(10, 32), nn.Linear(32, 10, bias=False))
    tied[1].weight = tied[0].weight  # GPT-2's head: shrinking it shrinks the embedding
    with pytest.raises(ValueError, match="tied"):
        ff.scale_readout(ff.with_fslr(tied, readout="1"), _base(w1=[10, 8]))
    normed = _mlp(32)
    normed[2] = nn.utils.parametrizations.weight_norm(normed[2])
    with pytest.raises(ValueError, match="parametrization"):
        ff.scale_readout(ff.with_fslr(normed, readout="2"), _base(w2=[3, 8]))


def test_a_base_record_without_the_readouts_shape_or_rank_is_refused():
    with pytest.raises(ValueError, match="no shape"):
        ff.scale_readout(ff.with_fslr(_mlp(32)), ff.FSLRRecord(), X)
    with pytest.raises(ValueError, match="rank 2 or more"):
        ff.scale_readout(ff.with_fslr(_mlp(32)), _base(w2=[8]), X)
    with pytest.raises(TypeError, match="FSLRRecord"):
        ff.scale_readout(ff.with_fslr(_mlp(32)), {"shapes": {}}, X)  # type: ignore[arg-type]


def _record(width: int, dtype: torch.dtype = torch.float32) -> ff.FSLRRecord:
    fm = ff.with_fslr(_mlp(width).to(dtype), samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    recorder = ff.Recorder(
        fm, (torch.randn(8, 5, generator=g).to(dtype) for _ in range(100)), optimizer=opt,
        warmup_samples=4, every=2,
    )  # fmt: skip
    for _ in range(7):
        opt.zero_grad()
        fm(torch.randn(8, 5, generator=g).to(dtype)).float().square().mean().backward()
        with recorder.step():
            opt.step()
    return recorder.record


def test_flerm_on_the_scaled_readout_trains_under_bf16_a_grad_scaler_and_fused_adam():
    base = _record(8)
    model = _mlp(32)
    fm = ff.with_fslr(model, samples=4, seed=0)
    g = torch.Generator().manual_seed(4)
    probes = (torch.randn(8, 5, generator=g) for _ in range(1000))
    assert ff.scale_readout(fm, base, next(probes)) == pytest.approx(0.5)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2, fused=True)
    flerm = ff.FLeRM(
        fm, opt, base, probe_batches=probes, warmup_samples=4, mode="periodic", every=2
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    losses = []
    with flerm.attach():
        for _ in range(6):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fm(torch.randn(8, 5, generator=g)).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert [p.step for p in flerm.history] == [0, 2, 4]
    assert all(math.isfinite(r) and r > 0 for r in flerm.lrs().values())


def test_bf16_parameters_are_scaled_in_their_dtype():
    model = _mlp(32).to(torch.bfloat16)
    before = model[2].weight.detach().clone()
    ff.scale_readout(ff.with_fslr(model), _base(w2=[3, 8]), X.to(torch.bfloat16))
    assert model[2].weight.dtype == torch.bfloat16
    assert torch.equal(model[2].weight.detach(), before * 0.5)  # a power of 2: exact


def test_a_checkpoint_carries_the_scale_so_a_resume_cannot_scale_twice(tmp_path):
    """Resumed in the wrong order (checkpoint loaded, then ``scale_readout``), the readout
    was scaled twice without a word: the wrapper's state now carries the scale."""
    base = _base(w2=[3, 8])
    fm = ff.with_fslr(_mlp(32))
    ff.scale_readout(fm, base, X)
    torch.save(fm.state_dict(), tmp_path / "ckpt.pt")
    resumed = ff.with_fslr(_mlp(32))
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    weight = resumed.module[2].weight.detach().clone()
    with pytest.raises(ValueError, match=r"already scaled.*before load_state_dict"):
        ff.scale_readout(resumed, base, X)
    assert torch.equal(resumed.module[2].weight, weight)
    in_order = ff.with_fslr(_mlp(32))  # the documented order: scale, then load
    ff.scale_readout(in_order, base, X)
    in_order.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert torch.equal(in_order.module[2].weight, weight)
    # a checkpoint of an unscaled run holds unscaled weights: loading it drops the mark
    unscaled = ff.with_fslr(_mlp(32))
    torch.save(unscaled.state_dict(), tmp_path / "plain.pt")
    in_order.load_state_dict(torch.load(tmp_path / "plain.pt"))
    assert ff.scale_readout(in_order, base, X) == pytest.approx(0.5)


def test_a_compiled_model_reads_a_plain_records_readout_shape() -> None:
    """``scale_readout`` of a ``torch.compile``d model read the record's names as the
    compiled module's (``_orig_mod.1.weight``) and found no readout shape."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 2))
    base = ff.FSLRRecord(meta={"shapes": {"1.weight": [2, 16]}})
    assert ff.scale_readout(ff.with_fslr(torch.compile(net), readout="1"), base) == 0.5
