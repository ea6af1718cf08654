"""The tensor-parallel group: one torch.distributed group per engine (per pipeline stage at
pp > 1: a new_group of the stage's ranks inside the engine's world group), passed to every
layer.

Layers never read a global rank: each holds the `TensorParallelGroup` it was built with.
Each rank of an engine is its own process (a Ray actor, or a spawned test process), so the
group is that process's default group, created from the engine's `tcp://127.0.0.1:PORT`
with a port the engine picked free; two engines on one host differ in port and processes.

On CPU (gloo) with every rank of the group on this host, `all_reduce` and `gather_last_dim`
go through a shared-memory segment instead of gloo's TCP (workers/shm_collectives.py;
`QWEN3_SERVE_CPU_SHM_ALLREDUCE=0` keeps gloo); NCCL (CUDA) is unchanged.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from workers.shm_collectives import ShmCollectives

# Long enough for the slowest rank to finish loading a large checkpoint.
_INIT_TIMEOUT = timedelta(minutes=10)


def get_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tcp_address(init_method: str) -> tuple[str | None, int]:
    """(host, port) of a "tcp://HOST:PORT" init method; (None, 0) for any other kind."""
    if not init_method.startswith("tcp://"):
        return None, 0
    host, _, port = init_method[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dist_init_method must be 'tcp://HOST:PORT'; got {init_method!r}")
    return host.strip("[]"), int(port)


def _tcp_store(host: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """The rendezvous store; rank 0's server listens on `host` alone (its own socket)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, _INIT_TIMEOUT)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    # detach(): the store's server owns the socket from here (Python must not close it).
    return dist.TCPStore(host, port, world_size, True, _INIT_TIMEOUT,
                         master_listen_fd=listener.detach())


def _init_world(world_size: int, rank: int, init_method: str | None, device: str) -> None:
    """This process's default process group: `world_size` ranks at `init_method`."""
    if not init_method:
        raise ValueError("tensor_parallel_size x pipeline_parallel_size > 1 needs "
                         "dist_init_method ('tcp://127.0.0.1:PORT' with a free port)")
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group; "
                           "every rank must run in its own process")
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs: dict = {}
    if device == "cuda":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    host, port = _tcp_address(init_method)
    if host is not None:
        # Our own store, so rank 0's server listens on `host` only (torch's tcp:// init
        # binds it to every interface: the rendezvous would be open to the network).
        kwargs["store"] = _tcp_store(host, port, world_size, rank == 0)
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(backend, world_size=world_size, rank=rank,
                            timeout=_INIT_TIMEOUT, **kwargs)


class TensorParallelGroup:
    """Rank, size and the collectives the parallel layers use; a no-op group when size == 1."""

    def __init__(self, rank: int = 0, world_size: int = 1,
                 group: dist.ProcessGroup | None = None, owns_world: bool = False) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.owns_world = owns_world  # this process joined the world group (destroy leaves it)
        self.shm: ShmCollectives | None = None  # CPU ranks on one host: see `_shm_for`

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(0, 1, None)

    @classmethod
    def initialize(cls, world_size: int, rank: int, init_method: str | None,
                   device: str, pipeline_parallel_size: int = 1) -> TensorParallelGroup:
        """Join the engine's ranks at `init_method`: NCCL on CUDA, gloo on CPU. `world_size` is
        the tensor-parallel size; with pipeline_parallel_size pp > 1 the process group holds
        pp x world_size ranks (`rank` is the global one) and each stage of `world_size`
        consecutive ranks is its own tensor-parallel group (workers/pipeline.py)."""
        total = world_size * pipeline_parallel_size
        if total == 1:
            return cls.single()
        _init_world(total, rank, init_method, device)
        if pipeline_parallel_size == 1:
            tp = cls(rank, world_size, dist.group.WORLD, owns_world=True)
        else:
            # Every rank creates every stage's group, in the same order (new_group's contract).
            groups = [dist.new_group(list(range(s * world_size, (s + 1) * world_size)))
                      for s in range(pipeline_parallel_size)] if world_size > 1 else []
            group = groups[rank // world_size] if groups else None
            tp = cls(rank % world_size, world_size, group, owns_world=True)
        if device != "cuda" and world_size > 1:
            tp.shm = ShmCollectives.create(tp.group, tp.rank, world_size,
                                           _INIT_TIMEOUT.total_seconds())
        return tp

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def _shm_for(self, x: Tensor) -> ShmCollectives | None:
        """The one dispatch point: the shared-memory segment when `x` fits it, else None (gloo
        or NCCL). Every rank decides alike (same shapes on every rank)."""
        return self.shm if self.shm is not None and self.shm.fits(x) else None

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over the ranks, in place."""
        if self.world_size > 1:
            if (shm := self._shm_for(x)) is not None:
                return shm.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: Tensor) -> Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dim; other ranks get None."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if (shm := self._shm_for(x)) is not None:
            return shm.gather_last_dim(x)
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_first(self, x: Tensor) -> Tensor:
        """Every rank gets rank 0's `x` (same shape and dtype on every rank), in place."""
        if self.world_size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_min(self, value: int) -> int:
        """The minimum of an int over the ranks (e.g. the KV block count every rank can hold)."""
        if self.world_size == 1:
            return value
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.owns_world and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_world = False
        self.group = None
        self.world_size = 1
