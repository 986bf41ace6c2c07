"""Multi-process gloo runs on loopback, shared by the distributed tests.

``spawn(check, world)`` starts ``world`` processes, each with the default process group
initialised, runs ``check(rank)`` in each, and tears the group down only when every rank is
done (no rank closes its connections while another still uses them).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, check: Callable[[int], None], port: int, world: int) -> None:
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        check(rank)
        gc.collect()  # free DDP reducers and FSDP states while the group is alive
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(check: Callable[[int], None], world: int) -> None:
    """Run ``check(rank)`` on ``world`` gloo processes (a module-level function: it is pickled)."""
    mp.spawn(_run, args=(check, free_port(), world), nprocs=world, join=True)
