"""Data-parallel probes: two gloo processes on loopback against the single-process estimate.

Each rank holds a shard of the probe batch (uneven: 6 and 4 rows); the estimates the ranks get
after the all-reduce must equal, to float64 rounding, ``fslr_func.estimate`` on the
concatenated batch with the same omega seed, and be bitwise identical across ranks.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gloo import free_port, spawn
from conftest import random_delta
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import fslr_func as ff
from fslr_func import distributed as fd
from fslr_func.training.controller import fslr_module_of
from fslr_func.training.wrapper import FSLRModule

WORLD = 2
SHARDS = (6, 4)  # rows of the probe batch held by rank 0 and rank 1
RTOL = 1e-10


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)
    ).double()


def _batches() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x_probe = torch.randn(sum(SHARDS), 5, generator=g, dtype=torch.float64)
    x_train = torch.randn(2 * WORLD, 5, generator=g, dtype=torch.float64)
    y_train = torch.randint(0, 3, (2 * WORLD,), generator=g)
    return x_probe, x_train, y_train


def _shard(x: Tensor, rank: int) -> Tensor:
    return x.split(list(SHARDS))[rank]


def _gathered(values: dict[str, Tensor]) -> Tensor:
    """``(WORLD, len(values))``: every rank's values, in name order."""
    local = torch.stack([values[n].to(torch.float64) for n in sorted(values)])
    table = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(table, local)
    return torch.stack(table)


def _assert_same_on_all_ranks(values: dict[str, Tensor]) -> None:
    table = _gathered(values)
    assert torch.equal(table[0], table[1]), table


def _assert_close(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=0.0, msg=n)


def _check_equals_one_process(
    rank: int, model: nn.Module, x: Tensor, delta: dict[str, Tensor], case: dict[str, Any]
) -> None:
    """fd.estimate on the rank's shard: the same on every rank, and equal to ff.estimate on the
    whole batch with the same omega seed."""
    got = fd.estimate(
        model, _shard(x, rank), delta, generator=torch.Generator().manual_seed(3), **case
    )
    _assert_same_on_all_ranks(got)
    if rank == 0:
        want = ff.estimate(model, x, delta, generator=torch.Generator().manual_seed(3), **case)
        _assert_close(got, want)


