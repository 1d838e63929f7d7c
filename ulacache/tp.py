"""TP mode: one address space striped across the P ranks of a tensor-parallel group.

Address ``t`` lives on rank ``t mod P`` at local position ``t // P`` (design §2). Each rank
holds an :class:`~ulacache.space.AddressSpace` over its ``ceil(n / P)`` local positions (GPU
and CPU pools, mapping, PB-LRU: the DP core, unchanged) plus, per selection group, a
:class:`~ulacache.buffer.LocalBuffer` of copies of peers' rows. Attention reads one tensor per
layer, ``[own pool rows (G) | scratch | buffer rows (B)]`` (:meth:`TPAddressSpace.attn_rows`),
so own rows are read in place.

One step of one selection group (every rank holds the same top-k: the sharded indexer's
merge, :mod:`ulacache.indexer`, or a replicated indexer)::

    plan(group, addrs)          once per group per step (plan reuse, design §3):
      1. own rows: the DP access on this rank's shard (CPU-resident rows are promoted into
         this rank's GPU pool: data, then mapping)
      2. exchange: all-gather of the owners' slot tables int32 [P, bs, k]; it is also the
         fence that orders every owner's promotions before any peer's read
      3. gates, in order: buffer hit (no transfer) | own pool (read in place) | peer pool
         (a buffer slot is claimed; the copy is listed)
    load(layer)                 every layer of the group: one peer gather of its own bytes

Cross-rank ordering (docs/architecture.md, "TP mode"): metadata is owner-held; the only thing
exchanged per step is the slot table, by the same collective that orders the data.
:meth:`begin_round` is a fence of the whole group (every rank finished the previous round's
reads before any owner evicts), and new rows of a round are stored by their owner *and*
copied into every other rank's buffer from the rows each rank computed itself (TP ranks
compute identical latent rows), so no rank reads a row from a peer in the round it is written.

Collective calls (every rank calls them in the same order with the same arguments):
``begin_round``, ``place``, ``plan``, ``access``, ``release``, ``write``, ``read``,
``check_integrity``. Host-checked calls (``write``, ``read``, and the rest with validate on)
agree on one verdict (:meth:`TPAddressSpace._agree`) before any rank mutates or enters the
call's own collective, so every rank raises the same typed error or none does.

Contract of a plan: every layer of the group calls :meth:`load` after the group's
:meth:`plan` and before the next :meth:`begin_round` (SGLang's layer loop does: every layer's
``swap_in_selected_pages``). The plan claims buffer slots for all layers at once; a layer that
skipped its ``load`` would leave its bytes of those copies unfilled, and a later hit would read
them. (The calls may be captured in a CUDA graph, so the core cannot track them on the host.)
"""

from __future__ import annotations

import logging

import torch

from ulacache.kernels.cuda_rows import kernels_available
from ulacache.kernels.dispatch import gather_rows_peers, pool_ptr_table

from .address import owner_rank
from .buffer import LocalBuffer
from .config import UlaCacheConfig
from .errors import AddressError, CapacityExhausted, ConfigError, ShapeError
from .group import (
    COUNTERS,
    add_counts,
    advance_policies,
    check_distinct,
    check_out,
    count_distinct,
    distinct_addresses,
    in_pieces,
)
from .health import CounterMonitor
from .pblru import PBLRUArena
from .pools import resolve_device
from .space import AddressSpace
from .striping import (  # noqa: F401 (owned_counts, agree_verdict: re-exported)
    StripedSpace,
    agree_verdict,
    owned_counts,
    step_share_bound,
)

logger = logging.getLogger(__name__)

TP_COUNTERS = ("selected", "own_rows", "buffer_hits", "peer_fetches", "peer_missing",
               "buffer_overflow", "new_buffered", "buffer_evictions", "buffer_drops")
"""Per group per rank (``int64`` on the device), distinct rows per step:

- ``selected``: distinct valid selections; ``own_rows``: those this rank owns (gate b, read
  in place); ``buffer_hits``: peers' rows already in the buffer (gate a);
  ``peer_fetches``: peers' rows copied owner GPU -> buffer (gate c, once per layer);
- ``peer_missing``: peers' live rows their owner could not serve (its overflow; read as
  padding); a selection its owner does not store at all is ``invalid`` on every rank;
- ``buffer_overflow``: peers' rows with no buffer slot this round (read as padding, or for a
  new row: left to its owner);
- ``new_buffered``: new rows copied into the buffer at placement; ``buffer_evictions``:
  copies evicted to make room (their owner keeps the row); ``buffer_drops``: copies dropped
  because their address was released.
"""

