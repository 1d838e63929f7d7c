"""Residency of one selection group: mapping table, reverse maps, pools and the policy.

The mapping table is the single source of truth. One ``int32`` per logical address (4 B per
address per group: the table spans every token of every request; addresses and slots are
refused at 2**31 - 1)::

    loc[t] == -1                     unmapped (allocated but not placed yet, or never)
    loc[t] in [0, gpu_slots)         GPU slot loc[t]
    loc[t] in [gpu_slots, G + C)     CPU slot loc[t] - gpu_slots
    loc[n_logical]                   scratch entry for masked writes (always -1)

The reverse map ``gpu_owner int32 [G + 1]`` gives each GPU slot's address or -1 (a victim's owner is
read on every eviction). A CPU slot has no reverse map on the device: nothing on the decode
path reads one, so :meth:`SelectionGroup.check_integrity` derives it from the mapping and the
shadows (8 B per CPU slot per group saved: the CPU tier is ``cpu_ratio`` times the GPU pool).

Every data movement follows the same order (design invariant 3): copy the bytes, then update
the mapping. One stated exception: :meth:`SelectionGroup.access_deferred` maps before layers
``1..L-1``'s bytes move (:meth:`SelectionGroup.replay_layer`); a reader of such a layer waits
for its replay (``ulacache.prefetch.PrefetchEngine.before_load``). All of it is issued on
one stream (:mod:`ulacache.streams`), so a later reuse of a slot is ordered after the copies
out of it (invariant 8).

Bad input. Every call checks tensor types, shapes and devices (metadata only, no sync) before
it mutates anything. With ``validate`` on (and outside graph capture) the values are checked
too, on the host, and a bad one raises a typed error with nothing changed. With ``validate``
off (production: no host sync) a bad entry is *masked*: an out-of-range or non-live selection
reads as padding, a duplicate or already-mapped address in ``place``/``release`` is skipped;
each is counted in ``counters["invalid"]``. Capacity overflow (a selected row or a new row that
finds no GPU slot, or no CPU slot for the row it would displace) is masked the same way and
counted in ``access_overflow`` / ``place_overflow``: no invariant is ever broken, and the
address space reports it (:mod:`ulacache.health`). See docs/architecture.md, "Overflow".
"""

from __future__ import annotations

import torch

from ulacache.kernels.dispatch import gather_rows, swap_rows

from .config import CALL_FLOOR
from .errors import AddressError, CapacityExhausted, ConfigError, ShapeError
from .pblru import DEFAULT_BUCKETS, PBLRU, PBLRUArena, ReplacementPolicy, make_policy
from .pools import TierPools, allocate, resolve_device
from .state import GroupTables
from .streams import capturing

COUNTERS = ("accesses", "gpu_hits", "promotions", "writebacks", "placed", "spills",
            "released_gpu", "released_cpu", "access_overflow", "place_overflow", "invalid",
            "remaps", "shadowed", "reclaims", "shadows_released", "rewrites", "prefetches")
"""Slots of :attr:`SelectionGroup.counters` (device ``int64``, read outside the decode path):

- ``accesses``: distinct selected rows per step; ``gpu_hits``: those already on the GPU;
- ``promotions``: rows copied CPU -> GPU; ``writebacks``: victims copied GPU -> CPU by them;
- ``placed``: new rows given a GPU slot; ``spills``: victims copied GPU -> CPU to make room;
- ``released_gpu`` / ``released_cpu``: rows dropped by ``release`` from each tier;
- ``access_overflow``: selected rows left on the CPU (served as padding: no GPU slot);
- ``place_overflow``: new rows not stored (no GPU slot, or no CPU slot for the victim);
- ``invalid``: masked bad entries (validate off): out-of-range or non-live selections,
  duplicate or already-mapped addresses in ``place``, duplicates or out-of-range in
  ``release``;
- ``remaps``: victims (of a promotion or a placement) whose live shadow became their CPU copy:
  evicted without a copy;
- ``shadowed``: promotions that kept the promoted row's CPU copy as its shadow;
- ``reclaims``: shadows given back to the CPU free stack to make room for spills;
- ``shadows_released``: shadows freed with their row by ``release``;
- ``rewrites``: write-backs and spills of rows that had been in the CPU tier before (the
  eviction-path D2H that shadows remove; ``writebacks + spills - rewrites`` are rows born on
  the GPU reaching the CPU for the first time);
- ``prefetches``: rows copied CPU -> GPU by :meth:`SelectionGroup.prefetch`, ahead of the
  access (off the critical path; ``promotions`` are the access's own, on it). Their victims
  count in ``writebacks`` / ``remaps`` / ``rewrites``, their shadows in ``shadowed``.
"""
OVERFLOWS = ("access_overflow", "place_overflow", "invalid")


def occupancy(c: dict[str, int]) -> tuple[int, int]:
    """(GPU, CPU) slots holding a row's primary copy, derived from a group's counters: a
    placement or promotion fills a GPU slot; its victim, if any, leaves the GPU for the CPU
    (a spill, a write-back, or a remap to its shadow); a promotion or prefetch leaves the CPU;
    a release frees its tier. Shadows are not occupancy (:func:`live_shadows`). So the
    occupancy needs no device work of its own (``check_integrity`` asserts the identity)."""
    evicted = c["spills"] + c["writebacks"] + c["remaps"]
    promoted = c["promotions"] + c["prefetches"]
    gpu = c["placed"] + promoted - evicted - c["released_gpu"]
    return gpu, evicted - promoted - c["released_cpu"]


def live_shadows(c: dict[str, int]) -> int:
    """CPU slots holding a shadow (a GPU-resident row's still-valid CPU copy), from the
    counters: kept at promotion, consumed by a remap, reclaimed, or released with the row."""
    return c["shadowed"] - c["remaps"] - c["reclaims"] - c["shadows_released"]

NO_CLAIM = torch.iinfo(torch.int32).max
"""A clean claim-table entry. Claim tables are ``int32`` (4 B per address: they span every
logical token); the positions they hold are entries of one call, fewer than ``MAP_LIMIT``."""
CLAIM_DTYPE = torch.int32
MAP_DTYPE = torch.int32
"""Element type of the mapping ``loc`` and the GPU reverse map ``gpu_owner`` (4 B an entry:
the mapping spans every logical token, per group). Readers widen to ``int64`` before
arithmetic; writers narrow."""
MAP_LIMIT = 2**31 - 1
"""``n_logical + 1`` and ``gpu_slots + cpu_slots`` must not exceed this (int32 entries)."""

BORN = -1
"""``shadow[slot]`` of a free GPU slot, or of a row that has never been in the CPU tier."""
WAS_ON_CPU = -2
"""``shadow[slot]`` of a row that has been in the CPU tier but has no shadow now (its eviction
writes it back: an eviction-path D2H copy, counted in ``rewrites``)."""
RECLAIM_RECENT_ROUNDS = 2
"""The reclaim gives back first the shadows of rows touched in the last this many rounds (the
current one included): the rows least likely to be evicted soon."""

ACCESS_PATHS = ("auto", "torch", "fused")
"""How ``access`` and ``place`` run: ``"torch"``, the reference (fixed-shape tensor ops, about
300 per PB-LRU group-step); ``"fused"``, four Triton launches with identical results
(:mod:`ulacache.kernels.fused_access`; PB-LRU only; on CPU tensors through Triton's
interpreter, for tests); ``"auto"``, fused on CUDA when Triton is installed and the policy is
PB-LRU, else torch."""


def fused_kernels(path: str, device: torch.device, policy: ReplacementPolicy):
    """The fused-kernel module if ``path`` selects the fused path here, else ``None``."""
    if path not in ACCESS_PATHS:
        raise ConfigError(f"access_path must be one of {ACCESS_PATHS}, got {path!r}")
    if path == "torch" or (path == "auto" and device.type not in ("cuda", "meta")):
        return None  # meta: ulacache rehearse stands in for a CUDA device
    from ulacache.kernels import fused_access

    why = None
    if not fused_access.available():
        why = "Triton is not installed (pip install 'ulacache[cuda]')"
    elif not isinstance(policy, PBLRU):
        why = f"the fused kernels implement PB-LRU, not {type(policy).__name__}"
    elif device.type == "cpu" and not fused_access.INTERPRETED:
        why = "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before importing it)"
    if why and path == "fused":
        raise ConfigError(f"access_path 'fused': {why}")
    return None if why else fused_access


