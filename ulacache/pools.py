"""Row storage of one selection group: a GPU pool and a CPU pool, plus the CPU free stack.

Region table of a pool tensor ``uint8 [L, R + 1, row_bytes]``::

    rows [0, R)   real slots, owned by at most one logical address each
    row  R        scratch row: masked (-1) entries of fixed-shape copies read/write it

The GPU pool lives on the group's device; the CPU pool in host memory (pinned, exact size,
when the device is CUDA). Free GPU slots are tracked by the replacement policy (its free
bitmap comes first in victim order); free CPU slots by a device-resident stack, so spills and
promotions can pop and push without host synchronisation.
"""

from __future__ import annotations

import logging

import torch

from .errors import ShapeError

logger = logging.getLogger(__name__)


def resolve_device(device: torch.device | str) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``: tensors report an indexed device, and the core compares
    devices to reject misplaced inputs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def host_rows(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A ``uint8`` host tensor for the CPU tier: exact-size pinned memory when the GPU pool is
    on CUDA (so kernels can read it directly), plain memory otherwise."""
    if device.type == "cuda":
        try:
            from ulacache.kernels.pinned import pinned_empty
        except ImportError:  # pragma: no cover - kernels package without the pinned helper
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return pinned_empty(shape, torch.uint8)
    return torch.zeros(shape, dtype=torch.uint8)


class TierPools:
    """GPU and CPU row pools of one selection group and the CPU free stack.

    Attributes
    ----------
    gpu : ``uint8 [L, G + 1, row_bytes]`` on ``device``.
    cpu : ``uint8 [L, C + 1, row_bytes]`` in host memory.
    cpu_free : ``int64 [C + 1]`` on ``device``; ``cpu_free[:cpu_top]`` are the free CPU slots
        (entry C is scratch for masked pushes).
    cpu_top : 0-dim ``int64`` on ``device``.
    """

    def __init__(self, n_layers: int, gpu_slots: int, cpu_slots: int, row_bytes: int,
                 device: torch.device | str = "cpu", gpu_storage: torch.Tensor | None = None):
        self.device = resolve_device(device)
        self.n_layers, self.row_bytes = n_layers, row_bytes
        self.n_gpu, self.n_cpu = gpu_slots, cpu_slots
        shape = (n_layers, gpu_slots + 1, row_bytes)
        if gpu_storage is not None:
            # An engine-owned buffer (SGLang's kv_buffer rows): rows must be contiguous bytes.
            if (gpu_storage.dtype != torch.uint8 or tuple(gpu_storage.shape) != shape
                    or gpu_storage.stride(2) != 1 or gpu_storage.device != self.device):
                raise ShapeError(f"gpu_storage must be uint8 {shape} on {self.device} with "
                                 f"contiguous rows, got {gpu_storage.dtype} "
                                 f"{tuple(gpu_storage.shape)} stride {gpu_storage.stride()}")
            self.gpu = gpu_storage
        else:
            self.gpu = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self.cpu = host_rows((n_layers, cpu_slots + 1, row_bytes), self.device)
        # Pops take from the top; reversed so that a fresh pool hands out slots 0, 1, 2, ...
        self.cpu_free = torch.cat([torch.arange(cpu_slots - 1, -1, -1),
                                   torch.tensor([cpu_slots])]).to(self.device)
        self.cpu_top = torch.tensor(cpu_slots, dtype=torch.int64, device=self.device)
        logger.debug("pools: %d layers x (%d GPU + %d CPU) rows of %d B", n_layers, gpu_slots,
                     cpu_slots, row_bytes)

    def pop_cpu(self, want: torch.Tensor) -> torch.Tensor:
        """Pop one free CPU slot for each ``True`` in ``want`` (``bool [n]``); ``int64 [n]``
        with ``-1`` where not wanted or the stack ran dry. Graph-safe."""
        rank = torch.cumsum(want, 0) - 1
        pos = self.cpu_top - 1 - rank
        got = want & (pos >= 0)
        slot = torch.where(got, self.cpu_free[pos.clamp(min=0)], -1)
        self.cpu_top.sub_(got.sum())
        return slot

    def push_cpu(self, slots: torch.Tensor) -> None:
        """Push the valid (``>= 0``, distinct, currently used) CPU slots back. Graph-safe."""
        put = slots >= 0
        rank = torch.cumsum(put, 0) - 1
        pos = torch.where(put, self.cpu_top + rank, self.n_cpu)
        self.cpu_free.index_put_((pos,), torch.where(put, slots, self.n_cpu))
        self.cpu_top.add_(put.sum())

    def cpu_free_set(self) -> torch.Tensor:
        """The free CPU slots (host-side, for integrity checks)."""
        return self.cpu_free[: int(self.cpu_top)]
