"""A model of SGLang 0.5.23's HiSparse swap-in, for residency studies next to ulacache.

HiSparse (``srt/managers/hisparse_coordinator.py`` + the swap-in kernel
``kernels/jit/csrc/kvcacheio/hisparse.cuh``, ``load_cache_to_device_buffer_kernel``) gives every
request, in every layer, a fixed device buffer of ``H`` slots (``device_buffer_size``, default
4096 = 2 x top_k) plus one reserved page (``padded_buffer_size = H + page_size``, 64 rows for DSA)
whose first slot, ``H``, holds the newest token. The host pool is an inclusive mirror: every
token's row is on the host, a miss is one host -> device row read into the buffer, eviction writes
nothing back. Once per decode step the previous newest token is backed up to the host
(``_eager_backup_previous_token``): one device -> host row per request and layer.

:class:`HiSparseBuffer` is one request's buffer in one layer; it follows the kernel exactly:

* state: ``tokens[slot]`` (``req_device_buffer_tokens``, slot -> token position, -1 empty) and
  ``lru`` (``lru_slots``, a permutation of the H slots, least recently used first). A new request
  starts as ``alloc_device_buffer`` leaves it: slot i holds token i, LRU order 0..H-1 (the
  staging path: prefill wrote token i to buffer slot i).
* ``seq_len <= H`` (the kernel's fast path, ``naive_load_topk``'s short path): every token is in
  the buffer at slot = position; all hits, no state change, the LRU order is untouched.
* ``seq_len > H``: the newest token (``seq_len - 1``) is a hit in the reserved slot H (outside the
  LRU). The other selected tokens are looked up among the H slots: walking the LRU order, slots
  holding a selected token are hits, the rest are evictable (both lists keep LRU order). The
  selected tokens not found are misses, in the order of the top-k array; the i-th miss takes the
  i-th least recently used evictable slot. New LRU order: the evictables not taken (stale), then
  the taken slots in miss order, then the hits (most recent).

Study tool, not the serving path: numpy per (request, layer), Python loops over requests and
layers. :func:`replay_hisparse` replays a trace as :func:`ulacache.tools.replay.replay` does
(same requests, start steps and selections), so hit rates and PCIe bytes compare directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ulacache.layout import RowLayout

from .replay import ReplayResult, plan_requests
from .traces import Trace

DEFAULT_H_SLOTS = 4096  # SGLang's device_buffer_size default: 2 x top_k (2048)
RESERVED_SLOTS = 64  # the extra page per request (padded_buffer_size = H + page_size, DSA page)


class HiSparseBuffer:
    """One request's HiSparse device buffer in one layer (see the module docstring).

    ``step`` returns ``(hits, misses)``; after it ``last_slots`` holds the buffer slot of every
    selected entry (``h_slots`` for the newest token), ``last_misses`` the missed positions in
    load order and ``last_miss_slots`` the slots they were loaded into. Each miss is one host ->
    device row read; nothing is ever written back.
    """

    def __init__(self, h_slots: int = DEFAULT_H_SLOTS):
        if h_slots < 1:
            raise ValueError(f"h_slots must be >= 1, got {h_slots}")
        self.h = h_slots
        self.tokens = np.arange(h_slots, dtype=np.int64)  # slot -> position (alloc_device_buffer)
        self.lru = np.arange(h_slots, dtype=np.int64)  # slots, least recently used first
        self.last_slots = np.empty(0, dtype=np.int64)
        self.last_misses = np.empty(0, dtype=np.int64)
        self.last_miss_slots = np.empty(0, dtype=np.int64)

    @property
    def reserved_slot(self) -> int:
        """The slot of the newest token (index H, outside the LRU)."""
        return self.h

    def step(self, selected_positions, newest_position: int) -> tuple[int, int]:
        """One decode step's swap-in for this request and layer.

        ``selected_positions``: the top-k token positions (unique, in ``[0, newest_position]``,
        at most H of them; any order: misses load in this order). ``newest_position`` is
        ``seq_len - 1``.
        """
        sel = np.asarray(selected_positions, dtype=np.int64).reshape(-1)
        newest = int(newest_position)
        if sel.size > self.h:
            raise ValueError(f"{sel.size} selected positions exceed the {self.h}-slot buffer")
        if sel.size and (sel.min() < 0 or sel.max() > newest):
            raise ValueError(f"selected positions must be in [0, {newest}]")
        if np.unique(sel).size != sel.size:
            raise ValueError("selected positions must be unique (top-k output)")
        seq_len = newest + 1
        if seq_len <= self.h:  # fast path: token p sits in slot p, nothing moves
            self.last_slots = sel.copy()
            self.last_misses = np.empty(0, dtype=np.int64)
            self.last_miss_slots = np.empty(0, dtype=np.int64)
            return int(sel.size), 0
        slots = np.full(sel.size, self.h, dtype=np.int64)  # newest -> reserved slot H
        is_newest = sel == newest
        others = ~is_newest
        lru_tokens = self.tokens[self.lru]
        hit_in_lru = np.isin(lru_tokens, sel[others])  # the newest is never in the H slots
        hit_slots = self.lru[hit_in_lru]
        evictable = self.lru[~hit_in_lru]
        found = np.isin(sel, lru_tokens) & others
        # hits: slot of each found position (token -> slot through the sorted hit tokens)
        hit_tokens = self.tokens[hit_slots]
        order = np.argsort(hit_tokens)
        slots[found] = hit_slots[order][np.searchsorted(hit_tokens[order], sel[found])]
        miss = others & ~found
        misses = sel[miss]
        taken = evictable[: misses.size]  # i-th miss -> i-th least recently used evictable
        slots[miss] = taken
        self.tokens[taken] = misses
        self.lru = np.concatenate([evictable[misses.size:], taken, hit_slots])
        self.last_slots = slots
        self.last_misses = misses
        self.last_miss_slots = taken  # where each miss was loaded
        return int(sel.size - misses.size), int(misses.size)


@dataclass
class HiSparseReplayResult:
    """Totals and per-step means of a HiSparse replay (``*_per_step``: summed over groups)."""

    policy: str  # "hisparse"
    steps: int
    requests: int
    groups: int
    h_slots: int
    reserved_slots: int
    gpu_slots: int  # device rows per group: requests x (H + reserved)
    row_bytes: int
    accesses: int
    misses: int
    hit_rate: float
    loads_per_step: float  # host -> device row reads (= misses)
    backups_per_step: float  # device -> host: the previous newest token, per request and layer
    h2d_bytes_per_step: float
    d2h_bytes_per_step: float

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def pcie_bytes_per_step(self) -> float:
        return self.h2d_bytes_per_step + self.d2h_bytes_per_step


def hisparse_gpu_rows(requests: int, h_slots: int, reserved: int = RESERVED_SLOTS) -> int:
    """Device rows HiSparse holds per layer: one (H + reserved)-row buffer per request."""
    return requests * (h_slots + reserved)


def replay_hisparse(trace: Trace, *, requests: int = 4, steps: int = 256,
                    layers: list[int] | None = None, h_slots: int | None = None,
                    reserved: int = RESERVED_SLOTS, layout: str = "fp8") -> HiSparseReplayResult:
    """Replay ``trace`` through per-request :class:`HiSparseBuffer` s, as ``replay`` does.

    Request r starts at step ``plan_requests(...)[r]`` with its prompt already staged (slot i
    holds token i); replayed step t appends position ``positions[s + t]`` (the newest token) and
    selects ``selections[layer, s + t]``. ``h_slots`` defaults to 2 x k (SGLang's
    ``device_buffer_size = 2 x top_k``).
    """
    layers = list(range(trace.layers)) if layers is None else layers
    if not layers or any(not 0 <= x < trace.layers for x in layers):
        raise ValueError(f"layers must be non-empty indices in [0, {trace.layers})")
    h = 2 * trace.k if h_slots is None else h_slots
    if h < trace.k:
        raise ValueError(f"hisparse h_slots {h} < k = {trace.k}: one step's top-k must fit "
                         "in the buffer")
    starts = plan_requests(trace, requests, steps)
    pos, sel = trace.positions, trace.selections
    bufs = [[HiSparseBuffer(h) for _ in starts] for _ in layers]
    acc = miss = 0
    for t in range(steps):
        for g, layer in enumerate(layers):
            for r, s in enumerate(starts):
                hits, m = bufs[g][r].step(sel[layer, s + t], int(pos[s + t]))
                acc += hits + m
                miss += m
    rb = RowLayout.named(layout, None).row_bytes
    backups = requests * len(layers)  # per step: the previous newest token of each request
    return HiSparseReplayResult(
        policy="hisparse", steps=steps, requests=requests, groups=len(layers), h_slots=h,
        reserved_slots=reserved, gpu_slots=hisparse_gpu_rows(requests, h, reserved),
        row_bytes=rb, accesses=acc, misses=miss, hit_rate=(acc - miss) / max(1, acc),
        loads_per_step=miss / steps, backups_per_step=float(backups),
        h2d_bytes_per_step=miss * rb / steps, d2h_bytes_per_step=float(backups * rb))


def format_comparison(trace: Trace, ula: list[ReplayResult], hs: HiSparseReplayResult) -> str:
    """ulacache (shared pool) vs HiSparse (per-request buffers) at equal GPU rows per layer."""
    meta = trace.meta.raw
    lines = [
        f"trace {meta.get('text_file', '?')}: model {meta.get('model', '?')}, {trace.layers} "
        f"layers, k={trace.k}, {trace.steps} steps",
        f"replayed: {hs.requests} interleaved requests x {hs.steps} steps, {hs.groups} layers, "
        f"rows of {hs.row_bytes} B; per-step figures are summed over the layers",
        f"equal GPU memory: HiSparse {hs.requests} requests x (H {hs.h_slots} + reserved "
        f"{hs.reserved_slots}) = {hs.gpu_slots} rows per layer; ulacache's shared pool gets the "
        f"same {hs.gpu_slots} rows per group"
        + ("" if all(r.gpu_slots == hs.gpu_slots for r in ula) else " (NOT equal: see gpu_slots)"),
        f"{'system':<30} {'GPU hit':>8} {'misses':>7} {'H2D KB/step':>12} {'D2H KB/step':>12} "
        f"{'PCIe KB/step':>13}",
    ]
    labels = {"pblru": "ulacache shared pool, PB-LRU", "lru": "ulacache shared pool, LRU"}
    for r in ula:
        pcie = r.h2d_bytes_per_step + r.d2h_bytes_per_step
        lines.append(f"{labels.get(r.policy, r.policy):<30} {r.hit_rate:>8.4f} {r.misses:>7} "
                     f"{r.h2d_bytes_per_step / 1024:>12.1f} {r.d2h_bytes_per_step / 1024:>12.1f} "
                     f"{pcie / 1024:>13.1f}")
    lines.append(f"{'HiSparse per-request buffers':<30} {hs.hit_rate:>8.4f} {hs.misses:>7} "
                 f"{hs.h2d_bytes_per_step / 1024:>12.1f} {hs.d2h_bytes_per_step / 1024:>12.1f} "
                 f"{hs.pcie_bytes_per_step / 1024:>13.1f}")
    for r in ula:
        pcie = r.h2d_bytes_per_step + r.d2h_bytes_per_step
        lines.append(f"PCIe bytes per step, HiSparse / {labels.get(r.policy, r.policy)}: "
                     f"x{hs.pcie_bytes_per_step / max(1e-9, pcie):.2f} (H2D alone "
                     f"x{hs.h2d_bytes_per_step / max(1e-9, r.h2d_bytes_per_step):.2f})")
    lines.append("HiSparse D2H is the per-step backup of each request's newest token to its "
                 "inclusive host mirror; its evictions write nothing back. ulacache D2H: "
                 "write-backs of victims and spills of new rows (exclusive tiers).")
    return "\n".join(lines)