def advance_policies(policies: list[ReplacementPolicy], arena: PBLRUArena | None,
                     fused: bool) -> None:
    """Start a round in every policy: one launch for a PB-LRU arena on the fused path
    (:func:`ulacache.kernels.fused_policy.advance`), else each policy's own ``advance`` (the
    reference; about 70 small ops per PB-LRU policy)."""
    if fused and arena is not None:
        from ulacache.kernels import fused_policy

        fused_policy.advance(arena)
        return
    for p in policies:
        p.advance()


def add_counts(row: torch.Tensor, names: tuple[str, ...], values: dict[str, torch.Tensor]
               ) -> None:
    """Add 0-dim counts to the named columns of an ``int64 [len(names)]`` counter row: one
    stack and one add however many, no sync."""
    zero = torch.zeros((), dtype=torch.int64, device=row.device)
    row.add_(torch.stack([values.get(n, zero) for n in names]))


def new_claim_table(n_logical: int, device: torch.device) -> torch.Tensor:
    """The dedup scratch of :func:`first_occurrence` over ``n_logical`` addresses (+ scratch):
    ``int32 [n_logical + 1]``, every entry :data:`NO_CLAIM`."""
    return allocate((n_logical + 1,), CLAIM_DTYPE, device, "the claim table", fill=NO_CLAIM)


def check_out(out: torch.Tensor | None, shape: torch.Size, device: torch.device,
              what: str) -> None:
    """Refuse (:class:`ShapeError`, metadata only: no sync) a preallocated result tensor that
    is not ``int32 [*shape]`` on ``device``; ``None`` passes."""
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.int32
                            or out.shape != shape or out.device != device):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" \
            if isinstance(out, torch.Tensor) else type(out).__name__
        raise ShapeError(f"{what}: out must be int32 {tuple(shape)} on {device}, got {got}")


def in_pieces(addrs: torch.Tensor, out: torch.Tensor | None, size: int, device: torch.device,
              call) -> torch.Tensor:
    """``call(piece [1, m], out_piece [1, m])`` over ``addrs`` in pieces of at most ``size``
    entries, writing ``int32`` rows of ``addrs``'s shape into ``out`` (or a new tensor)."""
    rows = out if out is not None and out.is_contiguous() else \
        torch.empty(addrs.shape, dtype=torch.int32, device=device)
    for piece, dst in zip(addrs.reshape(-1).split(size), rows.view(-1).split(size)):
        call(piece.view(1, -1), dst.view(1, -1))
    if out is not None and rows is not out:
        out.copy_(rows)
        return out
    return rows


