"""The ranks a sharded sequence spans, and how tests and benchmarks start them.

A RankGroup wraps torch.distributed's default process group: NCCL between GPUs (one rank per device; NCCL
refuses two ranks on one device), gloo on CPU. gloo also carries CUDA tensors by staging them through host
memory (what two ranks sharing one GPU use). A group of one needs no process group at all.
"""

from __future__ import annotations

import pickle
import queue
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("nccl", "gloo")


class RankGroup:
    """rank, world_size and all_gather over torch.distributed's default group (or one process alone)."""

    def __init__(self, rank: int = 0, world_size: int = 1, backend: str = "gloo") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r} world_size={world_size!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend

    @staticmethod
    def current() -> RankGroup:
        """The group of the initialized default process group (init_process_group, torchrun or `spawn`)."""
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call init_process_group (or use spawn)")
        return RankGroup(dist.get_rank(), dist.get_world_size(), dist.get_backend())

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """t [*S] of every rank -> [world_size, *S] on t's device, rank order."""
        if self.world_size == 1:
            return t[None]
        staged = t.cpu() if self.backend == "gloo" and t.is_cuda else t.contiguous()
        out = torch.empty((self.world_size, *t.shape), dtype=t.dtype, device=staged.device)
        dist.all_gather(list(out.unbind(0)), staged)
        return out.to(t.device, non_blocking=True)


def rank_device(rank: int, device_type: str) -> torch.device:
    """The device of `rank`: cuda:(rank mod the GPUs there are), or the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, backend: str, port: int, args: tuple, results) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank_device(rank, "cuda"))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results.put((rank, pickle.dumps(fn(RankGroup.current(), *args))))  # plain bytes: no shared memory
                                                                            # that dies with this process
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, backend: str, *args: object) -> list:
    """Run fn(group, *args) in world_size new processes joined in one process group; returns each rank's
    result (picklable) in rank order. A rank's exception is raised here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_entry, args=(fn, world_size, backend, free_port(), args, results),
                               nprocs=world_size, join=False, start_method="spawn")
    got: dict[int, object] = {}
    while len(got) < world_size:  # read before joining: a rank exits only once its result is read
        try:
            rank, value = results.get(timeout=0.5)
            got[rank] = pickle.loads(value)
        except queue.Empty:
            if procs.join(timeout=0):  # every rank exited (a failed one raised in join)
                break
    while not procs.join():
        pass
    if len(got) < world_size:
        raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(got))} exited without a result")
    return [got[r] for r in range(world_size)]
