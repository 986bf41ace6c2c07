"""The probe's backward split at a linear readout (fslr_func.probe.split_head): taken where the
omegas would not fit one chunk, the same numbers as the unsplit probe, and refused wherever
its three products would not be the model's vjp."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fslr_func as ff
import fslr_func.probe.sampling as sampling
import fslr_func.probe.split_head as split_head
from fslr_func.probe.split_head import linear_head

VOCAB = 3000


class Net(nn.Module):
    """Embedding-like input layer, a body, a wide linear head (a small language model's
    shape: most of the output's size is in the head)."""

    def __init__(self, bias: bool = True, raw_head_use: bool = False, norm: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        # torch 2.13's vmapped layer-norm backward fails under CPU bfloat16 autocast (the
        # split falls back, test_a_failed_batched_body_backward_falls_back_to_the_loop)
        self.norm = nn.LayerNorm(8) if norm else nn.Identity()
        self.head = nn.Linear(8, VOCAB, bias=bias)
        self.raw_head_use = raw_head_use
        self.scaled_output = False  # flipped from outside, where the cache cannot see it

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(torch.tanh(self.mid(torch.relu(self.inp(x)))))
        if self.raw_head_use:  # the head's weight read before the head, outside any module
            h = h + self.head.weight.mean(0)
        y = self.head(h)
        return y * 1.5 if self.scaled_output else y


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A chunk budget under one omega sample of :class:`Net` (3 x 5 x 3000 floats), and the
    split allowed on a CPU (where it is slower, so off by default) as on a GPU."""
    monkeypatch.setattr(sampling, "CHUNK_BYTES", 100_000)
    on_a_gpu = sampling.split_worthwhile

    def anywhere(
        samples: int, num_outputs: int, dtype: torch.dtype, device: Any, **kw: Any
    ) -> bool:
        return on_a_gpu(samples, num_outputs, dtype, torch.device("cuda"), **kw)

    monkeypatch.setattr(sampling, "split_worthwhile", anywhere)
    yield


@pytest.fixture
def split_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the samples that went through the split's readout products."""
    calls = [0]
    original = split_head.SplitHead.readout_gradients

    def counted(self: split_head.SplitHead, c: Tensor) -> Any:
        calls[0] += 1
        return original(self, c)

    monkeypatch.setattr(split_head.SplitHead, "readout_gradients", counted)
    return calls


def unit_delta(model: nn.Module, seed: int = 1, skip: tuple[str, ...] = ()) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if n not in skip
    }


def log_stats(
    model: nn.Module, x: Tensor, delta: dict[str, Tensor], **kw: Any
) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(7)
    return sampling.probe(model, x, delta, generator=generator, samples=8, **kw).log_stats


def assert_split_matches_loop(
    model: nn.Module,
    delta: dict[str, Tensor],
    calls: list[int],
    context: Callable[[], Any] = torch.enable_grad,
    rtol: float = 1e-5,
) -> None:
    x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(0))
    with context():
        reference = log_stats(model, x, delta, strategy="loop")  # no split off the vmap path
        assert calls[0] == 0
        first = log_stats(model, x, delta, strategy="vmap")  # finds the readout
        assert calls[0] == 0
        split = log_stats(model, x, delta, strategy="vmap")
    assert calls[0] == 8
    for n in reference:
        torch.testing.assert_close(first[n], reference[n], rtol=rtol, atol=rtol)
        torch.testing.assert_close(split[n], reference[n], rtol=rtol, atol=rtol)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("bias", [True, False])
def test_split_probe_gives_the_unsplit_statistics(bias: bool, split_calls: list[int]) -> None:
    model = Net(bias=bias)
    assert_split_matches_loop(model, unit_delta(model), split_calls)