def distinct_addresses(claim: torch.Tensor, table: torch.Tensor, size: int, *, first: int = 0,
                       piece: int = 1 << 20, stripe: tuple[int, int, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct addresses of a large ``table`` (any shape, ``int32``/``int64``; a prefill
    page table of ``T x top-k`` entries), with fixed shapes and no sync (marked in ``claim``,
    gathered by ``torch.nonzero_static``): ``(found, n_distinct, n_bad)``.

    - ``found``: ``int64 [size]``, the distinct addresses in ascending order, ``-1`` after
      them; beyond ``size`` distinct addresses the largest are dropped (``n_distinct`` tells);
    - ``n_distinct``, ``n_bad``: ``int64`` 0-dim counts of distinct in-range addresses and of
      out-of-range entries (neither ``-1`` nor in ``[0, n)``; they are ignored).

    ``claim``: a clean claim table ``int32 [n + 1]`` (:func:`new_claim_table`), clean again
    on return. Entries in ``[0, first)`` are padding too (an engine's reserved sink page).
    The table is read in pieces of ``piece`` entries, so temporaries stay ``O(piece + n)``.

    ``stripe = (P, rank, n_global)``: a TP rank's share. Addresses are global (``n =
    n_global``); only those ``a`` with ``a % P == rank`` are marked, at ``a // P`` (``claim``
    is the rank's table over its local positions), so ``found`` and ``n_distinct`` cover the
    rank's own addresses; ``n_bad`` counts the whole table.
    """
    n_claim = claim.numel() - 1
    P, rank, n = (1, 0, n_claim) if stripe is None else stripe
    bad = torch.zeros((), dtype=torch.int64, device=claim.device)
    for p in table.reshape(-1).split(piece):
        p = p.to(torch.int64)
        inrange = (p >= 0) & (p < n)
        bad += ((p != -1) & ~inrange).sum()
        mark = inrange & (p >= first) & (p % P == rank)
        claim.index_fill_(0, torch.where(mark, p // P, n_claim), 0)
    marked = claim[:n_claim] == 0
    n_distinct = marked.sum()
    found = torch.nonzero_static(marked, size=size, fill_value=-1).view(-1)
    if stripe is not None:
        found = torch.where(found >= 0, found * P + rank, -1)
    claim.fill_(NO_CLAIM)
    return found, n_distinct, bad


def check_distinct(bad: torch.Tensor, n_distinct: torch.Tensor, bound: int, n_logical: int,
                   room: str) -> None:
    """Raise what an access on :func:`distinct_addresses`' result refuses with validate on
    (host reads): out-of-range entries (:class:`AddressError`), more distinct rows than
    ``bound`` (:class:`CapacityExhausted`; ``room`` says where they would have to fit)."""
    if int(bad):
        raise AddressError(f"access: {int(bad)} table entries out of range [0, {n_logical})")
    if int(n_distinct) > bound:
        raise CapacityExhausted(f"access: {int(n_distinct)} distinct rows cannot be read at "
                                f"once through {room}")


def count_distinct(counters: torch.Tensor, bad: torch.Tensor, n_distinct: torch.Tensor,
                   size: int) -> None:
    """Validate off: the entries :func:`distinct_addresses` ignored as ``invalid``, the
    distinct rows beyond its ``size`` as ``access_overflow`` (no sync)."""
    add_counts(counters, COUNTERS, {"invalid": bad,
                                    "access_overflow": (n_distinct - size).clamp_(min=0)})


def first_occurrence(claim: torch.Tensor, safe: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``keep`` (``bool [n]``) restricted to the first occurrence of each index of ``safe``
    (``int64 [n]``, in range of ``claim``; ``n < 2**31 - 1``). ``claim`` is an ``int32``
    table all ``NO_CLAIM`` before and after the call (scatter the positions with ``amin``,
    compare, reset): O(n), fixed shapes, no sync."""
    pos = torch.arange(safe.numel(), dtype=claim.dtype, device=safe.device)
    claim.scatter_reduce_(0, safe, torch.where(keep, pos, NO_CLAIM), "amin")
    first = keep & (claim[safe] == pos)
    claim.index_fill_(0, safe, NO_CLAIM)
    return first


def move_rows(gpu: torch.Tensor, cpu: torch.Tensor, victim: torch.Tensor, cslot: torch.Tensor,
              dst: torch.Tensor) -> None:
    """The bytes of promotions (the torch reference's data step), on pools ``uint8 [L, S + 1,
    row_bytes]`` (every layer given, e.g. one layer's ``[l:l + 1]`` view). Per entry, ``int64
    [n]``: ``victim`` the GPU slot the promoted row goes to (``-1``: no move); ``cslot`` the CPU
    slot it comes from; ``dst`` the CPU slot the victim's row is written back to (``-1``: none,
    the slot was free or the victim's shadow became its copy), ``dst == cslot`` a swap. Both
    reads of a pair happen before either write. The same record drives a deferred access's
    replay (:meth:`SelectionGroup.replay_layer`)."""
    swap = (dst >= 0) & (dst == cslot)
    into_free = (dst >= 0) & ~swap
    gather_rows(gpu, torch.where(into_free, victim, -1), cpu, torch.where(into_free, dst, -1))
    swap_rows(gpu, torch.where(swap, victim, -1), cpu, torch.where(swap, cslot, -1))
    fill = (victim >= 0) & ~swap
    gather_rows(cpu, torch.where(fill, cslot, -1), gpu, torch.where(fill, victim, -1))


class SelectionGroup:
    """Pools, mapping and replacement policy of the layers that share one top-k selection.

    Parameters
    ----------
    layers : global layer ids of the group (their rows are stored in this order); may be
        empty for a residency-only group (policy simulations: no bytes move).
    n_logical : size of the logical address space (addresses ``[0, n_logical)``).
    gpu_slots, cpu_slots, row_bytes : pool geometry.
    policy : a name registered in :data:`ulacache.pblru.POLICIES`, or a policy instance over
        ``gpu_slots`` slots on ``device`` (policy studies).
    validate : host-side value checks (they synchronise the device) outside graph capture.
    gpu_storage : optional engine-owned ``uint8 [L, gpu_slots + 1, row_bytes]`` GPU pool (e.g.
        a view of SGLang's ``kv_buffer`` rows); allocated here when absent.
    counters : optional ``int64 [len(COUNTERS)]`` view to count into (the address space keeps
        every group's counters in one table, read off the device in one copy).
    claim : optional shared dedup scratch, ``int64 [n_logical + 1]`` from
        :func:`new_claim_table` (clean between calls, so every group of an address space can
        use one: 8 B per logical address instead of 8 B per address per group).
    access_path : one of :data:`ACCESS_PATHS`.
    max_call : entries one access / place / release handles at once (default ``gpu_slots +``
        :data:`~ulacache.config.CALL_FLOOR`); larger calls run in chunks of this size in the
        same round, with validate's checks made on the whole call first. The fused path's
        scratch is allocated for it once, at construction.
    scratch : optional shared fused-path scratch (``kernels.fused_access.Scratch`` of
        ``SCRATCH_DTYPES``, >= ``max_call`` entries): the groups of an address space run one
        at a time on one stream, so one serves them all.
    shadows : evictions without write-back. A row promoted from the CPU tier keeps its CPU
        copy as a *shadow* (``shadow[gpu_slot]``); evicting a row whose shadow is live remaps
        it to the shadow and copies nothing. Shadows are not occupancy: they live in CPU slots
        no primary holds, and ``place`` gives them back (``reclaims``) before it could run
        short of free CPU slots. Off: every eviction of a row writes it back (exclusive tiers
        as in the paper).

    CPU slot states (``check_integrity``): free (on the free stack), primary (``loc[owner] ==
    G + slot``) or shadow (``shadow[loc[owner]] == slot``, ``owner`` GPU-resident).
    """

    def __init__(self, layers: list[int], n_logical: int, gpu_slots: int, cpu_slots: int,
                 row_bytes: int, device: torch.device | str = "cpu",
                 policy: str | ReplacementPolicy = "pblru",
                 n_buckets: int = DEFAULT_BUCKETS, validate: bool = True,
                 gpu_storage: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                 claim: torch.Tensor | None = None, access_path: str = "auto",
                 max_call: int | None = None, scratch=None, row_base: int = 0,
                 shadows: bool = True):
        self.device = resolve_device(device)
        self.row_base = int(row_base)  # added to every row access / translate return
        self.max_call = int(max_call) if max_call is not None else gpu_slots + CALL_FLOOR
        if self.max_call < 1:
            raise ShapeError(f"max_call must be >= 1, got {max_call}")
        if n_logical + 1 > MAP_LIMIT or gpu_slots + cpu_slots > MAP_LIMIT:
            raise ShapeError(f"{n_logical} addresses and {gpu_slots} + {cpu_slots} slots per "
                             f"group: the int32 mapping holds at most {MAP_LIMIT} of each")
        self.layers = list(layers)
        self.layer_index = {layer: i for i, layer in enumerate(self.layers)}
        self.n_logical, self.gpu_slots, self.cpu_slots = n_logical, gpu_slots, cpu_slots
        self.validate = validate
        self.pools = TierPools(len(layers), gpu_slots, cpu_slots, row_bytes, self.device,
                               gpu_storage)
        if isinstance(policy, ReplacementPolicy):
            if policy.n_slots != gpu_slots or policy.device != self.device:
                raise ShapeError(f"policy covers {policy.n_slots} slots on {policy.device}; "
                                 f"the group has {gpu_slots} on {self.device}")
            self.policy = policy
        else:
            self.policy = make_policy(policy, gpu_slots, n_buckets, self.device)
        table = (n_logical + 1,)
        self.loc = allocate(table, MAP_DTYPE, self.device, "the mapping table", fill=-1)
        self.gpu_owner = torch.full((gpu_slots + 1,), -1, dtype=MAP_DTYPE, device=self.device)
        # per GPU slot: the CPU slot of its row's shadow, or BORN / WAS_ON_CPU (int32: 4 B)
        self.shadows = bool(shadows)
        self.shadow = torch.full((gpu_slots + 1,), BORN, dtype=torch.int32, device=self.device)
        self.reclaim_cursor = torch.zeros((), dtype=torch.int64, device=self.device)
        # Dedup of one call's addresses: claim[t] = first position naming t (reset after use).
        # Scratch between calls, so the groups of an address space share one table.
        if claim is None:
            claim = new_claim_table(n_logical, self.device)
        elif claim.shape != table or claim.dtype != CLAIM_DTYPE or claim.device != self.device:
            raise ShapeError(f"claim must be int32 {table} on {self.device}")
        self.claim_table = claim
        if counters is None:
            counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=self.device)
        elif counters.shape != (len(COUNTERS),) or counters.dtype != torch.int64 or \
                counters.device != self.device:
            raise ShapeError(f"counters must be int64 [{len(COUNTERS)}] on {self.device}")
        self.counters = counters
        kernels = fused_kernels(access_path, self.device, self.policy)
        if scratch is not None and scratch.cap < self.max_call:
            raise ShapeError(f"the shared scratch holds {scratch.cap} entries, max_call is "
                             f"{self.max_call}")
        # the fused engine's view of this group: plain tensors, never rebound
        self.tables = GroupTables(
            loc=self.loc, claim=self.claim_table, gpu_owner=self.gpu_owner,
            shadow=self.shadow, shadows=self.shadows,
            reclaim_cursor=self.reclaim_cursor,
            counters=self.counters, gpu=self.pools.gpu,
            cpu=self.pools.cpu, cpu_free=self.pools.cpu_free, cpu_top=self.pools.cpu_top,
            policy=self.policy, n_logical=n_logical, gpu_slots=gpu_slots,
            cpu_slots=cpu_slots, max_call=self.max_call, device=self.device)
        self.fused = None if kernels is None else kernels.FusedAccess(self.tables, scratch)
        self.fused_release = None
        if kernels is not None:
            from ulacache.kernels.fused_release import FusedRelease

            self.fused_release = FusedRelease(self.tables, self.fused.shared_scratch)
        # torch or fused, chosen once: every per-call entry point is bound here, not tested
        # per call
        fused = self.fused is not None
        self._place_one = self._place_fused if fused else self._place_torch
        self._access_one = self._access_fused if fused else self._access_torch
        self._translate = self._translate_fused if fused else self._translate_torch
        self._release_one = self._release_fused if fused else self._release_torch
        self._prefetch_one = self._prefetch_fused if fused else self._prefetch_torch
        self._reclaim = self._reclaim_fused if fused else self._reclaim_torch
        # prefetch scratch: the group's own until side tables are given (a prefetch on its
        # own stream must not share dedup scratch with accesses of other groups)
        self.prefetch_claim, self.fused_prefetch = self.claim_table, self.fused
        # deferred accesses (access_deferred): the move list, shared by an address space's
        # groups (given by use_move_list), and the entries of the last deferred call
        self.moves: torch.Tensor | None = None
        self.deferred_entries = 0
        self._replay = self._replay_fused if fused else self._replay_torch

    def use_prefetch_tables(self, claim: torch.Tensor, scratch=None) -> None:
        """Prefetch with its own dedup table (``int32 [n_logical + 1]``, from
        :func:`new_claim_table`) and fused scratch, so a prefetch on a side stream can run
        while another group's access uses the shared ones (one set serves every group's
        prefetch: prefetches run one at a time on the prefetch stream)."""
        if claim.shape != self.claim_table.shape or claim.dtype != CLAIM_DTYPE or \
                claim.device != self.device:
            raise ShapeError(f"prefetch claim must be int32 {tuple(self.claim_table.shape)} on "
                             f"{self.device}")
        self.prefetch_claim = claim
        if self.fused is not None:
            from dataclasses import replace

            from ulacache.kernels import fused_access

            self.fused_prefetch = fused_access.FusedAccess(replace(self.tables, claim=claim),
                                                           scratch)

    def use_move_list(self, moves: torch.Tensor) -> None:
        """Record deferred accesses' moves in ``moves int32 [3, >= max_call]`` (victim GPU
        slot, source CPU slot, write-back CPU slot per entry; one list serves every group of an
        address space: a group's replays finish before the next deferred access, which
        :class:`ulacache.prefetch.PrefetchEngine` orders)."""
        if len(self.layers) < 2:
            raise ShapeError(f"a deferred access needs a group of >= 2 layers, not {self.layers}")
        if moves.dim() != 2 or moves.shape[0] != 3 or moves.shape[1] < self.max_call or \
                moves.dtype != torch.int32 or moves.device != self.device:
            raise ShapeError(f"the move list must be int32 [3, >= {self.max_call}] on "
                             f"{self.device}")
        self.moves = moves

    # -- helpers --------------------------------------------------------------------------
    def _count(self, **values: torch.Tensor) -> None:
        add_counts(self.counters, COUNTERS, values)

    def counter_values(self) -> dict[str, int]:
        return dict(zip(COUNTERS, self.counters.tolist()))

    def _checking(self) -> bool:
        return self.validate and not capturing(self.device)

    def _index_tensor(self, t: torch.Tensor, name: str, dims: int | None = None) -> torch.Tensor:
        """``t`` as flat ``int64`` after the metadata checks every call makes (no sync)."""
        self._index_meta(t, name, dims)
        return t.reshape(-1).to(torch.int64)

    def _index_meta(self, t: torch.Tensor, name: str, dims: int | None = None) -> None:
        """The metadata checks every call makes (type, dtype, device, rank; no sync)."""
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64) or t.device != self.device:
            raise ShapeError(f"{name} must be int32/int64 on {self.device}, got {t.dtype} on "
                             f"{t.device}")
        if dims is not None and t.dim() != dims:
            raise ShapeError(f"{name} must have {dims} dimension(s), got {tuple(t.shape)}")

    def _range(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(in-range mask, addresses with the rest redirected to the scratch entry)."""
        inrange = (flat >= 0) & (flat < self.n_logical)
        return inrange, torch.where(inrange, flat, self.n_logical)

    def _first(self, safe: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` restricted to the first occurrence of each address (claim table)."""
        return first_occurrence(self.claim_table, safe, keep)

    def _shadow_of(self, slots: torch.Tensor) -> torch.Tensor:
        """``int64`` shadow entries of GPU ``slots`` (``gpu_slots``: the scratch entry)."""
        return self.shadow[slots].to(torch.int64)

    # The int32 tables (MAP_DTYPE) are read widened and written narrowed in one place each.
    def _slots_of(self, addrs: torch.Tensor) -> torch.Tensor:
        """``int64`` mapping entries of ``addrs`` (``n_logical``: the scratch entry)."""
        return self.loc[addrs].long()

    def _map(self, addrs: torch.Tensor, slots: torch.Tensor) -> None:
        """``loc[addrs] = slots`` (masked writes name the scratch entry ``n_logical``)."""
        self.loc.index_put_((addrs,), slots.to(MAP_DTYPE))

    def _owners_of(self, slots: torch.Tensor) -> torch.Tensor:
        """``int64`` owners of GPU ``slots`` (``gpu_slots``: the scratch entry)."""
        return self.gpu_owner[slots].long()

    def _own(self, slots: torch.Tensor, addrs: torch.Tensor) -> None:
        """``gpu_owner[slots] = addrs`` (masked writes name the scratch entry ``gpu_slots``)."""
        self.gpu_owner.index_put_((slots,), addrs.to(MAP_DTYPE))

    def _li(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in self.layer_index:
            raise ShapeError(f"layer {layer!r} is not in this group {self.layers}")
        return self.layer_index[layer]

    # -- placement of new rows ------------------------------------------------------------
    def place(self, addrs: torch.Tensor) -> torch.Tensor:
        """Give each new address a GPU slot; returns ``int64 [n]`` slots (``-1``: not placed).

        ``addrs``: ``int [n]`` distinct unmapped addresses, ``-1`` skipped. Slots come from the
        policy's victim order: free slots first; an occupied victim is first spilled to a free
        CPU slot (data, then mapping). Placed slots join the current round, so nothing read or
        written this round is evicted by a later placement in it. Validate off: duplicates and
        already-mapped addresses are skipped (``invalid``); a row with no slot, or whose victim
        finds no CPU slot, is not stored (``place_overflow``).
        """
        if addrs.numel() > self.max_call:
            self._index_meta(addrs, "place: addrs")
            if self._checking():
                self.check_place(addrs)
            return torch.cat([self._place_one(c) for c in self._chunks(addrs)])
        return self._place_one(addrs)

    def _chunks(self, addrs: torch.Tensor) -> list[torch.Tensor]:
        """``addrs`` flattened into pieces of at most :attr:`max_call` entries."""
        return list(addrs.reshape(-1).split(self.max_call))

    def _place_fused(self, addrs: torch.Tensor) -> torch.Tensor:
        """:meth:`place` of at most :attr:`max_call` entries, fused (four launches)."""
        self._index_meta(addrs, "place: addrs")
        if self._checking():
            self.check_place(addrs)
        slot = torch.empty(addrs.numel(), dtype=torch.int64, device=self.device)
        # its K1 reclaims shadows first, as _place_torch does
        self.fused.run(addrs.reshape(-1).contiguous(), place=True, victim_out=slot)
        return slot

    def _place_torch(self, addrs: torch.Tensor) -> torch.Tensor:
        """:meth:`place` of at most :attr:`max_call` entries, the torch reference."""
        flat, fresh, bad = self._place_plan(addrs)
        if self._checking():
            self._validate_place(flat, fresh, bad)
        G = self.gpu_slots
        if self.shadows:  # victims beyond the free GPU slots may pop: that much stack first
            self._reclaim_torch(flat.numel() - (G - self.policy.used_count()))
        rank = torch.cumsum(fresh, 0) - 1
        cand = self.policy.victims(flat.numel())
        slot = torch.where(fresh, cand[rank.clamp(min=0)], -1)
        vs = torch.where(slot >= 0, slot, G)
        owner = self._owners_of(vs)
        had = self._shadow_of(vs)
        occupied = (slot >= 0) & (owner >= 0)
        remap = occupied & (had >= 0)  # evicted onto its shadow: no copy, no free slot used
        took, popped = self._pop_in_victim_order(occupied)
        spill = took & ~remap
        cslot = torch.where(spill, popped, -1)
        ok = (slot >= 0) & (~occupied | remap | spill)  # victims are free first
        # data first: the spilled victims' rows move GPU -> CPU ...
        gather_rows(self.pools.gpu, torch.where(spill, slot, -1), self.pools.cpu, cslot)
        # ... then the mapping
        evicted = spill | remap
        self._map(torch.where(evicted, owner, self.n_logical),
                  torch.where(spill, G + cslot, torch.where(remap, G + had, -1)))
        self._settle_stack(took, took & remap, popped)
        slot = torch.where(ok, slot, -1)
        self._own(torch.where(ok, slot, G), torch.where(ok, flat, -1))
        self.shadow.index_put_((torch.where(ok, slot, G),),
                               torch.full_like(slot, BORN, dtype=torch.int32))
        self._map(torch.where(ok, flat, self.n_logical), slot)
        self.policy.assign(slot)
        self._count(placed=ok.sum(), spills=spill.sum(), place_overflow=(fresh & ~ok).sum(),
                    invalid=bad.sum(), remaps=remap.sum(),
                    rewrites=(spill & (had == WAS_ON_CPU)).sum())
        return slot

    def _pop_in_victim_order(self, occupied: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every occupied victim (``bool [n]``, entries in victim order) takes the next CPU
        free-stack position, from the top down: ``(took, popped slot or -1)``. The pointer
        moves in :meth:`_settle_stack`. Victims remapped to their shadow take one too and hand
        it back there: the kernels fix a victim's position before they read its shadow, and
        the reference does the same so that both leave the same stack."""
        pos = self.pools.cpu_top - torch.cumsum(occupied, 0)
        took = occupied & (pos >= 0)
        return took, torch.where(took, self.pools.cpu_free[pos.clamp(min=0)].to(torch.int64), -1)

    def _settle_stack(self, took: torch.Tensor, back: torch.Tensor, popped: torch.Tensor
                      ) -> None:
        """After :meth:`_pop_in_victim_order`: positions ``[top - taken, top)`` were taken; the
        slots of ``back`` entries return to the bottom of that range in entry order and the
        pointer drops by what was kept."""
        C = self.cpu_slots
        taken = took.sum()
        dest = torch.where(back, self.pools.cpu_top - taken + torch.cumsum(back, 0) - 1, C)
        self.pools.cpu_free.index_put_((dest,), torch.where(back, popped, C).to(torch.int32))
        self.pools.cpu_top.sub_(taken - back.sum())

    def reclaim(self, need: int) -> None:
        """Give shadows back to the CPU free stack until it holds ``need`` slots (or no shadow
        is left). :meth:`place` does it first for what it may pop: its entries beyond the free
        GPU slots.

        Order: first the shadows of rows touched in this round or the last one
        (:data:`RECLAIM_RECENT_ROUNDS`; the rows furthest from eviction), then the others; each
        set in GPU-slot order from a rotating cursor (``reclaim_cursor``, moved just past the
        last *older* shadow taken). Never oldest-first: under LRU the oldest shadows are those
        of the next victims, the ones worth keeping (on the bundled trace's replay at exact CPU
        sizing this order cut eviction D2H / H2D from 0.146 to 0.124). No sync; the fused path
        is one program that scans only until it has enough (one block when none is needed),
        inside the placement's first launch. Never inside an access, so never a shadow a copy
        of the same launch reads."""
        if self.shadows:
            self._reclaim(int(need))

    def _reclaim_fused(self, need: int) -> None:
        self.fused.reclaim(need)

    def _reclaim_torch(self, need: int | torch.Tensor) -> None:
        G = self.gpu_slots
        scan = torch.arange(G, device=self.device)
        cursor_order = (scan + self.reclaim_cursor) % G
        older = self.policy.round_age()[cursor_order] >= RECLAIM_RECENT_ROUNDS
        # recent shadows first, each set in cursor order (a stable sort: fixed shape, no sync)
        by_age = torch.sort(older.to(torch.int8), stable=True).indices
        order, older = cursor_order[by_age], older[by_age]
        had = self._shadow_of(order)
        live = had >= 0
        short = (need - self.pools.cpu_top).clamp(min=0)
        take = live & (torch.cumsum(live, 0) <= short)
        self.shadow.index_put_((torch.where(take, order, G),),
                               torch.full_like(order, WAS_ON_CPU, dtype=torch.int32))
        self.pools.push_cpu(torch.where(take, had, -1))
        last = torch.where(take & older, scan[by_age], -1).max()
        self.reclaim_cursor.copy_(torch.where(last >= 0, (self.reclaim_cursor + last + 1) % G,
                                              self.reclaim_cursor))
        self._count(reclaims=take.sum())

    def _place_plan(self, addrs: torch.Tensor):
        """(flat addresses, first occurrences of unmapped in-range ones, invalid entries)."""
        flat = self._index_tensor(addrs, "place: addrs")
        inrange, safe = self._range(flat)
        fresh = self._first(safe, inrange & (self.loc[safe] < 0))
        return flat, fresh, (flat != -1) & ~fresh

    def check_place(self, addrs: torch.Tensor) -> None:
        """Raise what :meth:`place` would raise with validate on, changing nothing (host-side:
        synchronises)."""
        self._validate_place(*self._place_plan(addrs))

    def _validate_place(self, flat, fresh, bad) -> None:
        if not bool(bad.any()):
            self.check_place_room(int(fresh.sum()))
            return
        inrange, safe = self._range(flat)
        if bool(((flat != -1) & ~inrange).any()):
            raise AddressError(f"place: addrs out of range [0, {self.n_logical}) (or negative "
                               "other than the -1 padding)")
        if bool((inrange & (self.loc[safe] >= 0)).any()):
            raise AddressError("place: addrs already have a row (release them first)")
        raise AddressError("place: duplicate addrs")

    def check_place_room(self, need: int) -> None:
        """Raise :class:`CapacityExhausted` unless ``need`` rows can be placed this round
        (host-side: it synchronises the device)."""
        eligible = int(self.policy.eligible())
        if need > eligible:
            raise CapacityExhausted(
                f"place: {need} new rows but only {eligible} GPU slots are free or evictable "
                "this round (rows used this round are pinned); place fewer rows per round or "
                "enlarge gpu_slots")
        spills = max(0, need - (self.gpu_slots - int(self.policy.used_count())))
        room = int(self.pools.cpu_top) + int((self.shadow[:self.gpu_slots] >= 0).sum())
        if spills > room:
            raise CapacityExhausted(f"place: {spills} rows must be spilled to the CPU tier but "
                                    f"only {room} CPU slots are free (shadows included); "
                                    "admission should have refused this request")

    # -- data (host-checked: tests and tools, not the decode path) --------------------------
    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``uint8 [n, row_bytes]`` rows of one ``layer`` (a global layer id of this
        group) for distinct live ``addrs int [n]`` (``-1`` skipped), wherever they live."""
        li, phys = self._write_plan(layer, addrs, rows)
        G = self.gpu_slots
        gidx = torch.where((phys >= 0) & (phys < G), phys, G)
        self.pools.gpu[li].index_copy_(0, gidx, rows.to(self.device))
        # a GPU row's shadow is written through: it stays an exact copy
        had = self._shadow_of(gidx)
        cidx = torch.where(phys >= G, phys - G, torch.where(had >= 0, had, self.cpu_slots))
        self.pools.cpu[li].index_copy_(0, cidx.to(self.pools.cpu.device),
                                       rows.to(self.pools.cpu.device))

    def check_write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Raise what :meth:`write` would raise, changing nothing (host-side: synchronises).
        TP mode runs it on every rank before any rank writes."""
        self._write_plan(layer, addrs, rows)

    def _write_plan(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor
                    ) -> tuple[int, torch.Tensor]:
        """(layer index in the group, physical place of each address) after every check of a
        write: types, shapes, devices, and distinct live addresses."""
        li = self._li(layer)
        flat = self._index_tensor(addrs, "write: addrs")
        want = (flat.numel(), self.pools.row_bytes)
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or \
                tuple(rows.shape) != want:
            got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else \
                type(rows).__name__
            raise ShapeError(f"write: rows must be uint8 {want}, got {got}")
        if rows.device not in (self.device, torch.device("cpu")):
            raise ShapeError(f"write: rows must be on {self.device} or the CPU, got {rows.device}")
        return li, self._resolve(flat, "write")

    def check_read(self, addrs: torch.Tensor) -> None:
        """Raise what :meth:`read` would raise, changing nothing (host-side: synchronises)."""
        self._resolve(self._index_tensor(addrs, "read: addrs"), "read", distinct=False)

    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor:
        """Rows of distinct live addresses, from whichever tier holds them: ``uint8 [n,
        row_bytes]`` of one ``layer`` (``-1`` entries read the scratch row)."""
        return self.read_all(addrs)[self._li(layer)]

    def read_all(self, addrs: torch.Tensor) -> torch.Tensor:
        """``uint8 [L, n, row_bytes]``: rows of every layer of the group."""
        flat = self._index_tensor(addrs, "read: addrs")
        phys = self._resolve(flat, "read", distinct=False)
        G = self.gpu_slots
        on_gpu = (phys >= 0) & (phys < G)
        gpu = self.pools.gpu.index_select(1, torch.where(on_gpu, phys, G))
        cidx = torch.where(phys >= G, phys - G, self.cpu_slots).to(self.pools.cpu.device)
        cpu = self.pools.cpu.index_select(1, cidx).to(self.device)
        return torch.where(on_gpu.view(1, -1, 1), gpu, cpu)

    def gather(self, layer: int, addrs: torch.Tensor, dst: torch.Tensor,
               dst_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy one ``layer``'s rows of live ``addrs int [n]`` (``-1`` skipped) into
        ``dst uint8 [1, R + 1, row_bytes]`` at ``dst_rows int64 [n]`` (last row: scratch), from
        whichever tier holds each (GPU rows device to device, CPU rows host to device): no
        promotion, no eviction, nothing of the group changes. Returns ``(from_cpu, gathered)``:
        a 0-dim count of the rows read from the CPU tier and ``bool [n]``, which entries were
        copied. With validate on, an address out of range or not live raises
        (:class:`AddressError`, host-checked); off (and on the meta device), such entries are
        skipped, ``gathered`` False, with no host read."""
        li = self._li(layer)
        flat = self._index_tensor(addrs, "gather: addrs")
        if self._checking() and self.device.type != "meta":
            phys = self._resolve(flat, "gather", distinct=False)
        else:
            inrange, safe = self._range(flat)
            phys = torch.where(inrange, self._slots_of(safe), -1)
        G = self.gpu_slots
        on_gpu, on_cpu = (phys >= 0) & (phys < G), phys >= G
        dst_rows = dst_rows.to(self.device, torch.int64)
        gather_rows(self.pools.gpu[li: li + 1], torch.where(on_gpu, phys, -1), dst,
                    torch.where(on_gpu, dst_rows, -1))
        gather_rows(self.pools.cpu[li: li + 1], torch.where(on_cpu, phys - G, -1), dst,
                    torch.where(on_cpu, dst_rows, -1))
        return on_cpu.sum(), (phys >= 0) & (dst_rows >= 0)

    def _resolve(self, flat: torch.Tensor, what: str, distinct: bool = True) -> torch.Tensor:
        """Physical places of addresses that must all be live (``-1`` -> ``-1``)."""
        inrange, safe = self._range(flat)
        if bool(((flat != -1) & ~inrange).any()):
            raise AddressError(f"{what}: addrs out of range [0, {self.n_logical}) (or negative "
                               "other than the -1 padding)")
        phys = torch.where(inrange, self._slots_of(safe), -1)
        if bool((inrange & (phys < 0)).any()):
            raise AddressError(f"{what}: addrs not live (never placed, or released)")
        if distinct and bool((inrange & ~self._first(safe, inrange)).any()):
            raise AddressError(f"{what}: duplicate addrs")
        return phys

    # -- the per-step sparse access -------------------------------------------------------
    def access(self, addrs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One step's sparse access: make every selected row GPU-resident; physical GPU rows.

        Parameters
        ----------
        addrs : ``int32/int64 [bs, k]`` logical addresses, ``-1`` padding. Duplicates allowed.
        out : optional preallocated ``int32 [bs, k]`` on the group's device (graph-stable).

        Returns ``int32 [bs, k]``: GPU row of each selection (its slot + ``row_base``, the
        engine tensor's offset; 0 by default), ``-1`` where ``addrs`` is ``-1``
        (and, validate off, where a selection is invalid or overflowed: see the module doc).

        Steps, all tensor ops on the group's device (no host sync unless ``validate`` and not
        capturing): resolve -> dedup -> touch hits -> choose victims (PB-LRU order; this round,
        which now holds this step's hits, is excluded) -> swap rows (victim row into the CPU
        slot the promoted row vacates; a single copy when the victim slot was free) ->
        update mapping -> touch promoted -> translate. The fused path
        (:data:`ACCESS_PATHS`) does the same in four launches with identical results.
        """
        self._index_meta(addrs, "access: addrs", dims=2)
        check_out(out, addrs.shape, self.device, "access")
        if addrs.numel() > self.max_call:  # a prefill page table: chunks, in this round
            if self._checking():
                self.check_access(addrs)
            return in_pieces(addrs, out, self.max_call, self.device, self._access_one)
        return self._access_one(addrs, out)

    def _access_torch(self, addrs: torch.Tensor, out: torch.Tensor | None,
                      defer: bool = False) -> torch.Tensor:
        """:meth:`access` of at most :attr:`max_call` entries (metadata checked), the torch
        reference; ``defer``: :meth:`access_deferred`'s."""
        flat = addrs.reshape(-1).to(torch.int64)
        G = self.gpu_slots
        inrange, safe = self._range(flat)
        phys = self._slots_of(safe)
        valid = inrange & (phys >= 0)
        bad = (flat != -1) & ~valid
        checking = self._checking()
        if checking and bool(bad.any()):
            raise AddressError("access: addrs hold an address that is out of range, not live, "
                               "or negative other than the -1 padding")
        first = self._first(safe, valid)
        hit = first & (phys < G)
        miss = first & (phys >= G)
        hit_slots = torch.where(hit, phys, -1)
        if checking:
            self._check_room(miss, hit_slots)
        self.policy.touch(hit_slots)
        ok, victim, moved = self._promote_torch(flat, phys, miss, defer=defer)
        self.policy.assign(victim)
        self._count(accesses=first.sum(), gpu_hits=hit.sum(), promotions=ok.sum(),
                    access_overflow=(miss & ~ok).sum(), invalid=bad.sum(), **moved)
        rows = self._slots_of(safe)
        rows = torch.where(valid & (rows >= 0) & (rows < G), rows + self.row_base, -1) \
            .view(addrs.shape)
        if out is None:
            return rows.to(torch.int32)
        out.copy_(rows)
        return out

    def _promote_torch(self, flat: torch.Tensor, phys: torch.Tensor, miss: torch.Tensor,
                       limit: torch.Tensor | None = None, defer: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Move the ``miss`` entries' rows (first occurrences of CPU-resident addresses; at
        most ``limit`` of them, in entry order) into victim GPU slots: data, then mapping,
        owners, shadows and the CPU free stack. The policy is the caller's (an access assigns
        the victims, a prefetch admits them). ``defer``: the data of the first layer only, the
        moves recorded for :meth:`replay_layer`. Returns (promoted ``bool [n]``, victim slot or
        -1 ``int64 [n]``, eviction counts)."""
        G = self.gpu_slots
        rank = torch.cumsum(miss, 0) - 1
        if limit is not None:  # a prefetch's budget: the first ``limit`` misses only
            miss = miss & (rank < limit)
        cand = self.policy.victims(flat.numel())
        victim = torch.where(miss, cand[rank.clamp(min=0)], -1)
        ok = victim >= 0
        cslot = torch.where(ok, phys - G, -1)
        vs = torch.where(ok, victim, G)
        owner = self._owners_of(vs)
        owned = ok & (owner >= 0)
        had = self._shadow_of(vs)
        remap = owned & (had >= 0)  # the victim's shadow becomes its CPU copy: no copy out
        copy_out = owned & ~remap
        if self.shadows:  # a written-back victim takes a free CPU slot if there is one ...
            took, popped = self._pop_in_victim_order(owned)
        else:
            took, popped = torch.zeros_like(ok), torch.full_like(flat, -1)
        into_free = copy_out & took
        swap = copy_out & ~took  # ... else the slot its promoted row vacates (a swap)
        dst = torch.where(into_free, popped, cslot)  # where a written-back victim goes
        keep = ok & ~swap if self.shadows else torch.zeros_like(ok)  # cslot stays a shadow
        # 1. data: victims without a shadow -> a free CPU slot or (swap) the vacated one;
        #    promoted rows -> their victim GPU slots (deferred: the anchor layer's only)
        out_to = torch.where(copy_out, dst, -1)
        layers = slice(0, 1) if defer else slice(None)
        move_rows(self.pools.gpu[layers], self.pools.cpu[layers], victim, cslot, out_to)
        if defer:
            self.moves[:, : flat.numel()].copy_(torch.stack((victim, cslot, out_to)))
        # 2. mapping
        self._map(torch.where(ok, flat, self.n_logical), victim)
        self._map(torch.where(owned, owner, self.n_logical),
                  torch.where(copy_out, G + dst, torch.where(remap, G + had, -1)))
        self._own(vs, torch.where(ok, flat, -1))
        self.shadow.index_put_((vs,), torch.where(keep, cslot, WAS_ON_CPU).to(torch.int32))
        if self.shadows:
            self._settle_stack(took, took & remap, popped)
        else:
            self.pools.push_cpu(torch.where(ok & ~owned, cslot, -1))
        return ok, victim, dict(writebacks=copy_out.sum(), remaps=remap.sum(),
                                shadowed=keep.sum(),
                                rewrites=(copy_out & (had == WAS_ON_CPU)).sum())

    def _access_fused(self, addrs: torch.Tensor, out: torch.Tensor | None,
                      defer: bool = False) -> torch.Tensor:
        """:meth:`access` of at most :attr:`max_call` entries, fused (four launches)."""
        if self._checking():
            self.check_access(addrs)
        rows = out if out is not None and out.is_contiguous() else \
            torch.empty(addrs.shape, dtype=torch.int32, device=self.device)
        self.fused.run(addrs.reshape(-1).contiguous(), place=False, out=rows,
                       row_base=self.row_base, moves=self.moves if defer else None)
        if out is not None and rows is not out:
            out.copy_(rows)
            return out
        return rows

    # -- deferred access: the anchor's bytes now, the other layers' on a side stream -------
    def access_deferred(self, addrs: torch.Tensor, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """:meth:`access` that moves only the group's first (anchor) layer's bytes and records
        each promotion's move (victim GPU slot, source CPU slot, write-back CPU slot) in the
        move list (:meth:`use_move_list`); :meth:`replay_layer` moves layer ``l``'s bytes of
        the same moves later (UlaCache, arXiv 2610.29820, §6.3: the anchor's plan is exact for
        its group, so the other layers' bytes move while the anchor attends).

        Everything but those bytes is the access's, identical: mapping, owners, shadows, free
        stack, policy and counters are final when it returns, so layer ``l >= 1`` must not be
        read until its replay ran. Safe meanwhile: the moves touch only this call's victim
        slots (unselected) and the CPU slots its promoted rows and victims use, which nothing
        reads or reuses before the group's next round. ``addrs``: at most :attr:`max_call`
        entries (a decode step); larger raises :class:`ShapeError`."""
        self._index_meta(addrs, "access_deferred: addrs", dims=2)
        check_out(out, addrs.shape, self.device, "access_deferred")
        if self.moves is None:
            raise ShapeError("access_deferred: no move list (use_move_list)")
        if addrs.numel() > self.max_call:
            raise ShapeError(f"access_deferred: {addrs.numel()} entries exceed the call "
                             f"capacity {self.max_call} (use access)")
        self.deferred_entries = addrs.numel()
        return self._access_one(addrs, out, defer=True)

    def replay_layer(self, li: int) -> None:
        """Move layer ``li``'s (``1 <= li < L``, the group's own layer order) bytes of the last
        :meth:`access_deferred`'s promotions: the anchor's copies, one layer later. Issued on
        the caller's stream, no host sync, a fixed launch for a fixed call shape."""
        if isinstance(li, bool) or not isinstance(li, int) or not 1 <= li < len(self.layers):
            raise ShapeError(f"replay_layer: layer index {li!r} not in [1, {len(self.layers)})")
        if self.deferred_entries:
            self._replay(li, self.deferred_entries)

    def _replay_torch(self, li: int, n: int) -> None:
        m = self.moves[:, :n].to(torch.int64)
        move_rows(self.pools.gpu[li: li + 1], self.pools.cpu[li: li + 1], m[0], m[1], m[2])

    def _replay_fused(self, li: int, n: int) -> None:
        self.fused.replay(self.moves, n, li)

    # -- prefetch: a hint, ahead of the access that needs the rows ------------------------
    def prefetch(self, addrs: torch.Tensor, budget: torch.Tensor) -> None:
        """Promote predicted rows before the access that will select them (OasisKV's
        look-ahead, arXiv 2608.08097, Algorithm 2).

        ``addrs int [n]``: predicted addresses, most likely first (``-1`` padding; anything
        out of range or not live is skipped and not counted: a hint is never bad input).
        ``budget``: 0-dim ``int64`` on the group's device, the rows this call may promote (the
        per-step fetch cap), decremented by what it promoted; the caller refills it each step.
        One call per group per step (:class:`ulacache.prefetch.PrefetchEngine` merges its
        sources' predictions): a call's victims are distinct, but a second call's could be the
        first one's rows. Predictions past :attr:`max_call` are dropped (the least likely; a
        call cannot promote more than the pool anyway).

        Per distinct prediction: resident on the GPU -> nothing (not touched: what the access
        would evict is not reordered by a guess); on the CPU -> promoted in rank order while
        the budget lasts, each into the next victim in the policy's order (free slots, then the
        least recently selected row), never a slot pinned this round. Promoted rows enter at
        the lowest recency (``policy.admit``): one the access does not select is the next
        victim, so a wrong guess costs its copy and displaces at most the coldest row. Same
        data-before-mapping order as the access; the fused path is the access's four launches.
        The access still resolves every selection, so outputs never depend on prefetching.
        Counted in ``prefetches`` (and the evictions' counters); no host sync.
        """
        self._index_meta(addrs, "prefetch: addrs")
        if not isinstance(budget, torch.Tensor) or budget.dtype != torch.int64 or \
                budget.dim() != 0 or budget.device != self.device:
            raise ShapeError(f"prefetch: budget must be a 0-dim int64 tensor on {self.device}")
        self._prefetch_one(addrs.reshape(-1)[: self.max_call], budget)

    def _prefetch_torch(self, addrs: torch.Tensor, budget: torch.Tensor) -> None:
        """:meth:`prefetch` of at most :attr:`max_call` entries, the torch reference."""
        flat = addrs.reshape(-1).to(torch.int64)
        inrange, safe = self._range(flat)
        phys = self._slots_of(safe)
        first = first_occurrence(self.prefetch_claim, safe, inrange & (phys >= 0))
        ok, victim, moved = self._promote_torch(flat, phys, first & (phys >= self.gpu_slots),
                                                limit=budget)
        self.policy.admit(victim)
        promoted = ok.sum()
        budget.sub_(promoted)
        self._count(prefetches=promoted, **moved)

    def _prefetch_fused(self, addrs: torch.Tensor, budget: torch.Tensor) -> None:
        """:meth:`prefetch` of at most :attr:`max_call` entries, fused (four launches)."""
        self.fused_prefetch.run(addrs.reshape(-1).contiguous(), place=False,
                                prefetch_budget=budget)

    def check_access(self, addrs: torch.Tensor) -> None:
        """Raise what :meth:`access` would raise with validate on, changing nothing (host-side:
        synchronises). TP mode runs it on every rank before any rank mutates, so that a bad
        selection stops all ranks alike."""
        flat = self._index_tensor(addrs, "access: addrs", dims=2)
        inrange, safe = self._range(flat)
        phys = self._slots_of(safe)
        valid = inrange & (phys >= 0)
        if bool(((flat != -1) & ~valid).any()):
            raise AddressError("access: addrs hold an address that is out of range, not live, "
                               "or negative other than the -1 padding")
        first = self._first(safe, valid)
        self._check_room(first & (phys >= self.gpu_slots),
                         torch.where(first & (phys < self.gpu_slots), phys, -1))

    def _check_room(self, miss: torch.Tensor, hit_slots: torch.Tensor) -> None:
        need = int(miss.sum())
        moving = hit_slots >= 0
        have = int(self.policy.eligible()) - int((moving & ~self.policy.pinned(hit_slots)).sum())
        if need > have:
            raise CapacityExhausted(
                f"access: {need} rows to promote but only {have} GPU slots are free or evictable "
                "(rows read or written this round are pinned); a step's distinct selections "
                "must fit in gpu_slots")

    def translate(self, addrs: torch.Tensor) -> torch.Tensor:
        """GPU rows (slot + ``row_base``) of addresses, with no side effect: ``int32``, same
        shape; ``-1`` for padding and for anything not GPU-resident. For layers that share a
        selection their anchor already made resident this round."""
        return self._translate(addrs)

    def _translate_fused(self, addrs: torch.Tensor) -> torch.Tensor:
        self._index_meta(addrs, "translate: addrs")
        out = torch.empty(addrs.shape, dtype=torch.int32, device=self.device)
        self.fused.translate(addrs.reshape(-1).contiguous(), out.view(-1), self.row_base)
        return out

    def _translate_torch(self, addrs: torch.Tensor) -> torch.Tensor:
        flat = self._index_tensor(addrs, "translate: addrs")
        _, safe = self._range(flat)
        phys = self._slots_of(safe)
        return torch.where((phys >= 0) & (phys < self.gpu_slots), phys + self.row_base, -1) \
            .to(torch.int32).view(addrs.shape)

    # -- release ---------------------------------------------------------------------------
    def release(self, addrs: torch.Tensor) -> None:
        """Drop the rows of these addresses from both tiers; they become unmapped.

        ``addrs int [n]``; ``-1`` and unmapped in-range entries are skipped (engines free whole
        pages). Validate on: out-of-range entries and duplicates raise :class:`AddressError`;
        off: they are skipped and counted (``invalid``)."""
        if addrs.numel() > self.max_call:
            self._index_meta(addrs, "release: addrs")
            if self._checking():
                self._release_plan(addrs, check=True)
            for chunk in self._chunks(addrs):
                self._release_one(chunk)
            return
        self._release_one(addrs)

    def _release_fused(self, addrs: torch.Tensor) -> None:
        """:meth:`release` of at most :attr:`max_call` entries: three launches, after the
        same checks as the torch reference."""
        self._index_meta(addrs, "release: addrs")
        if self._checking():
            self._release_plan(addrs, check=True)
        self.fused_release.run(addrs.reshape(-1).contiguous())

    def _release_torch(self, addrs: torch.Tensor) -> None:
        """:meth:`release` of at most :attr:`max_call` entries, the torch reference."""
        flat, inrange, safe, first, bad = self._release_plan(addrs, self._checking())
        phys = self._slots_of(safe)
        mapped = inrange & (phys >= 0)
        drop = first & mapped
        G = self.gpu_slots
        on_gpu = drop & (phys < G)
        on_cpu = drop & (phys >= G)
        gslot = torch.where(on_gpu, phys, -1)
        had = self._shadow_of(torch.where(on_gpu, phys, G))
        shadowed = on_gpu & (had >= 0)  # the row's shadow is freed with it
        cslot = torch.where(on_cpu, phys - G, torch.where(shadowed, had, -1))
        self._map(torch.where(drop, flat, self.n_logical), torch.full_like(flat, -1))
        self._own(torch.where(on_gpu, gslot, G), torch.full_like(gslot, -1))
        self.shadow.index_put_((torch.where(on_gpu, gslot, G),),
                               torch.full_like(gslot, BORN, dtype=torch.int32))
        self.policy.release(gslot)
        self.pools.push_cpu(cslot)
        self._count(released_gpu=on_gpu.sum(), released_cpu=on_cpu.sum(), invalid=bad.sum(),
                    shadows_released=shadowed.sum())

    def _release_plan(self, addrs: torch.Tensor, check: bool):
        """(flat, in range, safe, first occurrences, invalid entries) of a release; ``check``:
        raise :class:`AddressError` on invalid entries (host sync)."""
        flat = self._index_tensor(addrs, "release: addrs")
        inrange, safe = self._range(flat)
        first = self._first(safe, inrange)
        bad = ((flat != -1) & ~inrange) | (inrange & ~first)
        if check and bool(bad.any()):
            raise AddressError(f"release: addrs hold duplicates or addresses out of range "
                               f"[0, {self.n_logical}) (negative other than the -1 padding)")
        return flat, inrange, safe, first, bad

    # -- invariants -----------------------------------------------------------------------
    def check_integrity(self, live: torch.Tensor | None = None) -> None:
        """Assert design invariant 1 and the policy's own consistency (host-side; not for the
        decode path).

        ``live``: optional ``bool [n_logical]`` of allocated addresses; mapped addresses must be
        live.
        """
        G, C = self.gpu_slots, self.cpu_slots
        loc = self.loc[: self.n_logical].long()
        assert int(self.loc[self.n_logical]) == -1, "scratch mapping entry was written"
        mapped = loc >= 0
        assert bool((loc < G + C).all()), "mapping points past the pools"
        assert bool((loc >= -1).all()), "mapping holds a negative slot other than -1"
        if live is not None:
            assert not bool((mapped & ~live.to(self.device)).any()), "non-live address mapped"
        addr = torch.arange(self.n_logical, device=self.device)
        g_addr, c_addr = addr[mapped & (loc < G)], addr[loc >= G]
        g_slot, c_slot = loc[g_addr], loc[c_addr] - G
        # shadows: only of GPU-resident rows, at most one per row, exact copies, not a primary
        shadow = self.shadow[:G].to(torch.int64)
        assert int(self.shadow[G]) < 0, "scratch shadow entry holds a slot"
        assert bool(((shadow >= WAS_ON_CPU) & (shadow < C)).all()), "shadow entry out of range"
        free_g = torch.ones(G, dtype=torch.bool, device=self.device)
        free_g[g_slot] = False
        assert bool((shadow[free_g] == BORN).all()), "a free GPU slot keeps a shadow marker"
        assert self.shadows or not bool((shadow >= 0).any()), "shadow kept with shadows off"
        s_gpu = g_slot[shadow[g_slot] >= 0]
        s_slot, s_addr = shadow[s_gpu], self.gpu_owner[s_gpu].long()
        if s_gpu.numel() and self.pools.n_layers:
            assert torch.equal(self.pools.gpu[:, s_gpu].cpu(), self.pools.cpu[:, s_slot].cpu()), \
                "a shadow differs from its GPU row"
        # one place per address, one address per slot, reverse maps agree
        assert g_slot.unique().numel() == g_slot.numel(), "GPU slot owned twice"
        held = torch.cat([c_slot, s_slot])
        assert held.unique().numel() == held.numel(), "CPU slot held twice (primary or shadow)"
        exp_g = torch.full((G,), -1, dtype=torch.int64, device=self.device)
        exp_g[g_slot] = g_addr
        exp_c = torch.full((C,), -1, dtype=torch.int64, device=self.device)
        exp_c[c_slot] = c_addr
        exp_c[s_slot] = s_addr
        assert torch.equal(exp_g, self.gpu_owner[:G].long()), "gpu_owner disagrees with mapping"
        assert int(self.gpu_owner[G]) == -1, "scratch owner"
        # free structures and owned slots are disjoint and cover each pool
        assert torch.equal(self.policy.used_mask(), exp_g >= 0), "policy free set != unowned"
        assert int(self.policy.used_count()) == int((exp_g >= 0).sum()), "policy used count"
        top = int(self.pools.cpu_top)
        assert 0 <= top <= C, "CPU free stack pointer out of range"
        free_c = self.pools.cpu_free_set()
        assert bool(((free_c >= 0) & (free_c < C)).all()), "CPU free stack holds a bad slot"
        assert free_c.unique().numel() == free_c.numel(), "CPU slot free twice"
        covered = torch.zeros(C, dtype=torch.bool, device=self.device)
        covered[free_c] = True
        assert torch.equal(covered, exp_c < 0), "CPU free stack != CPU slots neither primary " \
            "nor shadow"
        self.policy.check_integrity()
        assert bool((self.claim_table == NO_CLAIM).all()), "claim table dirty"
        assert bool((self.counters >= 0).all()), "negative counter"
        counts = self.counter_values()
        assert occupancy(counts) == (int((exp_g >= 0).sum()), c_slot.numel()), \
            "occupancy derived from the counters disagrees with the pools"
        assert live_shadows(counts) == s_slot.numel(), "shadow count disagrees with counters"
