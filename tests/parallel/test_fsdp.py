"""FSDP2 (``fully_shard``): two gloo processes against one process on the concatenated batch.

Every parameter of the model is a DTensor shard (odd sizes: uneven shards). ``with_fslr``,
``measure``, ``Recorder`` and ``FLeRM`` are used exactly as in one process; every rank must get
bitwise identical FSLRs and rates, equal to one process training on the concatenated batches
(float32, 1e-5 relative). Records made under FSDP2 drive FLeRM in one process and the reverse.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _gloo import spawn
from torch import Tensor, nn

import fslr_func as ff
from fslr_func import distributed as fd
from fslr_func.probe.functional import is_dtensor
from fslr_func.training.flerm import FLeRM
from fslr_func.training.recorder import Recorder

WORLD = 2
SHARDS = (6, 4)  # rows of each probe batch held by rank 0 and rank 1
TRAIN_ROWS = 2  # rows of each training batch per rank (equal: FSDP averages the ranks' means)
RTOL = 1e-5


def _mlp(width: int = 7, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3))


def _fully_shard_modules(model: nn.Module, modules: list[nn.Module]) -> nn.Module:
    """``fully_shard`` each of ``modules`` in turn (the root last) over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for module in modules:
        fully_shard(module, mesh=mesh)
    return model


def _fully_shard(model: nn.Sequential) -> nn.Module:
    layers = [layer for layer in model if isinstance(layer, nn.Linear)]
    return _fully_shard_modules(model, [*layers, model])


def _shard(x: Tensor, rank: int | None) -> Tensor:
    return x if rank is None else x.split(list(SHARDS))[rank]


