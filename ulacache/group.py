"""Residency of one selection group: mapping table, reverse maps, pools and the policy.

The mapping table is the single source of truth. One ``int64`` per logical address::

    loc[t] == -1           unmapped (allocated but not written yet, or never allocated)
    loc[t] in [0, G)       GPU slot loc[t]
    loc[t] in [G, G + C)   CPU slot loc[t] - G
    loc[n_logical]         scratch entry for masked writes (always -1)

Reverse maps ``gpu_owner[G + 1]`` and ``cpu_owner[C + 1]`` give each slot's address or -1.

Every data movement follows the same order (design invariant 3): copy the bytes, then update
the mapping, then (on CUDA) record the completion event readers wait on. All of it is issued
on one stream, so a later reuse of a slot is ordered after the copies out of it (invariant 8).
"""

from __future__ import annotations

import torch

from ulacache.kernels.dispatch import gather_rows, swap_rows

from .errors import AddressError, CapacityExhausted, ShapeError
from .pblru import ReplacementPolicy, make_policy
from .pools import TierPools, resolve_device

# Counter slots of SelectionGroup.counters (device int64, read out of the decode path).
COUNTERS = ("accesses", "gpu_hits", "promotions", "writebacks", "spills", "placed", "overflow")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SelectionGroup:
    """Pools, mapping and PB-LRU of the layers that share one top-k selection.

    Parameters
    ----------
    layers : global layer ids of the group (their rows are stored in this order).
    n_logical : size of the logical address space (addresses ``[0, n_logical)``).
    gpu_slots, cpu_slots, row_bytes : pool geometry.
    policy : ``"pblru"`` or ``"lru"``.
    gpu_storage : optional engine-owned ``uint8 [L, G + 1, row_bytes]`` GPU pool (e.g. a view of
        SGLang's ``kv_buffer`` rows); allocated here when absent.
    """

    def __init__(self, layers: list[int], n_logical: int, gpu_slots: int, cpu_slots: int,
                 row_bytes: int, device: torch.device | str = "cpu", policy: str = "pblru",
                 n_buckets: int = 64, validate: bool = True,
                 gpu_storage: torch.Tensor | None = None):
        self.device = resolve_device(device)
        self.layers = list(layers)
        self.layer_index = {layer: i for i, layer in enumerate(self.layers)}
        self.n_logical, self.G, self.C = n_logical, gpu_slots, cpu_slots
        self.validate = validate
        self.pools = TierPools(len(layers), gpu_slots, cpu_slots, row_bytes, self.device,
                               gpu_storage)
        self.policy: ReplacementPolicy = make_policy(policy, gpu_slots, n_buckets, self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.loc = torch.full((n_logical + 1,), -1, **i64)
        self.gpu_owner = torch.full((gpu_slots + 1,), -1, **i64)
        self.cpu_owner = torch.full((cpu_slots + 1,), -1, **i64)
        # Dedup of a step's selections: claim[t] = first position selecting t (reset after use).
        self._claim = torch.full((n_logical + 1,), torch.iinfo(torch.int64).max, **i64)
        self.counters = torch.zeros(len(COUNTERS), **i64)
        self.done_event = torch.cuda.Event() if self.device.type == "cuda" else None

    # -- helpers --------------------------------------------------------------------------
    def _count(self, name: str, value: torch.Tensor) -> None:
        self.counters[COUNTERS.index(name)] += value

    def _check_addrs(self, addrs: torch.Tensor, what: str) -> None:
        if addrs.dtype not in (torch.int32, torch.int64) or addrs.device != self.device:
            raise ShapeError(f"{what}: addresses must be int32/int64 on {self.device}, "
                             f"got {addrs.dtype} on {addrs.device}")

    def _mark_done(self) -> None:
        # Readers on other streams wait on this event. Inside a captured graph the stream order
        # of the replay already orders readers after the copies, so no event is recorded there.
        if self.done_event is not None and not _capturing(self.device):
            self.done_event.record()

    def counter_values(self) -> dict[str, int]:
        return dict(zip(COUNTERS, self.counters.tolist()))

    # -- placement of new rows ------------------------------------------------------------
    def place(self, addrs: torch.Tensor) -> torch.Tensor:
        """Give each (distinct, unmapped) address a GPU slot; ``int64 [n]`` slots.

        Slots come from the policy's victim order: free slots first; an occupied victim is
        first spilled to a free CPU slot (data, then mapping). Placed slots join the current
        round, so nothing read or written this round is evicted by a later placement.
        """
        self._check_addrs(addrs, "place")
        addrs = addrs.reshape(-1).to(torch.int64)
        valid = addrs >= 0
        if self.validate and not _capturing(self.device):
            self._validate_place(addrs, valid)
        rank = torch.cumsum(valid, 0) - 1
        cand = self.policy.victims(addrs.numel())
        slot = torch.where(valid, cand[rank.clamp(min=0)], -1)
        ok = slot >= 0
        owner = self.gpu_owner[torch.where(ok, slot, self.G)]
        spill = ok & (owner >= 0)
        cslot = self.pools.pop_cpu(spill)
        # data first: the spilled victims' rows move GPU -> CPU ...
        gather_rows(self.pools.gpu, torch.where(spill, slot, -1), self.pools.cpu, cslot)
        # ... then the mapping
        self.loc.index_put_((torch.where(spill, owner, self.n_logical),),
                            torch.where(spill, self.G + cslot, -1))
        self.cpu_owner.index_put_((torch.where(spill, cslot, self.C),),
                                  torch.where(spill, owner, -1))
        self.gpu_owner.index_put_((torch.where(ok, slot, self.G),), torch.where(ok, addrs, -1))
        self.loc.index_put_((torch.where(ok, addrs, self.n_logical),), torch.where(ok, slot, -1))
        self.policy.touch(slot)
        self._count("placed", ok.sum())
        self._count("spills", spill.sum())
        self._count("overflow", (valid & ~ok).sum())
        self._mark_done()
        return slot

    def _validate_place(self, addrs: torch.Tensor, valid: torch.Tensor) -> None:
        a = addrs[valid]
        if a.numel() == 0:
            return
        if bool(((a < 0) | (a >= self.n_logical)).any()):
            raise AddressError(f"place: address out of range [0, {self.n_logical})")
        if a.unique().numel() != a.numel():
            raise AddressError("place: duplicate addresses")
        if bool((self.loc[a] >= 0).any()):
            raise AddressError("place: address already has a row (free it first)")
        self.check_place_room(a.numel())

    def check_place_room(self, need: int) -> None:
        """Raise :class:`CapacityExhausted` unless ``need`` rows can be placed this round."""
        eligible = int(self.policy.eligible())
        if need > eligible:
            raise CapacityExhausted(
                f"place: {need} new rows but only {eligible} GPU slots are free or evictable "
                "this round (rows used this round are pinned); place fewer rows per round or "
                "enlarge gpu_slots")
        spills = max(0, need - int((~self.policy.used_mask()).sum()))
        if spills > int(self.pools.cpu_top):
            raise CapacityExhausted(f"place: {spills} spills but {int(self.pools.cpu_top)} free "
                                    "CPU slots; admission should have refused this request")

    # -- data ----------------------------------------------------------------------------
    def write(self, addrs: torch.Tensor, rows: torch.Tensor, layer: int | None = None) -> None:
        """Write rows for mapped addresses, wherever they live.

        ``addrs int [n]`` (distinct, mapped, ``-1`` skipped); ``rows uint8 [n, row_bytes]`` for
        one ``layer`` (a global layer id of this group) or ``uint8 [L, n, row_bytes]`` for all.
        """
        self._check_addrs(addrs, "write")
        addrs = addrs.reshape(-1).to(torch.int64)
        shape = (addrs.numel(), self.pools.row_bytes)
        full = (len(self.layers),) + shape
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (shape if layer is not None
                                                                else full):
            raise ShapeError(f"write: rows must be uint8 {shape if layer is not None else full},"
                             f" got {rows.dtype} {tuple(rows.shape)}")
        phys = self._resolve(addrs, "write")
        li = slice(None) if layer is None else slice(self._li(layer), self._li(layer) + 1)
        rows3 = rows if layer is None else rows.unsqueeze(0)
        on_gpu = (phys >= 0) & (phys < self.G)
        on_cpu = phys >= self.G
        gidx = torch.where(on_gpu, phys, self.G)
        self.pools.gpu[li].index_copy_(1, gidx, rows3.to(self.device))
        if self.C:
            cidx = torch.where(on_cpu, phys - self.G, self.C).to(self.pools.cpu.device)
            self.pools.cpu[li].index_copy_(1, cidx, rows3.to(self.pools.cpu.device))

    def read(self, addrs: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Rows of mapped addresses from whichever tier holds them (tests and tools):
        ``uint8 [n, row_bytes]`` for one layer, else ``[L, n, row_bytes]``."""
        addrs = addrs.reshape(-1).to(torch.int64)
        phys = self._resolve(addrs, "read")
        gpu = self.pools.gpu.index_select(1, torch.where(phys < self.G, phys, self.G))
        cidx = torch.where(phys >= self.G, phys - self.G, self.C).to(self.pools.cpu.device)
        cpu = self.pools.cpu.index_select(1, cidx).to(self.device)
        out = torch.where((phys < self.G).view(1, -1, 1), gpu, cpu)
        return out if layer is None else out[self._li(layer)]

    def _li(self, layer: int) -> int:
        try:
            return self.layer_index[layer]
        except KeyError:
            raise ShapeError(f"layer {layer} is not in this group {self.layers}") from None

    def _resolve(self, addrs: torch.Tensor, what: str) -> torch.Tensor:
        """Physical places of addresses that must all be mapped (host-checked)."""
        valid = addrs >= 0
        if bool(((addrs >= self.n_logical) & valid).any()):
            raise AddressError(f"{what}: address out of range [0, {self.n_logical})")
        phys = self.loc[torch.where(valid, addrs, self.n_logical)]
        if bool((valid & (phys < 0)).any()):
            raise AddressError(f"{what}: address is not live (never written, or freed)")
        return phys

    # -- the per-step sparse access -------------------------------------------------------
    def access(self, addrs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One step's sparse access: make every selected row GPU-resident; physical GPU rows.

        Parameters
        ----------
        addrs : ``int32/int64 [bs, k]`` logical addresses, ``-1`` padding. Duplicates allowed.
        out : optional preallocated ``int32 [bs, k]`` (graph-stable output).

        Returns ``int32 [bs, k]``: GPU slot of each selection, ``-1`` where ``addrs`` is ``-1``.

        Steps, all tensor ops on the group's device (no host sync unless ``validate`` and not
        capturing): resolve -> dedup -> touch hits -> choose victims (PB-LRU order; the current
        round, which now holds this step's hits, is excluded) -> swap rows (victim row into the
        CPU slot the promoted row vacates; a single copy when the victim slot was free) ->
        update mapping -> touch promoted -> translate.
        """
        self._check_addrs(addrs, "access")
        if addrs.dim() != 2:
            raise ShapeError(f"access: addrs must be [bs, k], got {tuple(addrs.shape)}")
        flat = addrs.reshape(-1).to(torch.int64)
        n = flat.numel()
        inrange = (flat >= 0) & (flat < self.n_logical)
        safe = torch.where(inrange, flat, self.n_logical)
        phys = self.loc[safe]
        valid = inrange & (phys >= 0)
        checking = self.validate and not _capturing(self.device)
        if checking and bool(((flat >= 0) & ~valid).any()):
            raise AddressError("access: selected address out of range or not live")
        pos = torch.arange(n, device=self.device)
        self._claim.scatter_reduce_(0, safe, pos, "amin")
        first = valid & (self._claim[safe] == pos)
        self._claim.index_fill_(0, safe, torch.iinfo(torch.int64).max)
        hit = first & (phys < self.G)
        miss = first & (phys >= self.G)
        hit_slots = torch.where(hit, phys, -1)
        if checking:
            self._check_room(miss, hit_slots)
        self.policy.touch(hit_slots)

        rank = torch.cumsum(miss, 0) - 1
        cand = self.policy.victims(n)
        victim = torch.where(miss, cand[rank.clamp(min=0)], -1)
        ok = victim >= 0
        cslot = torch.where(ok, phys - self.G, -1)
        owner = self.gpu_owner[torch.where(ok, victim, self.G)]
        owned = ok & (owner >= 0)
        # 1. data: promoted row -> victim GPU slot, victim row -> vacated CPU slot; a single
        #    copy when the victim slot was free
        swap_rows(self.pools.gpu, torch.where(owned, victim, -1), self.pools.cpu,
                  torch.where(owned, cslot, -1))
        gather_rows(self.pools.cpu, torch.where(owned, -1, cslot), self.pools.gpu,
                    torch.where(owned, -1, victim))
        # 2. mapping
        self.loc.index_put_((torch.where(ok, flat, self.n_logical),), torch.where(ok, victim, -1))
        self.loc.index_put_((torch.where(owned, owner, self.n_logical),),
                            torch.where(owned, self.G + cslot, -1))
        self.gpu_owner.index_put_((torch.where(ok, victim, self.G),), torch.where(ok, flat, -1))
        self.cpu_owner.index_put_((torch.where(ok, cslot, self.C),),
                                  torch.where(owned, owner, -1))
        self.pools.push_cpu(torch.where(ok & ~owned, cslot, -1))
        self.policy.touch(victim)
        # 3. completion
        self._mark_done()
        self._count("accesses", first.sum())
        self._count("gpu_hits", hit.sum())
        self._count("promotions", ok.sum())
        self._count("writebacks", owned.sum())
        self._count("overflow", (miss & ~ok).sum())

        rows = self.loc[safe]
        rows = torch.where(valid & (rows >= 0) & (rows < self.G), rows, -1).view_as(addrs)
        if out is None:
            return rows.to(torch.int32)
        out.copy_(rows)
        return out

    def _check_room(self, miss: torch.Tensor, hit_slots: torch.Tensor) -> None:
        need = int(miss.sum())
        moving = hit_slots >= 0
        have = int(self.policy.eligible()) - int(
            (moving & ~self.policy.in_current_round(hit_slots)).sum())
        if need > have:
            raise CapacityExhausted(
                f"access: {need} rows to promote but only {have} GPU slots are free or evictable "
                "(rows read or written this round are pinned); a step's distinct selections "
                "must fit in gpu_slots")

    # -- release ---------------------------------------------------------------------------
    def release(self, addrs: torch.Tensor) -> None:
        """Drop the rows of these (distinct) addresses from both tiers; they become unmapped.
        Unmapped or ``-1`` entries are skipped."""
        addrs = addrs.reshape(-1).to(torch.int64)
        valid = (addrs >= 0) & (addrs < self.n_logical)
        safe = torch.where(valid, addrs, self.n_logical)
        phys = self.loc[safe]
        on_gpu = valid & (phys >= 0) & (phys < self.G)
        on_cpu = valid & (phys >= self.G)
        gslot = torch.where(on_gpu, phys, -1)
        cslot = torch.where(on_cpu, phys - self.G, -1)
        self.loc.index_put_((safe,), torch.where(valid, -1, self.loc[safe]))
        self.gpu_owner.index_put_((torch.where(on_gpu, gslot, self.G),),
                                  torch.full_like(gslot, -1))
        self.cpu_owner.index_put_((torch.where(on_cpu, cslot, self.C),),
                                  torch.full_like(cslot, -1))
        self.policy.release(gslot)
        self.pools.push_cpu(cslot)

    # -- invariants -----------------------------------------------------------------------
    def check_integrity(self, live: torch.Tensor | None = None) -> None:
        """Assert design invariants 1 and 4 (host-side; not for the decode path).

        ``live``: optional ``bool [n_logical]`` of allocated addresses; mapped addresses must be
        live.
        """
        G, C = self.G, self.C
        loc = self.loc[: self.n_logical]
        assert int(self.loc[self.n_logical]) == -1, "scratch mapping entry was written"
        mapped = loc >= 0
        assert bool((loc < G + C).all()), "mapping points past the pools"
        if live is not None:
            assert not bool((mapped & ~live.to(self.device)).any()), "non-live address mapped"
        addr = torch.arange(self.n_logical, device=self.device)
        g_addr, c_addr = addr[mapped & (loc < G)], addr[loc >= G]
        g_slot, c_slot = loc[g_addr], loc[c_addr] - G
        # one place per address, one address per slot, reverse maps agree
        assert g_slot.unique().numel() == g_slot.numel(), "GPU slot owned twice"
        assert c_slot.unique().numel() == c_slot.numel(), "CPU slot owned twice"
        exp_g = torch.full((G,), -1, dtype=torch.int64, device=self.device)
        exp_g[g_slot] = g_addr
        exp_c = torch.full((C,), -1, dtype=torch.int64, device=self.device)
        exp_c[c_slot] = c_addr
        assert torch.equal(exp_g, self.gpu_owner[:G]), "gpu_owner disagrees with mapping"
        assert torch.equal(exp_c, self.cpu_owner[:C]), "cpu_owner disagrees with mapping"
        # free structures and owned slots are disjoint and cover each pool
        assert torch.equal(self.policy.used_mask(), exp_g >= 0), "policy free set != unowned"
        free_c = self.pools.cpu_free_set()
        assert free_c.unique().numel() == free_c.numel(), "CPU slot free twice"
        covered = torch.zeros(C, dtype=torch.bool, device=self.device)
        covered[free_c] = True
        assert torch.equal(covered, exp_c < 0), "CPU free stack != unowned CPU slots"
        self.policy.check_integrity()
        assert bool((self._claim == torch.iinfo(torch.int64).max).all()), "claim table dirty"