TP_OVERFLOWS = ("peer_missing", "buffer_overflow")
_TP_WHAT = {
    "peer_missing": "peers' row(s) their owner could not make GPU-resident (the owner's "
                    "access_overflow) were served as padding; enlarge gpu_slots",
    "buffer_overflow": "peers' row(s) found no buffer slot this round (every slot held a row "
                       "read or written this round) and were served as padding, or a new row "
                       "was left to its owner; enlarge buffer_slots to a step's distinct peer "
                       "rows plus the round's new rows",
}


def buffer_used(values: dict[str, int]) -> dict[str, int]:
    """Buffer slots holding a copy, derived from a group's TP counters (every claim is a new
    row's copy or a fetch; evictions and drops free one)."""
    return {"buffer_used": values["new_buffered"] + values["peer_fetches"]
            - values["buffer_evictions"] - values["buffer_drops"]}


INVALID_ROW = -2
"""An owner's entry in the exchanged slot table for an address it does not store (never
placed, or released): its peers count it ``invalid``, as the owner does, not
``peer_missing`` (which means the owner could not make a live row resident)."""


class _Plan:
    """One group's plan for the current step: the peer copies every layer repeats
    (``int32 [n]`` each, ``-1``: no copy)."""

    __slots__ = ("src_rank", "src_slot", "dst_row")

    def __init__(self, src_rank: torch.Tensor, src_slot: torch.Tensor, dst_row: torch.Tensor):
        self.src_rank, self.src_slot, self.dst_row = src_rank, src_slot, dst_row


