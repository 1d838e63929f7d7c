"""Replay a selection trace through a TP group of P simulated ranks (``ulacache replay --mode
tp --tp-size P``).

Every rank runs the DP replay's schedule (:mod:`ulacache.tools.replay`: interleaved requests,
prefill, one new token per request per step, one access per selection group) over its rank
of the striped address space, in its own thread; the ranks meet in the TP protocol's
collectives (:class:`ulacache.ipc.ThreadPeers`), and every access moves real bytes: owners'
promotions between their pools, peers' rows into each rank's buffer. Production mode
(``validate`` off); integrity (including every buffered copy against its owner's bytes) is
checked once at the end.

Reported per rank: unique rows held (own GPU + CPU rows; the replicated layout holds every
row on every rank) and buffered copies; the share of each step's distinct selections served
by each gate (buffer hit, own pool, of which promoted from this rank's CPU tier, peer pool);
bytes per step on each link: peer (NVLink-like: rows copied from peers' GPU pools into the
buffer) and PCIe (promotions, write-backs, spills). The paper's accounting is printed next to
it: a rank owns 1/P of what is selected and reads (P-1)/P from peers unless it hits.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig
from ulacache.group import occupancy
from ulacache.ipc import run_ranks
from ulacache.pblru import DEFAULT_BUCKETS

from .replay import plan_requests
from .traces import Trace

logger = logging.getLogger(__name__)


@dataclass
class RankResult:
    """One rank's totals over the replayed steps (``*_per_step``: means)."""

    rank: int
    unique_rows: int  # own rows held at the end (GPU + CPU), every group
    buffered_rows: int  # copies of peers' rows held at the end, every group
    selected: int  # distinct selected rows over the replayed steps, every group
    buffer_hits: int
    own_rows: int
    promoted: int  # own rows promoted from this rank's CPU tier
    peer_fetches: int
    peer_bytes_per_step: float  # peers' GPU pools -> this rank's buffer
    pcie_bytes_per_step: float  # promotions + write-backs + spills of this rank's rows
    in_place_bytes_per_step: float  # own rows read in place: what a local copy would move
    eviction_d2h_bytes_per_step: float = 0.0  # own rows written back a second time
    remaps: int = 0  # own rows evicted onto their shadow (no copy)

    @property
    def unique_share(self) -> float:
        """Unique rows among the KV rows this rank holds (pools + buffer copies)."""
        return self.unique_rows / max(1, self.unique_rows + self.buffered_rows)

    def share(self, name: str) -> float:
        return getattr(self, name) / max(1, self.selected)

    @property
    def buffer_hit_rate(self) -> float:
        """Of the peers' rows a rank read, the share its buffer already held."""
        return self.buffer_hits / max(1, self.buffer_hits + self.peer_fetches)

    def to_dict(self) -> dict:
        return {**asdict(self), "unique_share": self.unique_share,
                "buffer_hit_rate": self.buffer_hit_rate,
                **{f"{n}_share": self.share(n) for n in
                   ("buffer_hits", "own_rows", "promoted", "peer_fetches")}}


@dataclass
class TPReplayResult:
    tp_size: int
    steps: int
    requests: int
    groups: int
    gpu_slots: int  # per rank, per group
    cpu_slots: int
    buffer_slots: int
    row_bytes: int
    ranks: list[RankResult]

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "ranks"},
                "ranks": [r.to_dict() for r in self.ranks]}