@pytest.mark.usefixtures("small_chunks")
def test_split_on_the_plain_autograd_path_batches_the_body(split_calls: list[int]) -> None:
    # Where torch.func failed (a forward in autocast, as Trainer(bf16=True) runs it) the
    # probe runs on plain autograd; split, its body's backward is batched by
    # is_grads_batched, with no fallback to a loop (no warning).
    model = Net()
    delta = unit_delta(model)
    x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(0))
    reference = log_stats(model, x, delta, strategy="loop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log_stats(model, x, delta, strategy="autograd")
        assert split_calls[0] == 0
        split = log_stats(model, x, delta, strategy="autograd")
    assert split_calls[0] == 8
    for n in reference:
        torch.testing.assert_close(split[n], reference[n], rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("small_chunks")
def test_a_head_that_is_not_probed_still_passes_its_cotangent_to_the_body(
    split_calls: list[int],
) -> None:
    model = Net()
    assert_split_matches_loop(model, unit_delta(model, skip=("head.weight",)), split_calls)


@pytest.mark.usefixtures("small_chunks")
def test_the_heads_weight_read_in_the_body_adds_its_gradient(split_calls: list[int]) -> None:
    # d phi / d W has a term from the head and one from the body's read of W: the split
    # computes the first by hand and must add the second from the body's vjp.
    model = Net(raw_head_use=True)
    assert_split_matches_loop(model, unit_delta(model), split_calls)


@pytest.mark.usefixtures("small_chunks")
def test_split_under_bfloat16_autocast(split_calls: list[int]) -> None:
    # The head's products run in the output's dtype (bfloat16), as its forward did; the
    # statistics are means over 3000 x 8 products of bfloat16 values (relative error 2^-8
    # each), so they agree with the unsplit probe's to well under 1% in log space.
    model = Net(norm=False)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("error")  # batched, not fallen back to a loop
        assert_split_matches_loop(model, unit_delta(model), split_calls, rtol=2e-2)


@pytest.mark.usefixtures("small_chunks")
def test_a_failed_batched_body_backward_falls_back_to_the_loop(
    split_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_vmap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            raise RuntimeError("vmap: no batching rule for this backward")

        return run

    model = Net()
    x, delta = torch.randn(3, 5, 6), unit_delta(model)
    reference = log_stats(model, x, delta, strategy="loop")
    log_stats(model, x, delta, strategy="vmap")
    monkeypatch.setattr(sampling, "vmap", failing_vmap)
    with pytest.warns(RuntimeWarning, match="no batching rule.*later ones run unsplit"):
        looped = log_stats(model, x, delta, strategy="vmap")
    assert split_calls[0] == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        unsplit = log_stats(model, x, delta, strategy="vmap")
    assert split_calls[0] == 8  # not split again
    for n in reference:
        torch.testing.assert_close(looped[n], reference[n])
        torch.testing.assert_close(unsplit[n], reference[n])


@pytest.mark.usefixtures("small_chunks")
def test_an_output_that_stops_being_the_heads_is_never_split(split_calls: list[int]) -> None:
    model = Net()
    x = torch.randn(3, 5, 6)
    delta = unit_delta(model)
    log_stats(model, x, delta, strategy="vmap")  # the head is the readout
    model.scaled_output = True  # not in the cache's key: only the forward can tell
    reference = log_stats(model, x, delta, strategy="loop")
    for _ in range(2):
        got = log_stats(model, x, delta, strategy="vmap")
        for n in reference:
            torch.testing.assert_close(got[n], reference[n])
    assert split_calls[0] == 0


def test_no_split_where_the_omegas_fit_one_chunk(split_calls: list[int]) -> None:
    model = Net()
    x, delta = torch.randn(3, 5, 6), unit_delta(model)
    for _ in range(2):
        log_stats(model, x, delta, strategy="vmap")
    assert split_calls[0] == 0


def test_no_split_on_a_cpu(split_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "CHUNK_BYTES", 100_000)  # omegas that do not fit a chunk
    model = Net()
    x, delta = torch.randn(3, 5, 6), unit_delta(model)
    for strategy in ("vmap", "vmap", "autograd", "autograd"):
        log_stats(model, x, delta, strategy=strategy)
    assert split_calls[0] == 0


def test_linear_head_refuses_what_its_products_would_get_wrong() -> None:
    class OwnForward(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) * 2

    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    tied[1].weight = tied[0].weight
    parametrized = nn.Sequential(nn.Linear(4, 4))
    torch.nn.utils.parametrizations.weight_norm(parametrized[0])
    assert linear_head(nn.Sequential(OwnForward(3, 3)), "0") is None
    assert linear_head(tied, "1") is None
    assert linear_head(parametrized, "0") is None
    assert linear_head(nn.Sequential(nn.Linear(3, 3)), None) is None
    assert linear_head(nn.Sequential(nn.Linear(3, 3, bias=False)), "0") == (
        split_head.LinearHead("0", "0.weight", None)
    )


@pytest.mark.usefixtures("small_chunks")
def test_split_in_a_bfloat16_training_loop_with_gradscaler_and_fused_adam(
    split_calls: list[int],
) -> None:
    # The wrapper's measured steps, split after the first, give the FSLRs of the same probe
    # unsplit (chunk_size=1 is never split; the omegas do not depend on the chunk).
    def run(**options: Any) -> list[dict[str, float]]:
        torch.manual_seed(0)
        model = Net(norm=False)
        fm = ff.with_fslr(model, samples=8, seed=3, strategy="vmap", **options)
        opt = torch.optim.Adam(fm.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu")
        x = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(0))
        target = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(fm(x).reshape(-1, VOCAB), target.reshape(-1))
            scaler.scale(loss).backward()
            with torch.autocast("cpu", dtype=torch.bfloat16), fm.measure(opt, x) as m:
                scaler.step(opt)
            scaler.update()
            out.append({n: float(v) for n, v in m.fslr.items()})
        return out

    unsplit = run(chunk_size=1)
    assert split_calls[0] == 0
    split = run()
    assert split_calls[0] == 2 * 8  # every measured step after the first
    for a, b in zip(split, unsplit, strict=True):
        assert a.keys() == b.keys()
        for n in a:
            assert a[n] == pytest.approx(b[n], rel=2e-2), n