class TPAddressSpace(StripedSpace):
    """This rank's share of a TP group's striped address space ``[0, n_logical)``.

    Parameters
    ----------
    config : ``tp_size`` = P, ``buffer_slots`` = B; ``gpu_slots`` / ``cpu_slots`` are this
        rank's (per group, per layer).
    peers : a :class:`ulacache.ipc.Peers` of size P (threads, shared memory or CUDA IPC).
    n_logical : global addresses (SGLang: its allocator's token count).
    layer_groups : as for :class:`~ulacache.space.AddressSpace`.
    storage : optional engine-owned tensors, one ``(name, uint8 [L_g, R, row_bytes])`` per
        group, each allocated with ``peers.alloc_shared(name, ...)`` (e.g. SGLang's
        ``kv_buffer`` with its sink page); ulacache uses rows ``[row_offset, row_offset + G +
        1 + B)`` of it, and the rows :meth:`plan`, :meth:`access` and :meth:`translate` return
        are rows of that tensor (the kernels add ``row_offset``).
    """

    def __init__(self, config: UlaCacheConfig, peers, *, n_logical: int,
                 layer_groups: list[list[int]] | None = None,
                 storage: list[tuple[str, torch.Tensor]] | None = None, row_offset: int = 0):
        if config.tp_size < 2 or peers.size != config.tp_size:
            raise ShapeError(f"TP mode needs tp_size >= 2 equal to the peer group's size; got "
                             f"tp_size {config.tp_size} and {peers.size} peers")
        if isinstance(n_logical, bool) or not isinstance(n_logical, int) or n_logical < 1:
            raise ShapeError(f"n_logical must be a positive integer, got {n_logical!r}")
        self.config, self.peers = config, peers
        self.P, self.rank = config.tp_size, peers.rank
        self.device = resolve_device(peers.device)
        self.n_logical = n_logical
        self.n_local = -(-n_logical // self.P)
        G, B, rb = config.gpu_slots, config.buffer_slots, config.row_layout.row_bytes
        self.gpu_slots, self.buffer_slots = G, B
        L = config.layers_per_group
        groups = layer_groups or [list(range(g * L, (g + 1) * L)) for g in range(config.n_groups)]
        R = G + 1 + B
        if storage is None:
            # one shared tensor per group: [own pool | scratch | buffer], every layer of it
            storage = [(f"group{gi}", peers.alloc_shared(f"group{gi}", (len(g), R, rb),
                                                         torch.uint8))
                       for gi, g in enumerate(groups)]
            row_offset = 0
        if len(storage) != len(groups):
            raise ShapeError(f"storage needs one tensor per group ({len(groups)})")
        for (name, t), g in zip(storage, groups):
            if t.dtype != torch.uint8 or t.dim() != 3 or t.shape[0] != len(g) or \
                    t.shape[2] != rb or t.shape[1] < row_offset + R or not t.is_contiguous():
                raise ShapeError(f"storage {name!r} must be a contiguous uint8 [{len(g)}, >= "
                                 f"{row_offset + R}, {rb}] tensor, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        names = [name for name, _ in storage]
        self.row_base = row_offset  # added to every row this space returns
        self.storage = [t[:, row_offset: row_offset + R] for _, t in storage]
        self.local = AddressSpace(config, self.device, n_logical=self.n_local,
                                  layer_groups=groups,
                                  gpu_storage=[s[:, : G + 1] for s in self.storage])
        self.groups = self.local.groups
        self.layer_to_group = self.local.layer_to_group
        views = [[v[:, row_offset: row_offset + R] for v in peers.open_peers(name)]
                 for name in names]
        # per layer: the P owners' [1, G + 1 + B, rb] slices (a pointer table on CUDA)
        self._peer_layers = []
        for gi, g in enumerate(groups):
            per_layer = []
            for li in range(len(g)):
                pools = [v[li: li + 1] for v in views[gi]]
                # the CUDA kernel reads a device pointer table; the torch reference the views
                per_layer.append(pool_ptr_table(pools, self.device)
                                 if self.device.type == "cuda" and kernels_available()
                                 else pools)
            self._peer_layers.append(per_layer)
        # the buffers' PB-LRU state in one arena, like the groups': one launch starts a round
        self.buffer_arena = PBLRUArena(len(groups), B, config.n_buckets, self.device) \
            if config.policy == "pblru" else None
        self.buffers = [LocalBuffer(n_logical, B, self.device,
                                    self.buffer_arena.policies[i] if self.buffer_arena
                                    else config.policy, config.n_buckets)
                        for i in range(len(groups))]
        self.tp_counters = torch.zeros(len(groups), len(TP_COUNTERS), dtype=torch.int64,
                                       device=self.device)
        self._plans: list[_Plan | None] = [None] * len(groups)
        # The fused path (access_path, ulacache.group): own access and gates in 4 + 4
        # launches around the all-gather; None where the groups run the torch path. (Fused
        # groups imply PB-LRU, which the buffers share through config.policy.)
        self._gates = None
        if self.groups[0].fused is not None:
            from ulacache.kernels.fused_tp import FusedGates

            shared = FusedGates.new_scratch(self.device, config.call_capacity)
            self._gates = [FusedGates(b, G, self.rank, self.P, config.call_capacity,
                                      row_base=self.row_base, shared=shared)
                           for b in self.buffers]
        # a plan covers at most call_capacity entries (a decode step: one plan; larger calls:
        # access() in chunks); fused: this rank's rows of a plan, allocated once
        self.call_capacity = config.call_capacity
        self._own = torch.empty(self.call_capacity, dtype=torch.int32, device=self.device) \
            if self._gates is not None else None
        self.tp_health = CounterMonitor(self.tp_counters, TP_COUNTERS, TP_OVERFLOWS, _TP_WHAT,
                                        derive=buffer_used)
        logger.info("ulacache TP rank %d/%d: %d local positions of %d addresses, %d GPU + %d "
                    "CPU + %d buffer rows per layer", self.rank, self.P, self.n_local,
                    n_logical, G, config.cpu_slots, B)

    # -- lookup ---------------------------------------------------------------------------
    def attn_rows(self, layer: int) -> torch.Tensor:
        """This rank's rows of ``layer``, ``uint8 [G + 1 + B, row_bytes]``: own slots, scratch,
        buffer. The rows :meth:`plan` returns index it after subtracting ``row_base`` (the
        engine's offset, 0 for storage this space allocated)."""
        gi = self._group_of(layer)
        return self.storage[gi][self.groups[gi].layer_index[layer]]

    gpu_rows = attn_rows

    def _count(self, gi: int, **values: torch.Tensor) -> None:
        add_counts(self.tp_counters[gi], TP_COUNTERS, values)

    # -- rounds ---------------------------------------------------------------------------
    def begin_round(self) -> None:
        """Fence the group on the core stream (every rank's reads of the last round come
        before any rank's eviction in this one; on a GPU with a stream-ordered collective this
        costs no host sync), then advance every policy and buffer."""
        with self.stream.scope():
            self.peers.fence()
            advance_policies([b.policy for b in self.buffers], self.buffer_arena,
                             self._gates is not None)
        self.local.begin_round()
        with self.stream.scope():
            self.tp_health.poll()
        self._plans = [None] * len(self.groups)

    # -- what a round can hold (the engine's admission asks these) -------------------------
    def prefill_fits(self, seq_lens: list[int]) -> bool:
        """Whether a prefill batch of requests reaching these lengths (tokens) can be served
        in one round on every rank: each rank's own share (:func:`owned_counts`) fits its GPU
        pool and the rest, its peers' rows, its buffer. The same answer on every rank (lengths
        alone), so no collective."""
        own = owned_counts(seq_lens, self.P)
        return max(own) <= self.gpu_slots and sum(seq_lens) - min(own) <= self.buffer_slots

    def stage_rows(self, seq_lens: list[int]) -> int:
        """Rows a prefill stage over this space needs for a batch of these lengths: every
        token (:meth:`distinct` merges the ranks' own lists, so a stage gathers peers' rows
        too)."""
        return sum(seq_lens)

    def round_fits(self, addrs: torch.Tensor) -> bool:
        """Whether the distinct addresses of ``addrs`` (``-1`` padding) can all be served in
        one fresh round on every rank: each rank's own ones fit its GPU pool, its peers' ones
        its buffer. The same answer on every rank (every rank passes the same ``addrs``), so
        no collective; host-side."""
        flat = self.local.checked_addresses(addrs, "round_fits: addrs").reshape(-1)
        distinct = flat[flat >= 0].unique()
        own = torch.bincount(owner_rank(distinct, self.P), minlength=self.P)
        return int(own.max()) <= self.gpu_slots and \
            distinct.numel() - int(own.min()) <= self.buffer_slots

    def check_step_capacity(self, requests: int, steps: int, top_k: int) -> None:
        """Raise :class:`ConfigError` unless the buffer holds one decode step's selections and
        new tokens (all may be peers' rows) and the own pool its share of them with the margin
        :func:`ulacache.striping.step_share_bound` gives (a step whose selections fall more
        unevenly still would overflow: counted as ``access_overflow``, served as padding)."""
        worst = requests * steps * (top_k + 1)
        what = f"({requests} requests x {steps} tokens) x (top-k {top_k} + 1) = {worst}"
        if self.buffer_slots < worst:
            raise ConfigError(f"the local buffer ({self.buffer_slots} rows) must hold one "
                              f"step's selections of peers' rows: {what}")
        self._check_step_share(requests, steps, top_k)

    # -- placement and release --------------------------------------------------------------
    def check_place(self, addrs: torch.Tensor) -> None:
        """Raise (on every rank) what :meth:`place` would raise, changing nothing."""
        flat, inrange, mine, lpos = self._split(addrs, "place: addrs")

        def check():
            if bool(((flat != -1) & ~inrange).any()):
                raise AddressError(f"place: addrs out of range [0, {self.n_logical})")
            theirs = inrange & ~mine
            for g, b in zip(self.groups, self.buffers):
                g.check_place(lpos)
                need = int(b.first(torch.where(theirs, flat, self.n_logical), theirs).sum())
                if need > int(b.eligible()):
                    raise CapacityExhausted(
                        f"place: {need} new rows of peers need a buffer copy this round but "
                        f"only {int(b.eligible())} of {self.buffer_slots} buffer slots are free "
                        "or evictable; raise buffer_slots or place fewer rows per round")
        self._agree(check)

    def place(self, addrs: torch.Tensor) -> torch.Tensor:
        """New global addresses (distinct, unmapped): the owner gives each a GPU slot in every
        group; every other rank a buffer slot for its own copy of the row (filled by
        :meth:`write`). Returns ``int64 [n]`` local GPU slots of group 0 (``-1``: not this
        rank's or not placed).

        Collective: the owners' outcomes are all-gathered (``int8 [P, groups, n]``) so that a
        copy is made only of a row its owner stored. Validate off, an address the owner refused
        (already live, duplicated, or no room: ``invalid`` / ``place_overflow``) gets no copy
        anywhere, so every rank serves it alike (and a live row's copy is never replaced by an
        unwritten slot)."""
        if self.validate:
            self.check_place(addrs)
        flat, inrange, mine, lpos = self._split(addrs, "place: addrs")
        theirs = inrange & ~mine
        safe = torch.where(theirs, flat, self.n_logical)
        local_safe = torch.where(mine, lpos, self.n_local)
        with self.stream.scope():
            was = [g.loc[local_safe] < 0 for g in self.groups]
            slots = self.local.place(lpos)
            self._count_out_of_range(self.groups, flat, inrange)
            # this rank's verdict on its own addresses, per group: newly stored
            stored = torch.stack([mine & w & (g.loc[local_safe] >= 0)
                                  for g, w in zip(self.groups, was)]).to(torch.int8)
            stored = self.peers.all_gather(stored).amax(0).bool()  # [groups, n]
            for gi, b in enumerate(self.buffers):
                want = b.first(safe, theirs & stored[gi] & (b.lookup(safe) < 0))
                got, evicted = b.claim(safe, want)
                self._count(gi, new_buffered=(got >= 0).sum(), buffer_evictions=evicted,
                            buffer_overflow=(want & (got < 0)).sum())
        return slots

    def release(self, addrs: torch.Tensor) -> None:
        """Drop these addresses: the owner frees their rows, every rank its copies."""
        flat, inrange, mine, lpos = self._split(addrs, "release: addrs")
        if self.validate:
            self._agree(lambda: self._check_release(flat, inrange))
        safe = torch.where(inrange, flat, self.n_logical)
        with self.stream.scope():
            self.local.release(lpos)
            self._count_out_of_range(self.groups, flat, inrange)
            for gi, b in enumerate(self.buffers):
                self._count(gi, buffer_drops=b.drop(safe))

    def _check_release(self, flat: torch.Tensor, inrange: torch.Tensor) -> None:
        if bool(((flat != -1) & ~inrange).any()):
            raise AddressError(f"release: addrs out of range [0, {self.n_logical}) (or negative "
                               "other than the -1 padding)")
        safe = torch.where(inrange, flat, self.n_logical)
        b = self.buffers[0]
        if bool((inrange & ~b.first(safe, inrange)).any()):
            raise AddressError("release: duplicate addrs")

    # -- data (host-checked: tests and tools) -------------------------------------------------
    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of one layer for live addresses (every rank passes the same rows): the owner
        stores its rows, the others refresh the copies they hold. Collective (host-checked:
        every rank agrees on the verdict before any rank writes, so a refused write changes
        no rank's rows or copies)."""
        gi = self._group_of(layer)
        flat, inrange, mine, lpos = self._split(addrs, "write: addrs")
        g = self.local.groups[gi]

        def check():
            if bool(((flat != -1) & ~inrange).any()):
                raise AddressError(f"write: addrs out of range [0, {self.n_logical})")
            g.check_write(layer, lpos, rows)  # shapes, and this rank's addresses live
        self._agree(check)
        with self.stream.scope():
            g.write(layer, lpos, rows)
            b = self.buffers[gi]
            slot = b.lookup(torch.where(inrange & ~mine, flat, self.n_logical))
            dst = torch.where(slot >= 0, self.gpu_slots + 1 + slot, -1)
            keep = dst >= 0
            self.attn_rows(layer)[dst[keep]] = rows.to(self.device)[keep]

    def gather(self, layer: int, addrs: torch.Tensor, dst: torch.Tensor,
               dst_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`ulacache.space.AddressSpace.gather` across the ranks: every rank gets every
        row (its own from its tiers, its peers' through :meth:`read`'s all-gather, which moves
        ``P x n`` rows and host-checks: the reference model's staging, not a production path).
        Collective; ``(from_cpu, gathered)``: this rank's own rows read from its CPU tier, and
        which entries were copied."""
        gi = self._group_of(layer)
        rows = self.read(layer, addrs)
        flat, inrange, mine, lpos = self._split(addrs, "gather: addrs")
        with self.stream.scope():
            # an own live row that is not GPU-resident sits in this rank's CPU tier
            on_cpu = (mine & (self.local.translate(gi, torch.where(mine, lpos, -1)) < 0)).sum()
            keep = inrange & (dst_rows >= 0)
            dst[0, dst_rows[keep].to(dst.device)] = rows[keep].to(dst.device)
        return on_cpu, keep

    # -- the per-step sparse access -------------------------------------------------------
    def plan(self, group: int, addrs: torch.Tensor, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Plan one step's access of a group; ``int32 [bs, k]`` rows of :meth:`attn_rows`
        (``-1``: padding, or validate off: invalid/overflowed). Moves no peer bytes: each layer
        of the group calls :meth:`load`. Collective (one all-gather of ``bs * k * 4`` B).
        """
        g = self.local.group(group)
        b = self.buffers[group]
        if not isinstance(addrs, torch.Tensor) or addrs.dim() != 2:
            raise ShapeError("plan: addrs must be an int tensor [bs, k]")
        if addrs.numel() > self.call_capacity:
            raise ShapeError(f"plan: {addrs.numel()} entries exceed call_capacity "
                             f"({self.call_capacity}); access() runs larger calls in chunks")
        check_out(out, addrs.shape, self.device, "plan")
        if self._gates is not None and not self.validate:  # production: no torch ops here
            return self._plan_fused(group, addrs, out)
        if self.validate:
            self._check_plan(group, addrs)
        if self._gates is not None:
            return self._plan_fused(group, addrs, out)
        flat, inrange, mine, lpos = self._split(addrs, "plan: addrs")
        shape = addrs.shape
        theirs = inrange & ~mine
        safe = torch.where(inrange, flat, self.n_logical)
        with self.stream.scope():
            # 1. own rows (promotions included), 2. exchange: also the data-ready fence
            own = g.access(lpos.view(shape)).reshape(-1)
            self._count_out_of_range([g], flat, inrange)
            # the owner's verdict travels in its rows of the table: a slot, -1 (padding, or
            # it could not make the row resident) or INVALID_ROW (it stores no such address)
            dead = mine & (g.loc[torch.where(mine, lpos, g.n_logical)] < 0)
            verdict = torch.where(dead, INVALID_ROW, own)
            table = self.peers.all_gather(verdict.view(shape)).reshape(self.P, -1)
            owner = torch.where(inrange, owner_rank(flat, self.P), 0)
            owner_slot = table.gather(0, owner.unsqueeze(0)).squeeze(0).to(torch.int64)
            # every rank counts a never-placed address as invalid, as its owner does
            add_counts(g.counters, COUNTERS,
                       {"invalid": (theirs & (owner_slot == INVALID_ROW)).sum()})
            # 3. gates: buffer hit, else a claimed slot and a listed copy
            bslot = b.lookup(safe)
            first = b.first(safe, inrange)
            hit = theirs & (bslot >= 0)
            b.touch(torch.where(first & hit, bslot, -1))
            want = first & theirs & ~hit & (owner_slot >= 0)
            got, evicted = b.claim(safe, want)
            fetch = got >= 0
            bslot = b.lookup(safe)
            row = torch.where(mine, own.to(torch.int64),
                              torch.where(theirs & (bslot >= 0), self.gpu_slots + 1 + bslot, -1))
            row = torch.where(row >= 0, row + self.row_base, -1)
            self._plans[group] = _Plan(*(torch.where(fetch, v, -1).to(torch.int32) for v in
                                         (owner, owner_slot, self.gpu_slots + 1 + got)))
            self._count(group, selected=first.sum(), own_rows=(first & mine).sum(),
                        buffer_hits=(first & hit).sum(), peer_fetches=fetch.sum(),
                        peer_missing=(first & theirs & ~hit & (owner_slot == -1)).sum(),
                        buffer_overflow=(want & ~fetch).sum(), buffer_evictions=evicted)
            rows = row.view(shape)
            if out is None:
                return rows.to(torch.int32)
            out.copy_(rows)
            return out

    def _check_plan(self, group: int, addrs: torch.Tensor) -> None:
        """What :meth:`plan` raises with validate on, agreed by every rank before any rank
        mutates (host-side; collective)."""
        g, b = self.local.group(group), self.buffers[group]
        flat, inrange, mine, lpos = self._split(addrs, "plan: addrs")
        theirs = inrange & ~mine
        safe = torch.where(inrange, flat, self.n_logical)

        def check():
            if bool(((flat != -1) & ~inrange).any()):
                raise AddressError(f"access: addrs out of range [0, {self.n_logical})")
            g.check_access(lpos.view(addrs.shape))
            hit = b.lookup(safe) >= 0
            first = b.first(safe, theirs)
            need = int((first & ~hit).sum())
            moving = first & hit & ~b.policy.pinned(b.lookup(safe))
            have = int(b.eligible()) - int(moving.sum())
            if need > have:
                raise CapacityExhausted(
                    f"access: {need} peers' rows to fetch but only {have} of "
                    f"{self.buffer_slots} buffer slots are free or evictable this round; "
                    "buffer_slots must hold a step's distinct peer rows")
        self._agree(check)

    def _plan_fused(self, group: int, addrs: torch.Tensor, out: torch.Tensor | None
                    ) -> torch.Tensor:
        """:meth:`plan` on the fused path (checks done): own access over the global
        addresses (4 launches), gates' claims (1), the all-gather, the gates (3)."""
        g, gates = self.local.group(group), self._gates[group]
        flat = self.local.checked_addresses(addrs, "plan: addrs").reshape(-1).contiguous()
        own = self._own[:flat.numel()]
        rows = out if out is not None and out.is_contiguous() else \
            torch.empty(addrs.shape, dtype=torch.int32, device=self.device)
        with self.stream.scope():
            g.fused.run(flat, place=False, out=own, stripe=(self.P, self.rank, self.n_logical))
            gates.claim_first(flat)
            table = self.peers.all_gather(own.view(addrs.shape)).reshape(self.P, -1)
            plan = gates.run(flat, table, own, rows.view(-1), self.tp_counters[group],
                             g.counters)
            self._plans[group] = _Plan(*plan)
        if out is not None and rows is not out:
            out.copy_(rows)
            return out
        return rows

    def load(self, layer: int) -> None:
        """Copy this layer's bytes of the group's planned peer rows into the buffer (one
        gather over the peers' pools). Graph-safe; call after :meth:`plan` in the same step."""
        gi = self._group_of(layer)
        plan = self._plans[gi]
        if plan is None:
            raise ShapeError(f"load: layer {layer}'s group has no plan this round (call plan)")
        li = self.groups[gi].layer_index[layer]
        dst = self.storage[gi][li: li + 1]
        with self.stream.scope():
            gather_rows_peers(self._peer_layers[gi][li], plan.src_rank, plan.src_slot, dst,
                              plan.dst_row, src_rows=dst.shape[1])

    def access(self, group: int, addrs: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """:meth:`plan` then :meth:`load` for every layer of the group (prefill, tools and
        tests), in chunks of at most ``call_capacity`` entries when ``addrs`` is larger (one
        round: rows a chunk made resident are pinned while the next chunk runs). Collective:
        every rank passes the same ``addrs``, so every rank runs the same chunks."""
        if addrs.numel() <= self.call_capacity:
            rows = self.plan(group, addrs, out)
            for layer in self.groups[group].layers:
                self.load(layer)
            return rows
        if not isinstance(addrs, torch.Tensor) or addrs.dim() != 2:
            raise ShapeError("access: addrs must be an int tensor [bs, k]")
        check_out(out, addrs.shape, self.device, "access")
        if self.validate:  # the whole call first: a bad entry in a later chunk changes nothing
            self._check_plan(group, addrs)
        return in_pieces(addrs, out, self.call_capacity, self.device,
                         lambda piece, dst: self.access(group, piece, dst))

    def access_distinct(self, group: int, table: torch.Tensor, first: int = 0) -> None:
        """:meth:`access` on the distinct global addresses of a large ``table`` (any shape;
        ``-1`` and addresses below ``first`` are padding): a prefill page table of ``T x
        top-k`` entries becomes at most ``gpu_slots + buffer_slots`` distinct addresses (what
        :meth:`prefill_fits` admits: own rows in the pool, peers' in the buffer), so the
        ranks exchange those, not the table. Collective: every rank passes the same table.
        Beyond the bound rows stay put and are counted as ``access_overflow``, out-of-range
        entries as ``invalid`` (validate off); validate on: the same error on every rank
        before any change. Read the rows with :meth:`translate` (no side effects)."""
        table = self.local.checked_addresses(table, "access_distinct: table")
        bound = self.gpu_slots + self.buffer_slots
        size = min(bound, table.numel())  # the same on every rank: the table's shape
        with self.stream.scope():
            lists, bad = self._own_lists(table, size, first)
            n_distinct = lists[:, size].sum(dtype=torch.int64)
            # the ranks' lists in rank order, compacted (not sorted: the transient stays a few
            # bytes per entry; the access does not need them in order)
            listed = lists[:, :size].reshape(-1)
            at = torch.nonzero_static(listed >= 0, size=size, fill_value=-1).view(-1)
            found = torch.where(at >= 0, listed[at.clamp(min=0)].to(torch.int64), -1)
        if self.validate:
            self._agree(lambda: check_distinct(
                bad, n_distinct, bound, self.n_logical,
                f"{self.gpu_slots} own slots and {self.buffer_slots} buffer rows"))
        else:
            with self.stream.scope():
                count_distinct(self.local.groups[group].counters, bad, n_distinct, size)
        self.access(group, found.view(1, -1))

    def _own_lists(self, table: torch.Tensor, size: int, first: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective. Every rank's own distinct addresses of ``table``, marked in its local
        claim table (no table over the global addresses) and exchanged as ``int32``
        (addresses are below ``MAP_LIMIT``): ``int32 [P, size + 1]``, row ``r`` rank ``r``'s
        ascending list (``-1`` after it) and its count last; and the table's out-of-range
        count (the same on every rank)."""
        mine, n_mine, bad = distinct_addresses(
            self.local.claim_table, table, size, first=first, piece=self.call_capacity,
            stripe=(self.P, self.rank, self.n_logical))
        mine = torch.cat([mine, n_mine.view(1)]).to(torch.int32)
        return self.peers.all_gather(mine).view(self.P, -1), bad

    def distinct(self, table: torch.Tensor, size: int, first: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Collective. :meth:`ulacache.space.AddressSpace.distinct` over the global addresses:
        ``(found`` ascending ``int64 [size]``, ``-1`` after them, ``n_distinct, n_bad)``, the
        same on every rank (the ranks' lists merged by one sort of ``P x size`` entries)."""
        with self.stream.scope():
            lists, bad = self._own_lists(table, size, first)
            merged = lists[:, :size].reshape(-1).to(torch.int64)
            merged = torch.sort(torch.where(merged >= 0, merged, self.n_logical)).values[:size]
            found = torch.where(merged < self.n_logical, merged, -1)
            return found, lists[:, size].sum(dtype=torch.int64), bad

    def translate(self, group: int, addrs: torch.Tensor) -> torch.Tensor:
        """Rows of :meth:`attn_rows` where addresses are readable now without side effects
        (own GPU rows and buffered copies); ``-1`` elsewhere."""
        flat, inrange, mine, lpos = self._split(addrs, "translate: addrs")
        own = self.local.groups[group].translate(lpos).to(torch.int64)
        bslot = self.buffers[group].lookup(torch.where(inrange & ~mine, flat, self.n_logical))
        row = torch.where(mine, own, torch.where(bslot >= 0, self.gpu_slots + 1 + bslot, -1))
        return torch.where(row >= 0, row + self.row_base, -1).to(torch.int32).view(addrs.shape)

    # -- observability and invariants ------------------------------------------------------
    def counters(self) -> list[dict[str, int]]:
        """Per group: the DP core's counters of this rank's shard plus the TP gates."""
        tp = self.tp_counters.tolist()
        return [{**c, **dict(zip(TP_COUNTERS, t))} for c, t in zip(self.local.counters(), tp)]

    def gate_claims_clean(self) -> bool:
        """The fused gates' claim hash is clean (host read; True on the torch path, which has
        none: its buffers dedup a call by sorting it)."""
        return self._gates is None or self._gates[0].claims_clean()

    def check_integrity(self, live: torch.Tensor | None = None) -> None:
        """This rank's DP invariants over its shard, the buffers' invariants, and that every
        buffered copy holds its owner's current bytes (collective). ``live``: ``bool
        [n_logical]`` of allocated global addresses."""
        self.local.check_integrity(None if live is None else self.local_live(live))
        assert self.gate_claims_clean(), "fused gates' claim hash dirty"
        for gi, b in enumerate(self.buffers):
            b.check_integrity(live)
            addrs, slots = b.buffered()
            assert not bool((owner_rank(addrs, self.P) == self.rank).any()), \
                "buffer holds a copy of this rank's own row"
            # every rank reads the union of buffered addresses from their owners
            n = torch.tensor([addrs.numel()], device=self.device)
            width = int(self.peers.all_gather(n).max())
            padded = torch.full((width,), -1, dtype=torch.int64, device=self.device)
            padded[: addrs.numel()] = addrs
            every = self.peers.all_gather(padded).reshape(-1)
            for layer in self.groups[gi].layers:
                truth = self.read(layer, every)  # collective: same order on every rank
                mine = truth[self.rank * width: self.rank * width + addrs.numel()]
                held = self.attn_rows(layer)[self.gpu_slots + 1 + slots]
                assert torch.equal(held, mine), f"stale buffer copy in layer {layer}"
