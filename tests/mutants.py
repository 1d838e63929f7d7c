"""Mutation check: do the core tests catch plausible one-line bugs, every run?

    python tests/mutants.py            # ~35 min on 2 cores; prints one line per mutant
    python tests/mutants.py tp         # only the TP-mode mutants (tests/test_tp.py)
    python tests/mutants.py fused      # only the fused-kernel mutants (test_fused_access.py)
    python tests/mutants.py fused_tp   # the fused TP gates (test_fused_tp.py)
    python tests/mutants.py bufmap     # the TP buffer's hash map (test_bufmap.py, fused TP)
    python tests/mutants.py fused_round  # fused round start and release (test_fused_policy.py)
    python tests/mutants.py hostile    # refusals and TP verdicts (test_hostile_calls.py)
    python tests/mutants.py pieces     # calls over the scratch (test_core, test_fused_access)
    python tests/mutants.py distinct   # a prefill table's distinct-address access
    python tests/mutants.py stripe     # DCP TP mode (test_stripe.py, its fused twin)
    python tests/mutants.py shadows fused_shadows  # evictions without write-back
    python tests/mutants.py prefill    # a prefill longer than the pool (rounds, the stage)
    python tests/mutants.py prefetch   # the look-ahead prefetch (test_prefetch.py)
    .venv-sglang/bin/python tests/mutants.py sglang_stage  # the stage's SGLang seam
    .venv-sglang/bin/python tests/mutants.py sglang_stripe  # striped index-K's SGLang seams
    .venv-sglang/bin/python tests/mutants.py sglang_dcp  # mode "dcp"'s SGLang seams
    .venv-sglang/bin/python tests/mutants.py sglang_classes  # the page-classed allocator
    python tests/mutants.py prefill -k "stage"  # only mutants whose description has "stage"

Copies the repository to a temporary directory, applies each mutant below (one line of the core
changed the way a tired engineer might), runs the core tests there twice with the derandomized
Hypothesis examples (shrinking off: a failure is all that matters), and reports whether both runs
failed. Not collected by pytest (the file name does not start with ``test_``).

Last runs (2026-12-07, no claim table over TP's global addresses): ``bufmap tp fused_tp
distinct`` 34 of 35 (the miss, a TP rank's share, then caught by a new property test: distinct
7 of 7); ``prefill -k stage -k production`` 7 of 8 (the miss equivalent under the binary-search
stage, replaced; the replacement caught).
Before, ``bufmap tp fused_tp`` (2026-12-06, night: the long-release slot walk, the int32
plan written by G4, 32 PB-LRU buckets): 25 of 25 caught by every run (11 min on 2 cores).
Before, ``bufmap tp`` (the same day, after the TP buffer map became a hash table): 16 of 16.
Before (2026-12-06, after the int32 claim tables, the host-side CPU free stacks and PB-LRU's
int16 stamps): ``core fused fused_round shadows fused_shadows prefetch`` 75 of 76 caught by
both runs (25 min on 2 cores, beside other work); the miss, "fused: a re-touch restamps the
ring", was an equivalent mutant (a slot re-touched in its round is in the same epoch) and was
replaced by "fused: ring stamp one epoch ahead", caught by both runs of test_fused_access.py
by hand. ``tp fused_tp`` the same day: 14 of 14 caught by both runs.
Last runs (2026-12-07, the DCP prefill stage and the page-classed allocator): ``sglang_dcp`` 7
of 7; ``sglang_classes`` 5 of 5; ``stripe`` 9 of 10 then 10 of 10 (the miss was a stale original,
not a survivor: fixed). ``sglang_stripe`` (2026-12-07, afternoon, with the score-order merge):
8 of 8 caught by every run (6.1 min).
Last run of ``prefetch`` (2026-12-05): 5 of 5 caught by both runs (8.4 min on 2 cores, beside
other work). Last run (2026-12-05, after the int32 mapping and the recent-first reclaim):
``core fused fused_round shadows fused_shadows`` 67 of 67 caught by both runs (14.7 min on 2 cores).
Before (2026-12-04, shadows): ``shadows`` 8 of 8 and ``fused_shadows`` 6 of 6 caught by
both runs; ``core fused fused_round`` 48 of 49 (the miss, "address 0 taken for free", lost its
catching example when the state machines began drawing ``shadows``; the deterministic
``test_core.py::test_address_zero_is_evicted_like_any_other`` added since fails on it, checked
by hand, the suite not rerun). Earlier (2026-12-02): all 77 caught by both runs (~30 min).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_core.py", "tests/test_stateful.py", "tests/test_pblru.py",
         "tests/test_boundary.py"]
G, P, L = "ulacache/group.py", "ulacache/pblru.py", "ulacache/pools.py"
MUTANTS = [  # (file, original, mutant, what it models)
    (G, "self._map(torch.where(ok, flat, self.n_logical), victim)",
     "self._map(torch.where(ok, flat, self.n_logical - 1), victim)",
     "access: masked writes land on the last address"),
    (G, "self._map(torch.where(ok, flat, self.n_logical), slot)",
     "self._map(torch.where(ok, flat, self.n_logical - 1), slot)",
     "place: masked writes land on the last address"),
    (G, "inrange = (flat >= 0) & (flat < self.n_logical)",
     "inrange = (flat >= 0) & (flat <= self.n_logical)", "the scratch entry counted in range"),
    (G, "took = occupied & (pos >= 0)", "took = occupied", "a pop from a dry CPU free stack"),
    (G, "ok = (slot >= 0) & (~occupied | remap | spill)", "ok = slot >= 0",
     "placement ignores a failed spill"),
    (G, "first = self._first(safe, inrange)\n        bad = ((flat",
     "first = inrange\n        bad = ((flat", "release without dedup"),
    (P, "recent = 2 + torch.remainder(self.epoch_t + self._ring, self.n_buckets)",
     "recent = 2 + torch.remainder(self.epoch_t - self._ring + 1, self.n_buckets)",
     "recent buckets in reverse order"),
    (L, "rank = torch.cumsum(put, 0) - 1", "rank = torch.cumsum(put, 0)", "push off by one"),
    (G, "owned = ok & (owner >= 0)", "owned = ok & (owner > 0)", "address 0 taken for free"),
    (G, "first = keep & (claim[safe] == pos)", "first = keep", "no dedup in access/place"),
    (G, "hit = first & (phys < G)", "hit = first & (phys <= G)", "hit boundary"),
    (P, "row = torch.where(cold, 1, 2 + self.ring_of[s].to(torch.int64))",
     "row = 2 + self.ring_of[s].to(torch.int64)", "cold bit ignored (a cold slot read as ring)"),
    (P, "self.ring_of.index_put_((dst,), torch.remainder(self.epoch_t, self.n_buckets)",
     "self.ring_of.index_put_((dst,), torch.remainder(self.epoch_t + 1, self.n_buckets)",
     "ring stamp one epoch ahead"),
    (G, "        self.policy.touch(hit_slots)\n", "", "hits not pinned"),
    (G, "took, popped = self._pop_in_victim_order(occupied)",
     "took, popped = self._pop_in_victim_order(slot >= 0)",
     "a CPU slot popped for a free victim"),
    (G, "self.pools.push_cpu(torch.where(ok & ~owned, cslot, -1))",
     "self.pools.push_cpu(torch.where(ok, cslot, -1))", "a vacated CPU slot freed after a swap"),
    (P, "go = (self.entered >= self.bucket_fill).to(torch.int64)",
     "go = (self.entered > self.bucket_fill).to(torch.int64)", "epoch threshold off by one"),
    (G, "drop = first & mapped", "drop = mapped", "release drops a duplicate twice"),
    (G, "rows = torch.where(valid & (rows >= 0) & (rows < G), rows + self.row_base, -1)",
     "rows = torch.where(valid & (rows >= 0), rows + self.row_base, -1)",
     "CPU slots returned as GPU rows"),
    (G, "place_overflow=(fresh & ~ok).sum(),", "", "placement overflow not counted"),
    (P, "        self.entered.add_((move if assigned else move & (old <= 1)).sum())\n", "",
     "PB-LRU turnover never counted"),
]
TPF, BUF = "ulacache/tp.py", "ulacache/buffer.py"
STR = "ulacache/striping.py"  # what the striped modes share
TP_TESTS = ["tests/test_tp.py"]
TP_MUTANTS = [  # TP mode: the striped space and the local buffer, checked by tests/test_tp.py
    (TPF, "            b.touch(torch.where(first & hit, bslot, -1))\n", "",
     "buffer hits not pinned"),
    (BUF, "        self.map.erase(slot, old, evict, pos)\n", "", "an evicted copy stays mapped"),
    (TPF, "                self._count(gi, buffer_drops=b.drop(safe))", "                pass",
     "released addresses keep their copies"),
    (TPF, "            self.attn_rows(layer)[dst[keep]] = rows.to(self.device)[keep]", "",
     "a rewrite leaves the copies stale"),
    (TPF, "(owner, owner_slot, self.gpu_slots + 1 + got)",
     "(owner, owner_slot, self.gpu_slots + got)", "buffer rows off by one (onto scratch)"),
    (STR, "mine = inrange & (owner_rank(flat, self.P) == self.rank)",
     "mine = inrange & (owner_rank(flat, self.P) <= self.rank)", "ownership test widened"),
    (TPF, "want = first & theirs & ~hit & (owner_slot >= 0)",
     "want = theirs & ~hit & (owner_slot >= 0)", "a peer row fetched once per duplicate"),
    (TPF, "want = b.first(safe, theirs & stored[gi] & (b.lookup(safe) < 0))",
     "want = b.first(safe, theirs & (b.lookup(safe) < 0))",
     "peers copy a row its owner refused"),
    (BUF, "head[1:] = ranked[1:] != ranked[:-1]", "head[1:] = ranked[1:] >= ranked[:-1]",
     "the buffer's dedup keeps duplicates"),
    (BUF, "slot = torch.where(want, cand[rank.clamp(min=0)], -1)",
     "slot = torch.where(want, cand[rank.clamp(min=0) // 2], -1)",
     "two copies claim one buffer slot"),
]
F = "kernels/fused_access.py"
FUSED_TESTS = ["tests/test_fused_access.py"]
FUSED_MUTANTS = [  # the fused kernels, checked against the torch path by test_fused_access.py
    (F, "first = keep & (tl.load(claim + safe, mask=keep, other=-1) == i)", "first = keep",
     "fused: no dedup"),
    (F, "        tl.store(claim + safe, tl.full(safe.shape, NO_CLAIM, tl.int32), mask=first)\n",
     "", "fused: claim table left dirty"),
    (F, "            keep = inrange & (phys >= 0)\n            bad = ",
     "            keep = inrange\n            bad = ", "fused: unmapped addresses accessed"),
    (F, "        row = tl.where(cold, 1, row)\n", "", "fused: cold bit ignored"),
    (F, "tl.store(ring_of + slot, (tl.zeros_like(slot) + epoch_t % NB).to(tl.int16), mask=move)",
     "tl.store(ring_of + slot, (tl.zeros_like(slot) + (epoch_t + 1) % NB).to(tl.int16), mask=move)",
     "fused: ring stamp one epoch ahead"),
    (F, "tl.where(j == 1, 1, 2 + (epoch_t + j - 1) % NB))",
     "tl.where(j == 1, 1, 2 + (epoch_t - j + 1 + NB) % NB))",
     "fused: recent buckets in reverse order"),
    (F, "rank = run + tl.cumsum(want.to(tl.int32), 0) - 1",
     "rank = run + tl.cumsum(want.to(tl.int32), 0)", "fused: miss rank off by one"),
    (F, "            run += tl.sum(want.to(tl.int32))\n", "",
     "fused: ranks restart in every sub-block"),
    (F, "block_want + b, mask=b < pid, other=0", "block_want + b, mask=b <= pid, other=0",
     "fused: block prefix counts its own block"),
    (F, "sb = hb * HY + sb", "sb = hb * (HY - 1) + sb", "fused: hyper block offset"),
    (F, "hyp = sup // HY", "hyp = sup // (HY + 1)", "fused: hyper counts of the wrong block"),
    (F, "turned = move & (old <= 1)", "turned = move", "fused: re-touches counted as turnover"),
    (F, "tl.store(cpu_free + top + rank, cslot, mask=moved)",
     "tl.store(cpu_free + top + rank + 1, cslot, mask=moved)", "fused: push off by one"),
    (F, "pos = top - 1 - (rank - n_free)", "pos = top - (rank - n_free)",
     "fused: pop off by one"),
    (F, "ok = ok & (~occupied | remap | copy_out)", "ok = ok",
     "fused: placement ignores a failed spill"),
    (F, "                            tl.store(dp, out_row, mask=copy_out[:, None] & cm)\n", "",
     "fused: the victim's row is not written back"),
    (F, "moved = ok & ~occupied & ~keep  # the vacated", "moved = ok & ~keep  # the vacated",
     "fused: a vacated CPU slot freed after a swap"),
    (F, "rows = tl.where(keep & (rows >= 0) & (rows < G), rows + row_base, -1)",
     "rows = tl.where(keep & (rows >= 0), rows + row_base, -1)",
     "fused: CPU slots returned as GPU rows"),
]
FT = "kernels/fused_tp.py"
FUSED_TP_TESTS = ["tests/test_fused_tp.py", "-k", "every_operation"]
FUSED_TP_MUTANTS = [  # the fused TP gates and the striped own access, vs the torch TP path
    (F, "mine = striped & (raw % TPP == RANK)", "mine = striped & (raw % TPP <= RANK)",
     "fused TP: ownership test widened"),
    (FT, "want = first & theirs & ~hit & (oslot >= 0)", "want = first & theirs & ~hit",
     "fused TP: a fetch of a row its owner could not serve"),
    (FT, "entered, bslot, first & hit, W1, S1, H1, NB, HY, False)",
     "entered, bslot, first & hit & (bslot < 0), W1, S1, H1, NB, HY, False)",
     "fused TP: buffer hits not pinned"),
    (FT, "                map_erase(bmap, old, victim, evict, pos, NBK)\n", "",
     "fused TP: an evicted copy stays mapped"),
    (FT, "tl.where(fetch, G + 1 + victim, -1).to(tl.int32)",
     "tl.where(fetch, G + victim, -1).to(tl.int32)", "fused TP: the plan's rows off by one"),
    (FT, "oslot = tl.load(table + owner * n + i, mask=fetch, other=-1)",
     "oslot = tl.load(table + i, mask=fetch, other=-1)",
     "fused TP: the plan reads rank 0's slots"),
    (FT, "tl.where(theirs & (bslot >= 0), G + 1 + bslot, -1))",
     "tl.where(theirs & (bslot >= 0), G + bslot, -1))", "fused TP: buffer rows off by one"),
    (FT, "pending = pending & (prev != EMPTY) & (prev != key)",
     "pending = pending & (prev != EMPTY)",
     "fused TP: an address found in the claim hash probes on (duplicates both first)"),
    (FT, "        tl.store(keys + hs, tl.full(hs.shape, EMPTY, tl.int32), mask=first)\n", "",
     "fused TP: the claim hash keeps its keys (left dirty)"),
    (FT, "tl.atomic_min(vals + slot, i.to(tl.int32), mask=inrange, sem=\"relaxed\")",
     "tl.atomic_max(vals + slot, i.to(tl.int32), mask=inrange, sem=\"relaxed\")",
     "fused TP: the last occurrence claims, not the first"),
]
BM = "ulacache/bufmap.py"
BUFMAP_TESTS = ["tests/test_bufmap.py", "tests/test_fused_tp.py", "-k",
                "every_operation or map or bucket or refuses or drop"]
BUFMAP_MUTANTS = [  # the TP buffer's hash map, torch (vs a dict) and fused (vs torch)
    (BM, "& (pos != keep.unsqueeze(1)) & mask.unsqueeze(1)", "& mask.unsqueeze(1)",
     "an eviction also unmaps the slot's new address"),
    (BM, "got = pending & (rank < empties[:, -1])", "got = pending & (rank <= empties[:, -1])",
     "an insert into a full bucket overwrites an entry"),
    (BM, "way = (empties <= rank.unsqueeze(1)).sum(1)",
     "way = (empties < rank.unsqueeze(1)).sum(1)",
     "racing inserts take the same entry"),
    (BM, "match = live & (holder[torch.where(live, e, 0)] == a.unsqueeze(1))",
     "match = live & (holder[torch.where(live, e, 0)] >= 0)",
     "a lookup takes any held slot of the buckets"),
    (FT, "won = pending & (old == -1)", "won = pending",
     "fused map: an insert overwrites a taken entry"),
    (FT, "hit = mask[:, None] & (e == s[:, None]) & (p != keep[:, None])",
     "hit = mask[:, None] & (e == s[:, None])",
     "fused map: an eviction also unmaps the slot's new address"),
    (FT, "m2 = tl.max(tl.where((e2 >= 0) & (k2 == a[:, None]), e2, -1), axis=1)",
     "m2 = tl.max(tl.where((e2 >= 0) & (k2 == a[:, None]), e2, -1), axis=1) * 0 - 1",
     "fused map: the second bucket is never searched"),
    (BUF, "gone = (held >= 0) & member_of(held, safe)",
     "gone = (held >= 0) & ~member_of(held, safe)",
     "a long release drops the copies it should keep"),
    (BUF, "at = torch.searchsorted(ranked, values)",
     "at = torch.searchsorted(ranked, values, right=True)",
     "a long release misses the addresses it names"),
]
FP, FR = "kernels/fused_policy.py", "kernels/fused_release.py"
FUSED_ROUND_TESTS = ["tests/test_fused_policy.py"]
FUSED_ROUND_MUTANTS = [  # the fused round start and release, vs the torch policy and group
    (FP, "ring = 2 + epoch_n % NB", "ring = 2 + epoch_t % NB",
     "fused advance: a new epoch retires the newest row"),
    (FP, "go = entered >= bucket_fill\n        epoch_n",
     "go = entered > bucket_fill\n        epoch_n",
     "fused advance: epoch boundary"),
    (FP, "            tl.store(table + src * width + cols, tl.zeros_like(moved), mask=m)\n", "",
     "fused advance: the source row is not cleared"),
    (FP, "tl.store(sc + 2, tl.where(go, 0, entered))", "tl.store(sc + 2, entered)",
     "fused advance: turnover not reset on a new epoch"),
    (FP, "m = (cols < width) & move", "m = (cols < width - 1) & move",
     "fused advance: the last column of a row is not moved"),
    (FR, "first = inrange & (tl.load(claim + safe, mask=inrange, other=-1) == i)",
     "first = inrange", "fused release: no dedup"),
    (FR, "        tl.store(claim + safe, tl.full(safe.shape, NO_CLAIM, tl.int32), mask=first)\n",
     "", "fused release: claim table left dirty"),
    (FR, "on_cpu = drop & (phys >= G)", "on_cpu = drop & (phys > G)",
     "fused release: CPU slot 0 is not freed"),
    (FR, "rank = before + tl.cumsum(put.to(tl.int32), 0) - 1",
     "rank = before + tl.cumsum(put.to(tl.int32), 0)", "fused release: push off by one"),
    (FR, "mask=(b < pid) & (b < n_blocks)", "mask=(b <= pid) & (b < n_blocks)",
     "fused release: block prefix counts its own block"),
    (FR, "            tl.store(top0, tl.load(cpu_top))\n", "            pass\n",
     "fused release: no stack pointer snapshot"),
    (FR, "        tl.store(loc + safe, tl.full(safe.shape, -1, tl.int32), mask=drop)\n", "",
     "fused release: released rows stay mapped"),
]
H = "ulacache/space.py"
HOSTILE_TESTS = ["tests/test_hostile_calls.py", "tests/test_ipc.py", "-k", "not shm"]
HOSTILE_MUTANTS = [  # refusals that change nothing, and TP verdicts every rank shares
    (H, "            if self.validate:  # every group accepts before any group changes\n"
        "                for g in self.groups:\n                    g.check_place(addrs)\n", "",
     "a later group's refusal after an earlier group placed"),
    ("ulacache/cache.py", "for new in reversed(got):", "for new in got:",
     "a refused extend_batch reorders the free pages"),
    ("ulacache/cache.py", "        if req.n_tokens == 0:", "        if False:",
     "addresses of padding on an empty request"),
    (TPF, "self.n_local = -(-n_logical // self.P)", "self.n_local = n_logical // self.P",
     "TP: the last local position lost when P does not divide n"),
    (TPF, "            self.peers.fence()\n", "", "TP: no fence at the round start"),
    (TPF, "            g.check_write(layer, lpos, rows)  # shapes", "            pass  # shapes",
     "TP write: ranks write before the owner's verdict"),
    (STR, "            g.check_read(lpos)  # this rank's", "            pass  # this rank's",
     "TP read: an owner raises while its peers gather"),
    (TPF, '        check_out(out, addrs.shape, self.device, "plan")\n', "",
     "TP plan: a wrong out accepted"),
    (TPF, "dead = mine & (g.loc[torch.where(mine, lpos, g.n_logical)] < 0)",
     "dead = mine & False", "TP: a never-placed peer address counted peer_missing"),
    ("ulacache/ipc.py", 'if (m["shape"], m["dtype"]) != (ref["shape"], ref["dtype"]):',
     'if m["shape"] != ref["shape"]:', "open_peers: a dtype mismatch accepted"),
]
# Not listed: equivalent mutants (no observable change), e.g. PBLRU.touch moving a slot that is
# already in the current bucket to the current bucket again (the bit and count moves cancel);
# a placement handing back the stack slots of every remapped victim rather than of those that
# took one (the reclaim before it guarantees that every occupied victim takes one).

PIECES_TESTS = ["tests/test_core.py", "tests/test_fused_access.py", "-k",
                "chunked or scratch"]
PIECES_MUTANTS = [  # calls larger than the scratch, taken in pieces in one round
    (G, "                self.check_access(addrs)\n            return in_pieces",
     "                pass\n            return in_pieces",
     "chunked access: the whole call is not checked first"),
    (G, "                self._release_plan(addrs, check=True)\n            for chunk",
     "                pass\n            for chunk",
     "chunked release: the whole call is not checked first"),
    (G, "                self.check_place(addrs)\n            return torch.cat",
     "                pass\n            return torch.cat",
     "chunked place: the whole call is not checked first"),
    (G, "return list(addrs.reshape(-1).split(self.max_call))",
     "return list(addrs.reshape(-1).split(self.max_call + 1))",
     "pieces one entry larger than the scratch"),
]

DISTINCT_TESTS = ["tests/test_access_distinct.py"]
DISTINCT_MUTANTS = [  # a prefill table's one access on its distinct addresses
    (G, "mark = inrange & (p >= first) & (p % P == rank)",
     "mark = inrange & (p % P == rank)",
     "distinct: the sink page below 'first' is accessed"),
    (G, "mark = inrange & (p >= first) & (p % P == rank)",
     "mark = inrange & (p >= first)",
     "distinct: a TP rank lists its peers' addresses as its own"),
    (G, "    claim.fill_(NO_CLAIM)\n    return found, n_distinct, bad",
     "    return found, n_distinct, bad", "distinct: the claim table is left dirty"),
    (G, "        bad += ((p != -1) & ~inrange).sum()", "        bad += (~inrange).sum()",
     "distinct: padding counted as out of range"),
    (H, "size = min(self.config.gpu_slots, table.numel())",
     "size = min(self.config.gpu_slots - 1, table.numel())",
     "DP access_distinct keeps one row fewer than the pool"),
    (TPF, "        bound = self.gpu_slots + self.buffer_slots\n",
     "        bound = self.buffer_slots\n", "TP access_distinct bounded by the buffer alone"),
]

STRIPE_TESTS = ["tests/test_stripe.py", "tests/test_fused_tp.py", "-k",
                "not per_rank_memory and (dcp or stateful or merge or refusals or production)"]
SP, RM = "ulacache/stripe.py", "ulacache/oracle/refmodel.py"
STRIPE_MUTANTS = [  # DCP TP mode: each rank's stripe, the partial attention and its merge
    (STR, "        return flat, inrange, mine, torch.where(mine, local_position(flat, self.P), -1)",
     "        return flat, inrange, mine, torch.where(inrange, local_position(flat, self.P), -1)",
     "DCP: a rank accesses its peers' addresses at their local positions"),
    (SP, "        return self.peers.agree(own <= self.gpu_slots)",
     "        return own <= self.gpu_slots",
     "DCP: each rank splits a prefill into its own rounds (no agreement)"),
    (SP, "                if flat[inrange].unique().numel() != int(inrange.sum()):\n"
         "                    raise AddressError(\"release: duplicate addrs\")",
     "                pass", "DCP: a duplicate release refused by its owner only"),
    (SP, "stripe=(self.P, self.rank, self.n_logical), verdicts=False)",
     "stripe=(self.P, self.rank, self.n_logical))",
     "DCP fused: a dead own address reads the buffered mode's -2 verdict"),
    (RM, "        return (positions >= 0) & (torch.remainder(positions, self.size) == self.rank)",
     "        return torch.remainder(positions, self.size) == self.rank",
     "DCP: the last rank attends the -1 padding as a row"),
    (RM, "    total = w.sum(0)\n", "    total = w.amax(0)\n",
     "DCP merge: partials normalised by the largest weight, not their sum"),
    (RM, "    lse = torch.logsumexp(s, dim=-1)\n", "    lse = s.amax(-1)\n",
     "DCP: a rank reports its largest score as its log-sum-exp"),
    (SP, "        return max(owned_counts(seq_lens, self.P))\n",
     "        return -(-sum(seq_lens) // self.P)\n",
     "DCP stage: a batch admitted by its tokens over P, not the largest rank's share"),
    ("ulacache/prefill.py", "            space.verdict(check)", "            check()",
     "DCP stage: a refusal only one rank sees (its own rows past the stage) raised there alone"),
    (SP, "            self._agree(check)\n        return self.local.gather",
     "            check()\n        return self.local.gather",
     "DCP stage: an own dead address refused by its owner alone"),
]

SHADOW_TESTS = ["tests/test_shadows.py", "tests/test_stateful.py", "tests/test_core.py", "-k",
                "not fused and not tight or reclaim"]
SHADOW_MUTANTS = [  # evictions without write-back, torch path
    (G, "keep = ok & ~swap if self.shadows", "keep = ok if self.shadows",
     "shadows: a swapped-out slot also kept as the promoted row's shadow"),
    (G, "cidx = torch.where(phys >= G, phys - G, torch.where(had >= 0, had, self.cpu_slots))",
     "cidx = torch.where(phys >= G, phys - G, self.cpu_slots)",
     "shadows: a write leaves the shadow stale"),
    (G, "shadowed = on_gpu & (had >= 0)  # the row's shadow", "shadowed = on_gpu & (had > 0)  #",
     "shadows: release keeps a shadow in CPU slot 0"),
    (G, "take = live & (torch.cumsum(live, 0) <= short)",
     "take = live & (torch.cumsum(live, 0) < short)", "shadows: reclaim one short"),
    (G, "        self.shadow.index_put_((torch.where(take, order, G),),\n",
     "        (\n", "shadows: a reclaimed shadow stays in the table"),
    (G, "remap = owned & (had >= 0)  # the victim's shadow", "remap = owned & (had > 0)  #",
     "shadows: a shadow in CPU slot 0 never used"),
    (G, "rewrites=(copy_out & (had == WAS_ON_CPU)).sum())",
     "rewrites=(copy_out & (had < 0)).sum())", "shadows: first write-backs counted as rewrites"),
    (G, "        self.shadow.index_put_((torch.where(ok, slot, G),),\n", "        (\n",
     "shadows: a placed row inherits its victim's shadow"),
    (G, "by_age = torch.sort(older.to(torch.int8), stable=True).indices",
     "by_age = torch.sort((~older).to(torch.int8), stable=True).indices",
     "shadows: reclaim takes the oldest shadows first"),
    (G, "last = torch.where(take & older, scan[by_age], -1).max()",
     "last = torch.where(take, scan[by_age], -1).max()",
     "shadows: recent reclaims move the cursor too"),
]
FUSED_SHADOW_TESTS = ["tests/test_shadows.py", "-k", "fused or tight"]
FUSED_SHADOW_MUTANTS = [  # the same in the kernels, vs the torch path
    (F, "keep = ok & ~swap  # the vacated", "keep = ok  # the vacated",
     "fused shadows: a swapped-out slot kept as a shadow"),
    (F, "dest = base + before + tl.cumsum(back.to(tl.int64), 0) - 1",
     "dest = base + before + tl.cumsum(back.to(tl.int64), 0)",
     "fused shadows: a handed-back slot one position off"),
    (F, "take = live & (rank <= short)", "take = live & (rank < short)",
     "fused shadows: reclaim one short"),
    (FR, "shadowed = on_gpu & (had >= 0)", "shadowed = on_gpu & (had > 0)",
     "fused shadows: release keeps a shadow in CPU slot 0"),
    (F, "                    tl.store(shadow + vs, tl.full(vs.shape, -1, tl.int32), mask=ok)\n",
     "", "fused shadows: a placed row inherits its victim's shadow"),
    (F, "        tl.store(block_back + pid, 0)\n", "",
     "fused shadows: hand-back counts carried over from the last call"),
    (F, "want = (inr & older) if second == 1 else (inr & ~older)",
     "want = (inr & ~older) if second == 1 else (inr & older)",
     "fused shadows: reclaim takes the oldest shadows first"),
    (F, "older = age >= RECENT", "older = age >= RECENT - 1",
     "fused shadows: only this round's rows count as recent"),
]

INTERFACE_TESTS = ["tests/test_core_interface.py"]
INTERFACE_MUTANTS = [  # the mode differences the seam asks the core, and the pool's rows
    (H, "        return sum(seq_lens) <= self.config.gpu_slots",
     "        return sum(seq_lens) < self.config.gpu_slots",
     "DP prefill_fits refuses a batch that exactly fills the pool"),
    (TPF, "sum(seq_lens) - min(own) <= self.buffer_slots",
     "sum(seq_lens) - max(own) <= self.buffer_slots",
     "TP prefill_fits counts the peers' share of the rank owning most"),
    (H, "        worst = requests * steps * (top_k + 1)\n        if self.config.gpu_slots",
     "        worst = requests * steps * top_k\n        if self.config.gpu_slots",
     "DP step capacity forgets the new token"),
    ("ulacache/layout.py", "return -(-(self.page + self.core_rows) // self.page) * self.page",
     "return (self.page + self.core_rows) // self.page * self.page",
     "pool rows rounded down: the scratch row or buffer cut off"),
]

PREFILL_TESTS = ["tests/test_prefill.py"]
PRE, DRV = "ulacache/prefill.py", "ulacache/oracle/driver.py"
PREFILL_MUTANTS = [  # a prefill longer than the pool: rounds of query spans, or the stage
    (PRE, "            if space.round_fits(addrs[start:mid]):",
     "            if space.round_fits(addrs[start:mid + 1]):",
     "bisection keeps a span one too long"),
    (H, "        return flat[flat >= 0].unique().numel() <= self.config.gpu_slots",
     "        return flat[flat >= 0].unique().numel() < self.config.gpu_slots",
     "DP round_fits refuses a span that exactly fills the pool"),
    (TPF, "distinct.numel() - int(own.min()) <= self.buffer_slots",
     "distinct.numel() - int(own.max()) <= self.buffer_slots",
     "TP round_fits counts the peers' rows of the rank owning most"),
    (DRV, "            space.begin_round()\n            out[a:b]", "            out[a:b]",
     "spans served in one round (the earlier spans' rows stay pinned)"),
    # (the sink entries below `first` are never among the distinct addresses, so dropping
    # `src >= first` here is equivalent; the DISTINCT suite mutates the marking instead)
    (PRE, "keys = torch.where(found >= 0, found, n)", "keys = found",
     "the stage searches its padding (-1, last) as if the keys were sorted"),
    (G, "gather_rows(self.pools.cpu[li: li + 1], torch.where(on_cpu, phys - G, -1), dst,",
     "gather_rows(self.pools.cpu[li: li + 1], torch.where(on_cpu, phys, -1), dst,",
     "stage reads CPU rows at their mapping entry, not their CPU slot"),
    (PRE, "dst = self.row_base + torch.arange(self.capacity, device=found.device)",
     "dst = torch.arange(self.capacity, device=found.device)",
     "stage writes over the engine's rows below row_base"),
    (PRE, "            hit = keep & (keys[at] == src)\n",
     "            hit = keep & (keys[at] <= src)\n",
     "an address the stage does not hold takes its neighbour's row"),
    (PRE, "            rows.copy_(torch.where(hit, rows_of[at], -1))",
     "            rows.copy_(torch.where(hit, rows_of[at] + 1, -1))", "stage rows off by one"),
    (PRE, "rows_of = torch.where(gathered, dst, -1)",
     "rows_of = dst",
     "production: an address the stage could not take reads a stale row"),
    (TPF, "merged = torch.sort(torch.where(merged >= 0, merged, self.n_logical)).values[:size]",
     "merged = torch.where(merged >= 0, merged, self.n_logical)[:size]",
     "TP stage: the ranks' lists taken unsorted (rank 0's only)"),
    (G, "        return on_cpu.sum(), (phys >= 0) & (dst_rows >= 0)",
     "        return on_cpu.sum(), dst_rows >= 0",
     "production: a dead address counted as gathered (its stage row stale)"),
]
SGLANG_STAGE_TESTS = ["tests/test_sglang_stage.py"]  # run with the SGLang venv's python
SGLANG_STAGE_MUTANTS = [  # the SGLang seam of the prefill stage
    ("patches/classes.py", "batch.forward_mode.is_target_verify() or", "False or",
     "a verify batch is staged"),
    ("patches/sglang_allocator.py",
     "if not self.prefill_fits(lens) or not self.core.prefill_fits(new):",
     "if not self.prefill_fits(lens):", "a staged batch's new tokens may outgrow the pool"),
    ("patches/sglang_pool.py", "self._stage_verdict = chunk + self.page_size <= G",
     "self._stage_verdict = chunk <= G", "no page of slack for a chunk's rounding"),
    ("patches/sglang_pool.py",
     "return self.usable_stage() is not None and not self.core.prefill_fits(seq_lens)",
     "return self.usable_stage() is not None", "every prefill batch staged"),
]

PREFETCH_TESTS = ["tests/test_prefetch.py", "tests/test_prefetch_shared.py"]
PREFETCH_MUTANTS = [  # the look-ahead prefetch: its mechanism, the engine's order, the replay
    (G, "        self.policy.admit(victim)\n        promoted = ok.sum()",
     "        self.policy.touch(victim)\n        promoted = ok.sum()",
     "prefetched rows admitted hot (a wrong guess outlives the access's own rows)"),
    (G, "        budget.sub_(promoted)", "        budget.sub_(0 * promoted)",
     "the fetch cap never spent"),
    (P, "        self._move_bits(s, old, torch.ones_like(s), move)\n",
     "        self._move_bits(s, old, torch.full_like(s, 2), move)\n",
     "PB-LRU admits into a ring row, not the cold one"),
    ("ulacache/prefetch.py",
     "            self._log(\"wait\", group)\n            self._wait(group)",
     "            self.fence()", "an access waits for every group's prefetch, not its own"),
    ("ulacache/tools/replay.py",
     "        cache.extend_batch(dict.fromkeys(range(requests), 1))\n"
     "        if engine is not None:  # after placement: its victims would be the cold "
     "prefetched rows\n            engine.round_started()\n",
     "        if engine is not None:  # after placement: its victims would be the cold "
     "prefetched rows\n            engine.round_started()\n"
     "        cache.extend_batch(dict.fromkeys(range(requests), 1))\n",
     "prefetches issued before the step's placements evict themselves"),
    (G, "        layers = slice(0, 1) if defer else slice(None)",
     "        layers = slice(0, 2) if defer else slice(None)",
     "a deferred access also moves layer 1, which its replay then moves again"),
    ("ulacache/prefetch.py", "            for li in range(first, last + 1):",
     "            for li in range(first, last):",
     "a layer's wait replays the layers before it but not its own"),
]

SGLANG_STRIPE_TESTS = ["tests/test_sglang_tp_stripe.py"]  # the SGLang venv's python
SGLANG_STRIPE_MUTANTS = [  # index-K striped by page under SGLang (stripe_index_k)
    ("ulacache/index_stripe.py",
     "return torch.where(self.owner(loc // ps) == self.rank, self.local_rows(loc), trash)",
     "return self.local_rows(loc)", "other ranks' tokens written over owned rows"),
    ("patches/sglang_index_stripe.py",
     "            tps.all_reduce_sum(self.stripe.group, t.view(torch.int32))", "            pass",
     "the prefill read without the group's sum"),
    ("ulacache/index_stripe.py", "mine = live & (self.owner(pages_) == self.rank)",
     "mine = live", "the prefill read takes pages the rank does not own"),
    ("patches/sglang_index_stripe.py",
     "width=None if self.pages_cycle else table.shape[1])",
     "width=None)",
     "balanced-width tables over pages that do not cycle (pages dropped)"),
    ("patches/sglang_index_stripe.py",
     "width=None if self.pages_cycle else table.shape[1])",
     "width=table.shape[1])",
     "page-classed tables kept at the replicated width (W, not ceil(W / P))"),
    ("patches/sglang_index_stripe.py", "        lengths = self.get_seqlens_expanded()\n",
     "        lengths = self.stripe_view.lengths\n", "the merge masks by local lengths"),
    ("patches/sglang_index_stripe.py", "self.stripe.all_gather, by_score=True)",
     "self.stripe.all_gather)", "the merged top-k handed over ascending, not in score order"),
    ("ulacache/indexer.py", "largest=True, sorted=True).values)",
     "largest=False, sorted=True).values)", "score order reversed (lowest winner first)"),
]

SGLANG_DCP_TESTS = ["tests/test_sglang_dcp.py"]  # the SGLang venv's python
PD = "patches/sglang_dcp.py"
SGLANG_DCP_MUTANTS = [  # mode "dcp" under SGLang: pool, sizing, override, FlashMLA branch
    ("patches/sglang_pool.py", "            self.dcp_replicated = True\n",
     "            pass\n", "DCP: SGLang's MLA write localizes ulacache's rows a second time"),
    ("patches/sglang_pool.py", "                attended &= addrs % self.ula_tp.size == "
     "self.ula_tp.rank", "                pass",
     "DCP: the prefill check expects peers' selections resident"),
    (PD, "(lse[:, :heads, 0].float() * LOG2_E)", "(lse[:, :heads, 0].float())",
     "DCP: FlashMLA's natural-log LSE handed to SGLang's base-2 merge"),
    (PD, "    wrong = {k: v for k, v in chosen.items() if v not in (None, DCP_BACKEND)}",
     "    wrong = {k: v for k, v in chosen.items() if v not in (None, DCP_BACKEND, 'trtllm')}",
     "DCP: the trtllm backends (which bypass the coordinator) accepted"),
    ("patches/sglang_sizing.py", "        self._cell_size -= (dcp_size() - 1) * "
     "self._compute_dsa_indexer_cell_size(", "        self._cell_size -= dcp_size() * "
     "self._compute_dsa_indexer_cell_size(", "DCP sizing: index-K taken back once too often"),
    ("patches/sglang_sizing.py", "        n //= dcp_size()\n", "        pass\n",
     "DCP: the logical capacity widened twice"),
    ("patches/launch.py", "    return -(-tokens // tp_size) if opts.mode == \"dcp\" else tokens",
     "    return tokens", "DCP: every rank's stage sized for the whole batch (P x its share)"),
]

SGLANG_CLASSES_TESTS = ["tests/test_sglang_page_classes.py"]  # the SGLang venv's python
PC = "patches/sglang_page_classes.py"
SGLANG_CLASSES_MUTANTS = [  # the page-classed logical allocator (stripe_index_k)
    (PC, "            cls = k % P\n", "            cls = (k + 1) % P\n",
     "classes: a position's page drawn from the next class"),
    (PC, "reps[(r - k0) % P::P]", "reps[r % P::P]",
     "classes: a segment freed from an unaligned page returns pages to the wrong class"),
    (PC, "return self.classes * self.page_size * min(self.class_free_counts())",
     "return self.page_size * sum(self.class_free_counts())",
     "classes: available_size reports every free page, not what every class can serve"),
    (PC, "need[c] += (n - (c - first) % P + P - 1) // P", "need[c] += (n - c % P + P - 1) // P",
     "classes: a class's draw counted from position 0, not the request's first new page"),
    (PC, "            self.class_free[c] = self.class_free[c][need[c]:]\n", "",
     "classes: drawn pages left on their free lists"),
]

CONFTEST = '''
from hypothesis import Phase
settings.register_profile("mutation", derandomize=True, deadline=None,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("mutation")
'''


def main() -> int:
    missed = 0
    with tempfile.TemporaryDirectory(prefix="ulacache-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache"))
        with open(copy / "tests" / "conftest.py", "a") as f:
            f.write(CONFTEST)
        env = {**os.environ, "PYTHONPATH": str(copy)}
        suites = {"core": [(*m, TESTS) for m in MUTANTS],
                  "tp": [(*m, TP_TESTS) for m in TP_MUTANTS],
                  "fused": [(*m, FUSED_TESTS) for m in FUSED_MUTANTS],
                  "fused_tp": [(*m, FUSED_TP_TESTS) for m in FUSED_TP_MUTANTS],
                  "bufmap": [(*m, BUFMAP_TESTS) for m in BUFMAP_MUTANTS],
                  "fused_round": [(*m, FUSED_ROUND_TESTS) for m in FUSED_ROUND_MUTANTS],
                  "hostile": [(*m, HOSTILE_TESTS) for m in HOSTILE_MUTANTS],
                  "pieces": [(*m, PIECES_TESTS) for m in PIECES_MUTANTS],
                  "distinct": [(*m, DISTINCT_TESTS) for m in DISTINCT_MUTANTS],
                  "stripe": [(*m, STRIPE_TESTS) for m in STRIPE_MUTANTS],
                  "interface": [(*m, INTERFACE_TESTS) for m in INTERFACE_MUTANTS],
                  "prefill": [(*m, PREFILL_TESTS) for m in PREFILL_MUTANTS],
                  "sglang_stage": [(*m, SGLANG_STAGE_TESTS) for m in SGLANG_STAGE_MUTANTS],
                  "sglang_stripe": [(*m, SGLANG_STRIPE_TESTS) for m in SGLANG_STRIPE_MUTANTS],
                  "sglang_dcp": [(*m, SGLANG_DCP_TESTS) for m in SGLANG_DCP_MUTANTS],
                  "sglang_classes": [(*m, SGLANG_CLASSES_TESTS) for m in
                                     SGLANG_CLASSES_MUTANTS],
                  "shadows": [(*m, SHADOW_TESTS) for m in SHADOW_MUTANTS],
                  "fused_shadows": [(*m, FUSED_SHADOW_TESTS) for m in FUSED_SHADOW_MUTANTS],
                  "prefetch": [(*m, PREFETCH_TESTS) for m in PREFETCH_MUTANTS]}
        args, only = sys.argv[1:], []
        while "-k" in args:  # -k TEXT: only the mutants whose description contains TEXT
            i = args.index("-k")
            if i + 1 == len(args):
                print("usage: -k needs a text")
                return 2
            only.append(args[i + 1])
            del args[i: i + 2]
        chosen = args or list(suites)
        if set(chosen) - set(suites):
            print(f"usage: python tests/mutants.py [{' | '.join(suites)}] ... [-k TEXT] ...")
            return 2
        todo = [m for name in chosen for m in suites[name]
                if not only or any(t in m[3] for t in only)]
        for path, old, new, what, tests in todo:
            target = copy / path
            src = target.read_text()
            if src.count(old) != 1:
                print(f"STALE  {what}: the original line is not in {path} exactly once")
                missed += 1
                continue
            target.write_text(src.replace(old, new))
            t0 = time.time()
            try:
                caught = all(subprocess.run(
                    [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                    cwd=copy, env=env, capture_output=True, timeout=1200).returncode != 0
                    for _ in range(2))
            finally:
                target.write_text(src)
            missed += not caught
            print(f"{'caught' if caught else 'MISSED'} {what} ({time.time() - t0:.0f} s)",
                  flush=True)
    total = len(todo)
    print(f"{total - missed} of {total} mutants caught by every run")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
