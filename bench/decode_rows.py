"""Real rows for the decode sweep (``python bench/decode_sweep.py --real-rows``): every decode
step of every policy moves and reads real bytes for one layer, and its device time is measured.

``bench/decode_sweep.py`` alone models a step (launch counts, PCIe bytes / bandwidth, a
roofline of attention). With ``--real-rows`` it also runs, per step and for ONE layer of
656-byte FP8 MLA rows (DeepSeek-V3.2 / GLM-5: 512 fp8 latent, 4 fp32 scales, 64 bf16 rope), the
work each policy does on the device, and times it (CUDA events behind a ~2 ms sleep so host
launch gaps are hidden, as under a CUDA graph; ``perf_counter`` on CPU):

- **ulacache**: the real core with real pools (:class:`~ulacache.tools.residency.Residency`
  with one layer): round start, placement of the new tokens, the access (fused Triton path on
  CUDA: promotions read pinned host rows, victims written back), then attention over the rows
  it returns;
- **HiSparse**: its swap-in decisions from :class:`~ulacache.tools.hisparse.HiSparseBuffer`
  (SGLang 0.5.23's kernel, modelled on the host and NOT timed; the modelled
  ``hs_launches x launch_us`` stands in for its control time), then the data it moves: the
  missed rows from the pinned host mirror into each request's device buffer in one gather
  launch (the same row kernel ulacache uses) and the previous newest token's backup, then
  attention over the buffer slots;
- **resident**: attention over rows already in the pool.

Attention is a torch stand-in for sparse MLA decode (:func:`sparse_mla`: dequantise the
gathered rows, ``q . k`` over 576 dims, softmax, ``p . v`` over 512), the same for all three;
no FlashMLA here. A step's measured time is ``layers x`` the one layer plus ``--other-ms``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ulacache.kernels.dispatch import gather_rows

ROW_BYTES = 656  # 512 fp8 latent + 4 fp32 scales + 64 bf16 rope
LATENT, ROPE = 512, 64


def sparse_mla(q: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Sparse MLA decode over gathered FP8 rows (a torch stand-in for FlashMLA's kernel).

    ``q``: ``bf16 [R, heads, 576]``; ``pool``: ``uint8 [1, n, 656]`` (one layer); ``rows``:
    ``int [R, k]`` row ids, ``-1`` = no row (masked). Returns ``bf16 [R, heads, 512]``.
    """
    R, k = rows.shape
    valid = rows >= 0
    kv = pool[0].index_select(0, rows.clamp(min=0).reshape(-1).to(torch.int64)).view(R, k, -1)
    lat = kv[..., :LATENT].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16)
    scale = kv[..., LATENT:LATENT + 16].contiguous().view(torch.float32).to(torch.bfloat16)
    lat = (lat.view(R, k, 4, LATENT // 4) * scale.unsqueeze(-1)).view(R, k, LATENT)
    rope = kv[..., LATENT + 16:].contiguous().view(torch.bfloat16)
    key = torch.cat([lat, rope], -1)  # [R, k, 576]
    scores = torch.einsum("rhd,rkd->rhk", q, key).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num_(0.0).to(torch.bfloat16)
    return torch.einsum("rhk,rkd->rhd", p, lat)


class Timer:
    """``start()`` / ``stop(token) -> seconds`` of device work: CUDA events after a ~2 ms sleep
    (the GPU stays ahead of the host, so launch gaps are hidden as in a graph replay), or
    ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        torch.cuda._sleep(4_000_000)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def stop(self, token) -> float:
        if not self.cuda:
            return time.perf_counter() - token
        f = torch.cuda.Event(enable_timing=True)
        f.record()
        f.synchronize()
        return token.elapsed_time(f) * 1e-3


class RealRows:
    """The per-policy device state of one sweep level with real rows (one layer).

    ``policy``: ``"ulacache"`` (the level's :class:`Residency` was built with a layer of rows;
    pass it as ``ula``), ``"hisparse"`` (``requests x (h_slots + 64)`` device rows + a pinned
    host mirror of ``host_rows``) or ``"resident"`` (``gpu_rows`` device rows). ``heads``:
    query heads (128 for DeepSeek-V3.2 / GLM-5)."""

    def __init__(self, policy: str, device: torch.device, gpu_rows: int, host_rows: int,
                 h_slots: int, reserved: int, heads: int, k: int, ula=None):
        self.policy, self.device, self.k = policy, device, k
        self.timer = Timer(device)
        self.seconds: list[float] = []
        self.q = torch.randn(max(1, gpu_rows // (k + 1)), heads, LATENT + ROPE,
                             device=device).to(torch.bfloat16)
        if policy == "ulacache":
            self.ula = ula
            self.pool = ula.group.pools.gpu
        elif policy == "hisparse":
            self.stride = h_slots + reserved
            self.h = h_slots
            self.pool = torch.zeros(1, gpu_rows + 1, ROW_BYTES, dtype=torch.uint8, device=device)
            self.host = torch.zeros(1, host_rows + 1, ROW_BYTES, dtype=torch.uint8,
                                    pin_memory=device.type == "cuda")
        elif policy == "resident":
            self.pool = torch.zeros(1, gpu_rows + 1, ROW_BYTES, dtype=torch.uint8, device=device)
        else:
            raise ValueError(policy)

    def _attend(self, rows: torch.Tensor) -> None:
        R = rows.shape[0]
        if R > self.q.shape[0]:  # resident / hisparse may run more rows of fewer tokens
            self.q = self.q.repeat(-(-R // self.q.shape[0]), 1, 1)
        sparse_mla(self.q[:R], self.pool, rows)

    def ulacache_step(self, new: torch.Tensor, batch: torch.Tensor) -> None:
        """Round start + placement + access (real data) + attention, timed."""
        new, batch = new.to(self.device), batch.to(self.device)
        t = self.timer.start()
        rows = self.ula.step(new, batch, timed=False)
        self._attend(rows)
        self.seconds.append(self.timer.stop(t))

    def hisparse_admit(self, buffer: int, host_rows: np.ndarray) -> None:
        """A newly admitted request's buffer after its prefill (not timed): slot ``i`` holds
        position ``i`` (``alloc_device_buffer``), copied from the host mirror."""
        n = min(self.h, host_rows.size)
        gather_rows(self.host, torch.from_numpy(host_rows[:n]).to(self.device), self.pool,
                    torch.arange(buffer * self.stride, buffer * self.stride + n,
                                 device=self.device))

    def hisparse_step(self, buffers: list[int], host_rows: list[np.ndarray],
                      sels: list[np.ndarray], bufs, newest_prev: list[int]) -> None:
        """After each request's ``HiSparseBuffer.step``: the previous newest token's backup
        device -> host, the missed rows host -> device buffer (one gather), then attention over
        the buffer slots, timed. ``buffers[i]``: request i's buffer index; ``host_rows[i]``:
        its host-mirror row of each position."""
        src, dst, rows = [], [], np.full((len(sels), self.k), -1, dtype=np.int64)
        b_src, b_dst = [], []
        for i, (sel, buf) in enumerate(zip(sels, bufs)):
            base = buffers[i] * self.stride
            src.append(host_rows[i][buf.last_misses])
            dst.append(base + buf.last_miss_slots)
            rows[i, : sel.size] = base + buf.last_slots
            if newest_prev[i] >= 0:  # the reserved slot's token backs up to the mirror
                b_src.append(base + self.h)
                b_dst.append(int(host_rows[i][newest_prev[i]]))
        cat = lambda xs: torch.from_numpy(np.concatenate(xs) if xs else  # noqa: E731
                                          np.empty(0, dtype=np.int64))
        dev = self.device  # every index on the device before the clock starts
        src_t, dst_t = cat(src).to(dev), cat(dst).to(dev)
        b_src_t = torch.tensor(b_src, dtype=torch.int64).to(dev)
        b_dst_t = torch.tensor(b_dst, dtype=torch.int64).to(dev)
        rows_t = torch.from_numpy(rows).to(dev)
        t = self.timer.start()
        if b_src_t.numel():  # the backup first: the previous newest token may miss now
            gather_rows(self.pool, b_src_t, self.host, b_dst_t)
        if src_t.numel():
            gather_rows(self.host, src_t, self.pool, dst_t)
        self._attend(rows_t)
        self.seconds.append(self.timer.stop(t))

    def resident_step(self, rows: np.ndarray) -> None:
        """Attention over rows already in the pool, timed."""
        rows_t = torch.from_numpy(rows).to(self.device)
        t = self.timer.start()
        self._attend(rows_t)
        self.seconds.append(self.timer.stop(t))
