"""The PCP process group: the three collectives context parallelism needs.

Two groups over the same ranks:
- the data group (gloo on CPU, NCCL on CUDA) carries per-layer KV all-gathers
  and the gather of sampled hidden states, with a short timeout so a dead
  rank turns into an error instead of a hang;
- the control group (always gloo) carries rank 0's step plans. Workers wait
  on it while the engine is idle, so on their side it has no practical
  timeout (a dead rank 0 closes its sockets and their wait fails at once);
  on rank 0's side it has the same short timeout as the data group.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

# torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DATA_TIMEOUT_S = 30
STARTUP_TIMEOUT_S = 600


class PCPGroup:
    def __init__(self, rank: int, size: int, device: torch.device, init_method: str) -> None:
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        # The world group only starts the ranks and waits for their models to
        # load, which may take minutes on a busy machine.
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
        )
        self.data = dist.new_group(backend=backend, timeout=timedelta(seconds=DATA_TIMEOUT_S))
        # Timeouts are per process: rank 0 gives up on a silent worker after
        # DATA_TIMEOUT_S, while workers wait for rank 0's next plan indefinitely.
        control_timeout = timedelta(seconds=DATA_TIMEOUT_S) if rank == 0 else timedelta(days=365)
        self.control = dist.new_group(backend="gloo", timeout=control_timeout)
        # Seconds spent in collectives, waiting included (for benchmarks).
        self.comm_seconds = 0.0  # data: KV all-gathers and hidden-state gathers
        self.control_seconds = 0.0  # control: plan broadcasts
        # Data-group collectives made so far, by kind ("all_gather", "gather_to_first").
        self.num_collectives: Counter[str] = Counter()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (P*n, ...): rank k's rows at [k*n, (k+1)*n)."""
        t0 = time.perf_counter()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=self.data)
        self.num_collectives["all_gather"] += 1
        self.comm_seconds += time.perf_counter() - t0
        return out

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """(m, ...) on every rank -> (P, m, ...) on rank 0, None elsewhere."""
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.data)
        self.num_collectives["gather_to_first"] += 1
        self.comm_seconds += time.perf_counter() - t0
        return torch.stack(parts) if parts is not None else None

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends `obj`; every rank returns it."""
        t0 = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        self.control_seconds += time.perf_counter() - t0
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank is here (e.g. has loaded its model)."""
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def torchrun_env() -> tuple[int, int, int, str] | None:
    """(rank, world_size, local_rank, init_method) when launched by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    return (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ.get("LOCAL_RANK", 0)),
        "env://",
    )