def _stream(seed: int, rank: int | None = None) -> Iterator[Tensor]:
    """Probe batches: whole for one process (``rank=None``), this rank's rows under FSDP2."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield _shard(torch.randn(sum(SHARDS), 5, generator=g), rank)


def _train_batch(step: int, rank: int | None = None) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(WORLD * TRAIN_ROWS, 5, generator=g), torch.randint(0, 3, (4,), generator=g)
    return (x, y) if rank is None else (x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])


def _assert_same_on_all_ranks(values: dict[str, Tensor]) -> None:
    local = torch.stack([values[n].to(torch.float64) for n in sorted(values)])
    table = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(table, local)
    assert torch.equal(table[0], table[1]), table


def _max_rel(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    assert sorted(got) == sorted(want)
    assert all(float(want[n]) > 0 for n in want)  # the old bug: exactly 0 everywhere
    return max(abs(float(got[n]) / float(want[n]) - 1) for n in want)


def _train(fm: ff.FSLRModule, rank: int | None, steps: int = 2) -> ff.FSLRModule:
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    probes = _stream(7, rank)
    for step in range(steps):
        x, y = _train_batch(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(fm(x), y).backward()
        with fm.measure(opt, next(probes)):
            opt.step()
    return fm


def _check_with_fslr(rank: int) -> None:
    one = _train(ff.with_fslr(_mlp(), samples=6, seed=123), None)
    fm = ff.with_fslr(_fully_shard(_mlp()), samples=6, seed=123, chunk_size=4)
    assert isinstance(fm, fd.DistributedFSLRModule) and fm.distributed
    _train(fm, rank)
    _assert_same_on_all_ranks(fm.fslr())
    rel = _max_rel(fm.fslr(), one.fslr())
    if rank == 0:
        print(f"\nFSDP2 with_fslr+measure vs one process: max relative difference {rel:.2e}")
    assert rel < RTOL
    # The sharded parameters and FSDP's hooks are back: the model still trains as FSDP.
    assert all(is_dtensor(p) for p in fm.parameters())
    x = next(_stream(8))
    torch.testing.assert_close(fm(_shard(x, rank)), _shard(one(x), rank))


class _Tied(nn.Module):
    """A readout tied to the embedding, and a frozen bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid = nn.Embedding(11, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.mid.bias.requires_grad_(False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _sharded_like(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full tensors as DTensors sharded like ``model``'s parameters of the same names."""
    from torch.distributed.tensor import distribute_tensor

    params = dict(model.named_parameters())
    return {
        n: distribute_tensor(v, params[n].device_mesh, params[n].placements)
        for n, v in tensors.items()
    }


def _check_functional(rank: int) -> None:
    """``fd.estimate`` takes an FSDP2 model, its DTensor update and DTensor evaluation point;
    a probe that raises leaves the model sharded, with FSDP's hooks in place."""
    model = _fully_shard(_mlp())
    plain = _mlp()
    g = torch.Generator().manual_seed(4)
    delta = {n: 1e-2 * torch.randn(p.shape, generator=g) for n, p in plain.named_parameters()}
    point = {n: p.detach() + delta[n] for n, p in plain.named_parameters()}
    x = next(_stream(9))
    for at in (None, point):
        got = fd.estimate(
            model,
            _shard(x, rank),
            _sharded_like(model, delta),
            params=None if at is None else _sharded_like(model, at),
            samples=5,
            generator=torch.Generator().manual_seed(3),
        )
        _assert_same_on_all_ranks(got)
        want = ff.estimate(
            plain, x, delta, params=at, samples=5, generator=torch.Generator().manual_seed(3)
        )
        assert _max_rel(got, want) < RTOL

    with pytest.raises(ValueError, match="not trainable parameters"):
        fd.estimate(model, _shard(x, rank), {"0.wieght": torch.zeros(7, 5)}, samples=2)
    assert all(is_dtensor(p) for p in model.parameters())
    torch.testing.assert_close(model(_shard(x, rank)), _shard(plain(x), rank))

    # Tied parameters stay tied (one FSLR, as in one process); frozen ones stay constants.
    tied, plain_tied = _Tied(), _Tied()
    _fully_shard_modules(tied, [tied.mid, tied])
    trainable = [(n, p) for n, p in plain_tied.named_parameters() if p.requires_grad]
    delta = {n: 1e-2 * torch.randn(p.shape, generator=g) for n, p in trainable}
    ids = torch.randint(0, 11, (sum(SHARDS), 3), generator=g)
    got = fd.estimate(
        tied,
        _shard(ids, rank),
        _sharded_like(tied, delta),
        samples=5,
        generator=torch.Generator().manual_seed(3),
    )
    want = ff.estimate(
        plain_tied, ids, delta, samples=5, generator=torch.Generator().manual_seed(3)
    )
    assert sorted(want) == ["emb.weight", "mid.weight"]
    assert _max_rel(got, want) < RTOL
    assert tied.head.weight is tied.emb.weight and is_dtensor(tied.head.weight)


def _record(rank: int | None) -> ff.FSLRRecord:
    model = _mlp() if rank is None else _fully_shard(_mlp())
    fm = ff.with_fslr(model, samples=4, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.05)
    recorder = Recorder(fm, _stream(11, rank), warmup_samples=8, every=2)
    for step in range(3):
        x, y = _train_batch(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(fm(x), y).backward()
        if step == 1:  # a block whose step a GradScaler skips: an inf in rank 0's shard only
            grad = model[0].weight.grad
            local = grad.to_local() if is_dtensor(grad) else grad
            kept = local[0, 0].item()
            if rank in (None, 0):
                local[0, 0] = float("inf")
            with recorder.step(opt):
                pass  # the scaler does not call opt.step(); every rank agrees it was skipped
            assert recorder.t == 1
            local[0, 0] = kept
        with recorder.step(opt):
            opt.step()
    return recorder.record


def _flerm_rates(base: ff.FSLRRecord, rank: int | None) -> dict[str, float]:
    wide = _mlp(width=16, seed=2)
    fm = ff.with_fslr(wide if rank is None else _fully_shard(wide), samples=4, seed=5)
    opt = torch.optim.SGD(fm.parameters(), lr=0.05)
    flerm = FLeRM(fm, opt, base, probe_batches=_stream(100, rank), warmup_samples=8)
    for step in range(2):
        x, y = _train_batch(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(fm(x), y).backward()
        with flerm.step():
            opt.step()
    assert [p.step for p in flerm.history] == [0]
    return flerm.lrs()


def _series(record: ff.FSLRRecord) -> dict[str, Tensor]:
    return {f"{n}@{t}": torch.tensor(v) for n, vs in record.fslr.items() for t, v in enumerate(vs)}


def _check_recorder_and_flerm(rank: int) -> None:
    one, sharded = _record(None), _record(rank)
    assert one.steps == sharded.steps == [0, 2]
    _assert_same_on_all_ranks(_series(sharded))
    assert _max_rel(_series(sharded), _series(one)) < RTOL
    reference = _flerm_rates(one, None)  # one process throughout
    assert len(set(reference.values())) > 1  # per-tensor rates were set
    cases = {
        "FSDP2 record -> one-process FLeRM": _flerm_rates(sharded, None),
        "one-process record -> FSDP2 FLeRM": _flerm_rates(one, rank),
    }
    for what, rates in cases.items():
        tensors = {n: torch.tensor(v) for n, v in rates.items()}
        _assert_same_on_all_ranks(tensors)
        rel = _max_rel(tensors, {n: torch.tensor(v) for n, v in reference.items()})
        if rank == 0:
            print(f"{what}: max relative difference of the rates {rel:.2e}")
        assert rel < RTOL, what


def _check_bfloat16_with_an_empty_shard(rank: int) -> None:
    """A bfloat16 head of one row leaves rank 1 an empty shard: the rounded-away check took
    ``amax`` of it and raised there, while rank 0 waited in the next collective."""
    torch.manual_seed(0)
    model = _fully_shard(
        nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)).to(torch.bfloat16)
    )
    fm = ff.with_fslr(model, samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    x = next(_stream(1, rank)).to(torch.bfloat16)
    fm(x).float().square().mean().backward()
    with fm.measure(opt, x) as m:
        opt.step()
    assert sorted(m.fslr) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    _assert_same_on_all_ranks({n: v.float() for n, v in m.fslr.items()})


def _checks(rank: int) -> None:
    _check_bfloat16_with_an_empty_shard(rank)
    _check_with_fslr(rank)
    _check_functional(rank)
    _check_recorder_and_flerm(rank)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_process_fsdp2_matches_single_process() -> None:
    spawn(_checks, WORLD)
