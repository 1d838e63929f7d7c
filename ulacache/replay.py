"""Replay recorded selection traces through the real core.

Each of ``requests`` interleaved requests replays the trace from its own starting step (so the
batch mixes lengths): it is prefilled up to that step's query position, then every replayed
step appends one token (``extend``) and, per selection group, runs the sparse access of the
trace's top-k for that step (``access``: promotions, swaps, spills move real bytes between the
pools). Each recorded layer is one selection group (one indexer per layer, as in the trace).

Reported per policy: GPU hit rate, promotions / write-backs / spills per step, and the bytes
those move per tier per step (rows x row bytes x layers of the group).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from .cache import UlaCache
from .config import UlaCacheConfig
from .traces import Trace

logger = logging.getLogger(__name__)


@dataclass
class ReplayResult:
    """Per-step averages of one replay (``*_per_step`` are means over replayed steps)."""

    policy: str
    steps: int
    requests: int
    groups: int
    gpu_slots: int
    cpu_slots: int
    row_bytes: int
    hit_rate: float
    promotions_per_step: float
    writebacks_per_step: float
    spills_per_step: float
    h2d_bytes_per_step: float  # CPU -> GPU: promoted rows
    d2h_bytes_per_step: float  # GPU -> CPU: write-backs of victims and spills of new rows

    def to_dict(self) -> dict:
        return asdict(self)


def plan_requests(trace: Trace, requests: int, steps: int) -> list[int]:
    """Start step of each request, spread over the trace so requests differ in length."""
    if steps > trace.steps:
        raise ValueError(f"trace has {trace.steps} steps, {steps} requested")
    span = trace.steps - steps
    return [span * (r + 1) // requests for r in range(requests)]


def replay(trace: Trace, *, requests: int = 4, steps: int = 256, layers: list[int] | None = None,
           gpu_slots: int | None = None, cpu_slots: int | None = None, layout: str = "fp8",
           policy: str = "pblru", n_buckets: int = 64, page_size: int = 64,
           progress: bool = False) -> ReplayResult:
    """Replay ``trace`` through a :class:`UlaCache`; see the module docstring."""
    layers = list(range(trace.layers)) if layers is None else layers
    starts = plan_requests(trace, requests, steps)
    pos = trace.positions
    live_end = sum(int(pos[s + steps - 1]) + 1 for s in starts)
    k = trace.k
    gpu_slots = gpu_slots or 256 * requests
    if gpu_slots < requests * (k + 1):
        raise ValueError(f"gpu_slots {gpu_slots} < requests x (k + 1) = {requests * (k + 1)}: "
                         "one step's selections must fit in the GPU pool")
    cpu_slots = cpu_slots if cpu_slots is not None else max(0, live_end - gpu_slots) + page_size
    cfg = UlaCacheConfig(layout=layout, n_layers=len(layers), layers_per_group=1,
                         gpu_slots=gpu_slots, cpu_slots=cpu_slots, page_size=page_size,
                         max_requests=requests, max_batch=requests, top_k=k, n_buckets=n_buckets,
                         policy=policy)
    cache = UlaCache(cfg)
    for r, s in enumerate(starts):  # prefill in chunks that fit one round's GPU room
        prompt = int(pos[s])
        cache.admit(r, prompt + steps)
        done = 0
        while done < prompt:
            cache.begin_round()
            n = min(prompt - done, gpu_slots // 2)
            cache.extend(r, n)
            done += n
    base = cache.stats()
    sel = torch.from_numpy(trace.selections[layers]).to(torch.int64)  # [G, steps, k]
    it = range(steps)
    if progress:
        try:
            from tqdm import tqdm

            it = tqdm(it, desc=f"replay {policy}", leave=False)
        except ImportError:
            pass
    for t in it:
        cache.begin_round()
        for r in range(requests):
            cache.extend(r, 1)
        for g in range(len(layers)):
            addrs = torch.stack([cache.addresses(r, sel[g, starts[r] + t]) for r in
                                 range(requests)])
            cache.access(g, addrs)
    cache.check_integrity()
    st = cache.stats()

    def total(name: str) -> int:
        return sum(st[f"group{g}_{name}"] - base[f"group{g}_{name}"] for g in range(len(layers)))

    rb = cfg.row_layout.row_bytes
    return ReplayResult(
        policy=policy, steps=steps, requests=requests, groups=len(layers), gpu_slots=gpu_slots,
        cpu_slots=cpu_slots, row_bytes=rb,
        hit_rate=total("gpu_hits") / max(1, total("accesses")),
        promotions_per_step=total("promotions") / steps,
        writebacks_per_step=total("writebacks") / steps,
        spills_per_step=total("spills") / steps,
        h2d_bytes_per_step=total("promotions") * rb / steps,
        d2h_bytes_per_step=(total("writebacks") + total("spills")) * rb / steps,
    )


def format_results(trace: Trace, results: list[ReplayResult]) -> str:
    """A short table, one row per policy."""
    r0 = results[0]
    meta = trace.meta.raw
    lines = [
        f"trace {meta.get('text_file', '?')}: model {meta.get('model', '?')}, {trace.layers} "
        f"layers, k={trace.k}, {trace.steps} steps",
        f"replayed: {r0.requests} interleaved requests x {r0.steps} steps, {r0.groups} selection "
        f"groups, GPU {r0.gpu_slots} + CPU {r0.cpu_slots} slots/group, rows of {r0.row_bytes} B; "
        "per-step figures are summed over the groups",
        f"{'policy':<10} {'GPU hit':>8} {'promo/step':>11} {'wb/step':>8} {'spill/step':>11} "
        f"{'H2D KB/step':>12} {'D2H KB/step':>12}",
    ]
    for r in results:
        label = {"pblru": "PB-LRU", "lru": "exact LRU"}.get(r.policy, r.policy)
        lines.append(f"{label:<10} {r.hit_rate:>8.4f} {r.promotions_per_step:>11.1f} "
                     f"{r.writebacks_per_step:>8.1f} {r.spills_per_step:>11.1f} "
                     f"{r.h2d_bytes_per_step / 1024:>12.1f} {r.d2h_bytes_per_step / 1024:>12.1f}")
    if len(results) == 2:
        d = 100 * (results[0].hit_rate - results[1].hit_rate)
        lines.append(f"hit-rate difference PB-LRU - exact LRU: {d:+.3f} percentage points")
    return "\n".join(lines)