def _check_estimates(rank: int) -> None:
    model = _mlp()
    x_probe, _, _ = _batches()
    g = torch.Generator().manual_seed(7)
    delta = {
        n: 1e-2 * torch.randn(p.shape, generator=g, dtype=p.dtype)
        for n, p in model.named_parameters()
    }
    cases = [
        {"samples": 6, "chunk_size": 4},
        {"samples": 5, "omega": "rademacher", "strategy": "loop", "estimator": "full"},
    ]
    for case in cases:
        _check_equals_one_process(rank, model, x_probe, delta, case)

    # Per-rank omega draws: a different draw, but still identical estimates on every rank.
    local = fd.estimate(
        model,
        _shard(x_probe, rank),
        delta,
        samples=4,
        omega_draw="local",
        generator=torch.Generator().manual_seed(3),
    )
    _assert_same_on_all_ranks(local)
    assert all(bool(torch.isfinite(v)) and v > 0 for v in local.values())

    # Ranks that disagree on the probe all raise (no rank is left waiting in a collective).
    with pytest.raises(ValueError, match="ranks disagree"):
        fd.probe(model, _shard(x_probe, rank), delta, samples=3 + rank)
    # as many elements in other tensors (a bias frozen on one rank, another on the other):
    # the all-reduces summed misaligned gradients, silently; another chunk_size: a different
    # number of all-reduces, which aborted the process
    biases = sorted(n for n in delta if n.endswith("bias") and delta[n].shape == (7,))
    assert len(biases) == 2, biases
    frozen = {n: d for n, d in delta.items() if n != biases[rank]}
    with pytest.raises(ValueError, match="rank 1 probes other tensors than rank 0") as info:
        fd.probe(model, _shard(x_probe, rank), frozen, samples=4)
    _assert_same_message(str(info.value))
    with pytest.raises(ValueError, match=r"ranks disagree.*\(\d+, 4, 2\), \(\d+, 4, 4\)"):
        fd.probe(model, _shard(x_probe, rank), delta, samples=4, chunk_size=2 + 2 * rank)

    # A rank whose shard cannot be probed (empty; NaN in a one-shot estimate; a forward that
    # fails on it) makes every rank raise the same error, naming it and its error, instead of
    # leaving the others waiting for it forever.
    bad_shards = [
        (x_probe[:0], "probe batch is empty"),
        (x_probe * math.nan, "NaN entries"),
        (x_probe[:, :3], "RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ]
    for bad, own in bad_shards:
        shard = bad if rank == 1 else _shard(x_probe, rank)
        with pytest.raises(
            ValueError, match=rf"failed on rank\(s\) \[1\] \(rank 1: .*{own}"
        ) as info:
            fd.estimate(model, shard, delta, samples=4, generator=torch.Generator().manual_seed(3))
        _assert_same_message(str(info.value))
    # and the group is still usable: the next probe agrees across ranks
    _assert_same_on_all_ranks(
        fd.estimate(
            model,
            _shard(x_probe, rank),
            delta,
            samples=4,
            generator=torch.Generator().manual_seed(3),
        )
    )


def _assert_same_message(message: str) -> None:
    messages: list[str | None] = [None] * WORLD
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages


def _check_every_draw_and_shard_layout(rank: int) -> None:
    """Issue 21: every omega draw x shard sizes (even, uneven, one empty, both empty) x chunking
    (one chunk, or chunks sized by the entries drawn) either works, with the same estimates on
    every rank, or raises the same clear error on every rank (per-rank draws of uneven shards
    were chunked differently per rank and aborted the group: gloo SIGABRT)."""
    import fslr_func.probe.sampling as core

    model = _mlp()
    g = torch.Generator().manual_seed(7)
    delta = {
        n: 1e-2 * torch.randn(p.shape, generator=g, dtype=p.dtype)
        for n, p in model.named_parameters()
    }
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    budget = core.CHUNK_BYTES
    try:
        for chunk_bytes in (budget, 3000):  # 3000 bytes: a few samples per chunk, per omega size
            core.CHUNK_BYTES = chunk_bytes
            for sizes in [(20, 20), (36, 4), (1, 39), (40, 0), (0, 0)]:
                for draw in fd.OMEGA_DRAWS:
                    shard = x[: sizes[0]] if rank == 0 else x[sizes[0] : sum(sizes)]
                    case = f"{draw} {sizes} {chunk_bytes}"
                    try:
                        got = fd.estimate(
                            model, shard, delta, samples=8, omega_draw=draw,  # type: ignore[arg-type]
                            generator=torch.Generator().manual_seed(3),
                        )  # fmt: skip
                    except ValueError as err:
                        assert 0 in sizes, (case, err)  # only an empty shard may fail
                        assert "probe batch is empty" in str(err), case
                        _assert_same_message(str(err))
                        continue
                    assert 0 not in sizes, case
                    _assert_same_on_all_ranks(got)
                    if draw == "global" and rank == 0:
                        want = ff.estimate(
                            model, x[: sum(sizes)], delta, samples=8,
                            generator=torch.Generator().manual_seed(3),
                        )  # fmt: skip
                        _assert_close(got, want)
    finally:
        core.CHUNK_BYTES = budget


def _check_sparse_embedding(rank: int) -> None:
    """``Embedding(sparse=True)`` gives sparse gradients; the distributed probe densifies them
    as the single-process one does (one sampling loop serves both)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4, sparse=True), nn.Tanh(), nn.Linear(4, 3)).double()
    ids = torch.randint(0, 11, (sum(SHARDS), 2), generator=torch.Generator().manual_seed(2))
    delta = {n: 1e-2 * torch.ones_like(p) for n, p in model.named_parameters()}
    for strategy in ("auto", "loop"):  # vmap itself has no sparse batching rule, here or in ff
        _check_equals_one_process(rank, model, ids, delta, {"samples": 4, "strategy": strategy})


def _check_ddp_with_fslr(rank: int) -> None:
    model = _mlp()
    x_probe, x_train, y_train = _batches()
    fm = ff.with_fslr(DistributedDataParallel(model), samples=6, seed=123)
    assert isinstance(fm, fd.DistributedFSLRModule) and fm.distributed
    state = fm.state_dict()  # the bare model's keys, the wrapper's state in the metadata
    assert fm.module is model and list(state) == list(model.state_dict())
    assert "fslr_state" in state._metadata[""]  # type: ignore[attr-defined]
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    xs, ys = x_train.chunk(WORLD)[rank], y_train.chunk(WORLD)[rank]
    for step in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(fm(xs), ys).backward()  # DDP averages the gradients
        with fm.measure(opt, _shard(x_probe, rank)) as m:
            opt.step()
        _assert_same_on_all_ranks({n: d.abs().sum() for n, d in m.delta.items()})
        fslr = fm.fslr()
        _assert_same_on_all_ranks(fslr)
        if step == 0 and rank == 0:
            # One probe: the bias-corrected EMA is the probe's estimate.
            want = ff.estimate(
                model,
                x_probe,
                m.delta,
                samples=6,
                params=m.before,
                generator=torch.Generator().manual_seed(123),
            )
            _assert_close(fslr, want)
    # The other order, DDP around the wrapper, works too.
    fm2 = ff.with_fslr(_mlp(), distributed=True, samples=2)
    assert isinstance(fm2, fd.DistributedFSLRModule) and fm2.ddp is None
    around = DistributedDataParallel(fm2)
    assert fslr_module_of(around) is fm2  # what Recorder and FLeRM drive when given it


def _probe_stream(rows: int, seed: int) -> Iterator[Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(rows, 5, generator=g, dtype=torch.float64)


def _check_flerm(rank: int) -> None:
    """FLeRM on a wider DDP model, each rank probing its own data: identical rates."""
    try:
        from fslr_func.training.flerm import FLeRM
        from fslr_func.training.recorder import Recorder
    except ImportError:  # pragma: no cover - FLeRM not in this tree: fm.fslr() is checked
        return
    _, x_train, y_train = _batches()
    base_fm = ff.with_fslr(_mlp(), samples=4, seed=0)  # a single-process base run
    opt = torch.optim.SGD(base_fm.parameters(), lr=0.05)
    recorder = Recorder(base_fm, _probe_stream(8, seed=11), warmup_samples=8, every=None)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(base_fm(x_train), y_train).backward()
        with recorder.step(opt):
            opt.step()

    torch.manual_seed(2)
    wide = nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).double()
    fm = ff.with_fslr(DistributedDataParallel(wide), samples=4, seed=5)
    opt = torch.optim.SGD(fm.parameters(), lr=0.05)
    probes = _probe_stream(SHARDS[rank], seed=100 + rank)  # different data on every rank
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a distributed probe: nothing to say
        flerm = FLeRM(fm, opt, recorder.record, probe_batches=probes, warmup_samples=8)
    # a per-process wrapper (DDP(with_fslr(model)) without distributed=True) would set each
    # rank's rates from its own probes, and the replicas would drift apart: it is warned
    local = ff.with_fslr(_mlp(), samples=4, seed=0)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05)
    with pytest.warns(RuntimeWarning, match="probe is per process.*distributed=True"):
        FLeRM(local, local_opt, recorder.record, probe_batches=probes, warmup_samples=8)
    xs, ys = x_train.chunk(WORLD)[rank], y_train.chunk(WORLD)[rank]
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(fm(xs), ys).backward()
        with flerm.step():
            opt.step()
    assert [p.step for p in flerm.history] == [0]
    lrs = flerm.lrs()
    assert len(set(lrs.values())) > 1  # per-tensor rates were set
    _assert_same_on_all_ranks({n: torch.tensor(v) for n, v in lrs.items()})
    _assert_same_on_all_ranks({n: p.detach().sum() for n, p in wide.named_parameters()})


def _check_probe_feed_running_out_on_one_rank(rank: int) -> None:
    """Rank 1's one-shot probe iterator runs out at step 1: every rank raises the same
    error naming it, instead of rank 0 waiting in the probe's collectives."""
    from fslr_func.training.recorder import Recorder

    fm = ff.with_fslr(DistributedDataParallel(_mlp()), samples=4, seed=3)
    opt = torch.optim.SGD(fm.parameters(), lr=0.05)
    stream = _probe_stream(SHARDS[rank], seed=7)
    probes = iter([next(stream)]) if rank == 1 else stream
    recorder = Recorder(fm, probes, optimizer=opt, warmup_samples=4, every=1)
    _, x_train, y_train = _batches()
    xs, ys = x_train.chunk(WORLD)[rank], y_train.chunk(WORLD)[rank]
    message = ""
    for step in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(fm(xs), ys).backward()
        try:
            with recorder.step():
                opt.step()
        except ValueError as err:
            message = str(err)
            assert step == 1
    assert "failed on rank(s) [1]" in message and "ran out after 1 batches" in message
    _assert_same_message(message)


class _MixedOnSomeSamples(nn.Module):
    """Per sample and batch-first; the logits of samples with ``x[:, 0] > 1.5`` are centred
    (their units mixed): here only rank 0's shard holds such a sample."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        o = self.head(torch.tanh(self.body(x)))
        flag = x[:, 0] > 1.5
        o[flag] = o[flag] - o[flag].mean(-1, keepdim=True)
        return o


def _check_readout_roles_agreed(rank: int) -> None:
    """The readout check ran on each rank's shard: the rank holding a mixed sample fell back
    to ``kron`` for the head, the other kept the readout estimators, and the ranks' FSLRs of
    the head differed (so would FLeRM's rates for the replicas). The roles every rank gives
    are kept now; and a Recorder that would measure feature gains per rank is refused."""
    torch.manual_seed(0)
    model = _MixedOnSomeSamples().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    x[:, 0] = x[:, 0].clamp(max=1.0)
    x[0, 0] = 3.0  # in rank 0's shard
    delta = {
        n: torch.randn(p.shape, generator=g, dtype=torch.float64)
        for n, p in model.named_parameters()
    }
    got = fd.estimate(
        model, x.split([4, 4])[rank], delta, samples=4, generator=torch.Generator().manual_seed(3)
    )
    _assert_same_on_all_ranks(got)
    want = ff.estimate(model, x, delta, samples=4, generator=torch.Generator().manual_seed(3))
    _assert_close(got, want)
    fm = ff.with_fslr(DistributedDataParallel(_mlp()), samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not run across processes"):
        ff.Recorder(fm, [torch.randn(4, 5)], optimizer=opt, feature_gains=True)


class _Scaled(nn.Module):
    """``tanh(lin(x * scale))``: an Inf scale leaves the output finite and the weight's
    gradient NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor, scale: Tensor) -> Tensor:
        return torch.tanh(self.lin(x * scale))


def _check_this_sessions_rules(rank: int) -> None:
    """Under DDP as in one process: an unseeded wrapper leaves the global RNG where it was
    (the seed broadcast from rank 0 advanced every rank's), and every rank gets rank 0's
    seed; an Inf in one rank's shard that reaches a gradient makes every rank raise, naming
    it (``fd.estimate`` returned NaN; ``fm.observe`` raised on that rank only, and the other
    went on alone); ``ZeroRedundancyOptimizer`` is checked and named by its update rule."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _mlp()
    torch.manual_seed(10 + rank)
    want = torch.rand(3)
    torch.manual_seed(10 + rank)
    fm = ff.with_fslr(DistributedDataParallel(model), samples=2)
    assert torch.equal(torch.rand(3), want)
    seeds: list[Any] = [None] * WORLD
    dist.all_gather_object(seeds, fm.seed)
    assert seeds[0] == seeds[1]

    torch.manual_seed(0)
    scaled = _Scaled()
    x, scale = torch.randn(3, 4), torch.ones(3, 4)
    if rank == 0:
        scale[0, 0] = math.inf
    delta = {n: torch.randn_like(p) for n, p in scaled.named_parameters()}
    where = r"Inf entries in \['rank 0: positional input 1'\]"
    with pytest.raises(ValueError, match=where):
        fd.estimate(
            scaled, (x, scale), delta, samples=2, generator=torch.Generator().manual_seed(0)
        )
    with pytest.raises(ValueError, match=where):
        ff.with_fslr(DistributedDataParallel(scaled), samples=2, seed=0).observe((x, scale), delta)

    overlapped = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2, overlap_with_ddp=True
    )  # its step runs in DDP's communication hook: nothing for FLeRM to scale
    base = ff.FSLRRecord(meta={"base_lr": 1e-2, "optimizer": "Adam"})
    base.append(0, {n: 1.0 for n, _ in model.named_parameters()})
    wide = ff.with_fslr(DistributedDataParallel(model), samples=2, seed=0)
    with pytest.raises(ValueError, match="overlap_with_ddp=True"):
        ff.FLeRM(wide, overlapped, base, probe_batches=[x])
    for rule, refused in ((torch.optim.Rprop, True), (torch.optim.Adam, False)):
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=rule, lr=1e-2)
        base = ff.FSLRRecord(meta={"base_lr": 1e-2, "optimizer": "Adam"})
        base.append(0, {n: 1.0 for n, _ in model.named_parameters()})
        wide = ff.with_fslr(DistributedDataParallel(model), samples=2, seed=0)
        if refused:
            with pytest.raises(ValueError, match="FLeRM cannot drive Rprop"):
                ff.FLeRM(wide, zero, base, probe_batches=[x])
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "made with Adam ... this optimiser is ZeRO"
                ff.FLeRM(wide, zero, base, probe_batches=[x])


def _checks(rank: int) -> None:
    _check_this_sessions_rules(rank)
    _check_readout_roles_agreed(rank)
    _check_probe_feed_running_out_on_one_rank(rank)
    _check_estimates(rank)
    _check_every_draw_and_shard_layout(rank)
    _check_sparse_embedding(rank)
    _check_ddp_with_fslr(rank)
    _check_flerm(rank)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_process_ddp_matches_single_process() -> None:
    spawn(_checks, WORLD)


def test_needs_initialised_process_group() -> None:
    model = nn.Linear(3, 2)
    delta = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="not initialised"):
        fd.estimate(model, torch.randn(4, 3), delta)
    with pytest.raises(RuntimeError, match="not initialised"):
        ff.with_fslr(model, distributed=True)


def test_with_fslr_local_and_data_parallel() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert type(ff.with_fslr(model)) is FSLRModule
    fm = ff.with_fslr(nn.DataParallel(model), samples=2, seed=0)  # unwrapped, not distributed
    assert isinstance(fm, fd.DistributedFSLRModule) and not fm.distributed
    assert fm.module is model and isinstance(fm.ddp, nn.DataParallel)
    # where CUDA is, DataParallel has moved the model to its first device: the inputs go there
    x = torch.randn(5, 3).to(next(model.parameters()).device)
    assert torch.equal(fm(x), model(x))
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    model(x).square().mean().backward()
    with fm.measure(opt, x):
        opt.step()
    assert sorted(fm.fslr()) == sorted(n for n, _ in model.named_parameters())
    assert not fm.eval().ddp.training  # type: ignore[union-attr]


def _one_process_group(port: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_one_process_functions_refuse_ddp_and_fsdp2_models() -> None:
    """A DDP module probed in one process would measure this rank's shard (two ranks differed
    30x); an FSDP2 module's forward hooks would put FSDP's parameters in place of the probe's
    (every FSLR was 0): both raise, pointing to fslr_func.distributed, never a silently wrong or
    zero FSLR."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _one_process_group(free_port())
    try:
        x = torch.randn(4, 3)
        ddp = DistributedDataParallel(nn.Linear(3, 2))
        delta = {n: torch.ones_like(p) for n, p in ddp.named_parameters()}
        for fn in (ff.estimate, ff.exact):
            with pytest.raises(ValueError, match=r"fslr_func\.distributed"):
                fn(ddp, x, delta)
        sharded = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        delta = {n: torch.ones(p.shape) for n, p in sharded.named_parameters()}
        for fn in (ff.estimate, ff.exact):
            with pytest.raises(ValueError, match=r"FSDP2.*fslr_func\.distributed"):
                fn(sharded, x, delta)
        with pytest.raises(ValueError, match="FSDP2"):
            FSLRModule(sharded)
        with pytest.raises(ValueError, match="distributed=False"):
            ff.with_fslr(sharded, distributed=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_compiled_ddp_is_probed_across_ranks() -> None:
    """``torch.compile(DDP(model))``, as PyTorch's DDP docs compile: ``with_fslr`` took the
    compiled wrapper for a plain model, so every rank probed only its own shard (two ranks'
    FSLRs differed by 2.4x, silently) under names with ``_orig_mod.module.``; ``ff.estimate``
    measured one rank's shard. Now it is the DDP case: distributed, the bare model's names,
    the compiled wrapper's forward, and the one-process functions refuse it."""
    _one_process_group(free_port())
    try:
        model = _mlp()
        compiled = torch.compile(DistributedDataParallel(model), backend="eager")
        fm = ff.with_fslr(compiled, samples=2, seed=0)
        assert isinstance(fm, fd.DistributedFSLRModule) and fm.distributed
        assert fm.module is model and fm.ddp is compiled
        x, delta = torch.randn(4, 5, dtype=torch.float64), random_delta(model)
        opt = torch.optim.SGD(fm.parameters(), lr=0.1)
        fm(x).square().mean().backward()
        with fm.measure(opt, x):
            opt.step()
        assert sorted(fm.fslr()) == sorted(n for n, _ in model.named_parameters())
        prefixed = {f"_orig_mod.module.{n}": d for n, d in delta.items()}
        for fn in (ff.estimate, ff.exact):
            with pytest.raises(ValueError, match=r"fslr_func\.distributed"):
                fn(compiled, x, prefixed)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_the_data_parallel_probe_overwrites_its_reduced_gradients_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The all-reduced gradients are pieces of one fresh buffer, which the check for shared
    gradients (``a + b``'s, LSTM biases') took for shared: every tensor but one of each dtype
    then allocated a temporary of its per-sample gradients at every distributed probe. The
    same tensors are overwritten as in the one-process probe, with the same statistics."""
    import fslr_func.stats.statistics as statistics

    written: list[bool] = []
    scaled = statistics._scaled
    monkeypatch.setattr(
        statistics,
        "_scaled",
        lambda x, s, in_place: written.append(in_place) or scaled(x, s, in_place),
    )
    _one_process_group(free_port())
    try:
        counts, estimates = [], []
        for wrap in (False, True):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
            model = DistributedDataParallel(net) if wrap else net
            fm = ff.with_fslr(model, samples=4, seed=1, strategy="vmap")
            delta = {n: torch.randn_like(p) * 1e-3 for n, p in net.named_parameters()}
            written.clear()
            estimates.append(fm.observe(torch.randn(8, 6), delta))
            counts.append((sum(written), len(written)))
        assert counts[0] == counts[1] == (4, 4)
        assert all(torch.allclose(v, estimates[1][n], rtol=1e-6) for n, v in estimates[0].items())
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_dcp_checkpoint_with_the_wrapper_state_beside_it_resumes_exactly(tmp_path: Any) -> None:
    """``get_state_dict(fm, opt)`` of ``torch.distributed.checkpoint`` resolved the bare keys
    on the wrapper and raised "'FSLRModule' object has no attribute '0'". It works now, and
    the documented recipe (DCP for the tensors, ``fm.get_extra_state()`` beside it, which DCP
    does not write) resumes the run exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
    )

    def build() -> tuple[FSLRModule, torch.optim.Optimizer]:
        torch.manual_seed(0)
        fm = ff.with_fslr(_mlp(), samples=2, seed=0)
        return fm, torch.optim.SGD(fm.parameters(), lr=0.1)

    def run(fm: FSLRModule, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
        for _ in range(2):
            x = torch.randn(8, 5, generator=g, dtype=torch.float64)
            opt.zero_grad()
            fm(x).square().mean().backward()
            with fm.measure(opt, x):
                opt.step()

    _one_process_group(free_port())
    try:
        g = torch.Generator().manual_seed(1)
        fm, opt = build()
        run(fm, opt, g)
        model_state, _ = get_state_dict(fm, opt)
        assert sorted(model_state) == sorted(n for n, _ in _mlp().named_parameters())
        dcp.save(get_model_state_dict(fm), checkpoint_id=str(tmp_path))
        torch.save({"fm": fm.get_extra_state(), "opt": opt.state_dict()}, tmp_path / "fslr_0.pt")
        at = g.get_state()
        run(fm, opt, g)
        fm2, opt2 = build()
        state = get_model_state_dict(fm2)
        dcp.load(state, checkpoint_id=str(tmp_path))
        set_model_state_dict(fm2, state)
        saved = torch.load(tmp_path / "fslr_0.pt", weights_only=False)
        fm2.set_extra_state(saved["fm"])
        opt2.load_state_dict(saved["opt"])
        g.set_state(at)
        run(fm2, opt2, g)
        assert all(
            torch.equal(a, b) for a, b in zip(fm.parameters(), fm2.parameters(), strict=True)
        )
        assert all(torch.equal(v, fm2.fslr()[n]) for n, v in fm.fslr().items())
    finally:
        dist.destroy_process_group()