def replay_tp(trace: Trace, *, tp_size: int = 4, requests: int = 4, steps: int = 256,
              layers: list[int] | None = None, gpu_slots: int | None = None,
              cpu_slots: int | None = None, buffer_slots: int | None = None,
              layout: str = "fp8", policy: str = "pblru", n_buckets: int = DEFAULT_BUCKETS,
              page_size: int = 64, shadows: bool = True) -> TPReplayResult:
    """Replay ``trace`` through ``tp_size`` ranks; see the module docstring. Pool sizes are
    per rank and group: GPU ``256 x requests / P``, CPU the rest of the rank's share of the
    live history, buffer ``requests x (k + 1)`` (one step's selections and new rows)."""
    layers = list(range(trace.layers)) if layers is None else layers
    if not layers or any(not 0 <= x < trace.layers for x in layers):
        raise ValueError(f"layers must be non-empty indices in [0, {trace.layers})")
    P, k = tp_size, trace.k
    starts = plan_requests(trace, requests, steps)
    pos = trace.positions
    live_end = sum(int(pos[s + steps - 1]) + 1 for s in starts)
    gpu_slots = gpu_slots or -(-256 * requests // P)
    share = -(-live_end // P) + requests * P  # a rank's share, with page-tail slack
    cpu_slots = cpu_slots if cpu_slots is not None else max(0, share - gpu_slots) + page_size
    buffer_slots = buffer_slots or requests * (k + 1)
    cfg = UlaCacheConfig(layout=layout, n_layers=len(layers), layers_per_group=1,
                         gpu_slots=gpu_slots, cpu_slots=cpu_slots, page_size=page_size,
                         max_requests=requests, n_buckets=n_buckets, policy=policy,
                         validate=False, tp_size=P, buffer_slots=buffer_slots, shadows=shadows)
    sel = torch.from_numpy(trace.selections[layers]).to(torch.int64)  # [groups, steps, k]
    chunk = max(1, min(gpu_slots * P // 2, buffer_slots * P // max(1, P - 1) // 2))
    groups = len(layers)

    def rank_main(peers) -> RankResult:
        cache = UlaCache(cfg, peers=peers)
        space = cache.space
        for r, s in enumerate(starts):  # prefill in chunks that fit one round's room
            prompt = int(pos[s])
            cache.admit(r, prompt + steps)
            done = 0
            while done < prompt:
                space.begin_round()
                n = min(prompt - done, chunk)
                cache.extend(r, n)
                done += n
        base = cache.stats()
        for t in range(steps):
            space.begin_round()
            cache.extend_batch(dict.fromkeys(range(requests), 1))
            for g in range(groups):
                addrs = torch.stack([cache.addresses(r, sel[g, starts[r] + t])
                                     for r in range(requests)])
                space.access(g, addrs)
        cache.check_integrity()
        st = cache.stats()

        def total(name: str) -> int:
            return sum(st[f"group{g}_{name}"] - base[f"group{g}_{name}"] for g in range(groups))

        for bad in ("access_overflow", "place_overflow", "invalid", "peer_missing",
                    "buffer_overflow"):
            if total(bad):
                raise RuntimeError(f"rank {peers.rank}: TP replay overflowed ({bad} "
                                   f"{total(bad)}); enlarge the pools or the buffer")
        counters = space.counters()
        unique = sum(sum(occupancy(c)) for c in counters)
        buffered = sum(int((b.holder[: b.n_slots] >= 0).sum()) for b in space.buffers)
        rb = cfg.row_layout.row_bytes
        return RankResult(
            rank=peers.rank, unique_rows=unique, buffered_rows=buffered,
            selected=total("selected"), buffer_hits=total("buffer_hits"),
            own_rows=total("own_rows"), promoted=total("promotions"),
            peer_fetches=total("peer_fetches"),
            peer_bytes_per_step=total("peer_fetches") * rb / steps,
            pcie_bytes_per_step=(total("promotions") + total("writebacks") + total("spills"))
            * rb / steps,
            in_place_bytes_per_step=total("own_rows") * rb / steps,
            eviction_d2h_bytes_per_step=total("rewrites") * rb / steps,
            remaps=total("remaps"))

    ranks = run_ranks(P, rank_main)
    return TPReplayResult(tp_size=P, steps=steps, requests=requests, groups=groups,
                          gpu_slots=gpu_slots, cpu_slots=cpu_slots, buffer_slots=buffer_slots,
                          row_bytes=cfg.row_layout.row_bytes, ranks=ranks)


def format_tp_results(trace: Trace, res: TPReplayResult) -> str:
    """A per-rank table and the paper's accounting next to it."""
    meta = trace.meta.raw
    P = res.tp_size
    lines = [
        f"trace {meta.get('text_file', '?')}: model {meta.get('model', '?')}, {trace.layers} "
        f"layers, k={trace.k}, {trace.steps} steps",
        f"TP replay: {P} ranks, {res.requests} interleaved requests x {res.steps} steps, "
        f"{res.groups} selection groups; per rank and group GPU {res.gpu_slots} + CPU "
        f"{res.cpu_slots} + buffer {res.buffer_slots} rows of {res.row_bytes} B; shares are of "
        "each step's distinct selections, bytes per step summed over the groups",
        f"{'rank':>4} {'unique rows':>11} {'copies':>7} {'unique':>7} {'buf hit':>8} "
        f"{'own':>6} {'(CPU)':>6} {'peer':>6} {'hit/peer':>9} {'peer KB/step':>13} "
        f"{'PCIe KB/step':>13}",
    ]
    for r in res.ranks:
        lines.append(
            f"{r.rank:>4} {r.unique_rows:>11} {r.buffered_rows:>7} {r.unique_share:>7.1%} "
            f"{r.share('buffer_hits'):>8.1%} {r.share('own_rows'):>6.1%} "
            f"{r.share('promoted'):>6.1%} {r.share('peer_fetches'):>6.1%} "
            f"{r.buffer_hit_rate:>9.1%} {r.peer_bytes_per_step / 1024:>13.1f} "
            f"{r.pcie_bytes_per_step / 1024:>13.1f}")
    sel = sum(r.selected for r in res.ranks) / P
    peer_pred = (P - 1) / P * sel * res.row_bytes / res.steps
    hits = sum(r.buffer_hits for r in res.ranks)
    hit = hits / max(1, sum(r.selected for r in res.ranks))
    hit_peer = hits / max(1, hits + sum(r.peer_fetches for r in res.ranks))
    own = sum(r.own_rows for r in res.ranks) / max(1, sum(r.selected for r in res.ranks))
    peer_kb = sum(r.peer_bytes_per_step for r in res.ranks) / P / 1024
    lines += [
        f"paper's accounting: a rank owns 1/P = {1 / P:.1%} of the selections (measured "
        f"{own:.1%}) and reads (P-1)/P = {(P - 1) / P:.1%} from peers, "
        f"{peer_pred / 1024:.1f} KB/step without a buffer; the buffer served {hit:.1%} of the "
        f"selections ({hit_peer:.1%} of the peers' rows), leaving {peer_kb:.1f} KB/step "
        f"from peers (x{peer_kb * 1024 / max(1e-9, peer_pred):.3f} of the bufferless figure)",
        f"own rows are read in place (attention indexes one tensor [own pool | buffer]): "
        f"{sum(r.in_place_bytes_per_step for r in res.ranks) / P / 1024:.1f} KB/step per rank "
        "that a copy into the buffer would move, and buffer slots it would take",
        f"memory: every pool row is unique (held by its owner only); replicated TP holds each "
        f"row on all {P} ranks ({1 / P:.1%} unique); with the buffer's copies counted, "
        f"{min(r.unique_share for r in res.ranks):.1%} of the rows a rank holds are unique",
    ]
    return "\n".join(lines)
