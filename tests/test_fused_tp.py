"""TP mode on the fused path against TP mode on the torch path.

Each rank's step over a group is then 4 launches of its own access (over the global
addresses), 1 launch of the gates' claims, the all-gather, and 3 launches of the gates
(kernels/fused_tp.py). Two runs of simulated ranks (threads) make the same seeded sequence of
placements, writes, plans, loads and releases, one per path; after every operation each rank's
local groups, buffers (map, holders, PB-LRU state), TP counters, plans, returned rows and pool
bytes must be equal. The reference model then decodes bit-identically through the fused path.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.fused_helpers import state  # noqa: E402
from tests.test_tp import PROMPTS, assert_busy_equal, tp_config  # noqa: E402
from ulacache.config import UlaCacheConfig  # noqa: E402
from ulacache.ipc import run_ranks  # noqa: E402
from ulacache.kernels import fused_tp  # noqa: E402
from ulacache.oracle.driver import run_equality  # noqa: E402
from ulacache.oracle.refmodel import ModelGeometry  # noqa: E402
from ulacache.tp import TP_COUNTERS, TPAddressSpace  # noqa: E402


def test_gate_counter_columns_match():
    for name, col in fused_tp.TP_COUNTER_COLUMNS.items():
        assert TP_COUNTERS[col] == name


def snapshot(space: TPAddressSpace) -> dict[str, torch.Tensor]:
    out = {}
    for gi, g in enumerate(space.groups):
        out.update({f"g{gi}.{k}": v.clone() for k, v in state(g).items()})
        b = space.buffers[gi]
        p = b.policy
        out.update({f"b{gi}.map": b.map.dense(b.n_logical, b.holder),
                    f"b{gi}.holder": b.holder.clone(),
                    f"b{gi}.bits": p.bits[:, : p.n_words].clone(),
                    f"b{gi}.rows": p.row_counts[:, 0].clone(),
                    f"b{gi}.hyper": p.hyper_counts[:, : p.n_hyper].clone(),
                    f"b{gi}.round_of": p.round_of.clone(), f"b{gi}.ring_of": p.ring_of.clone(),
                    f"b{gi}.entered": p.entered.clone(),
                    f"b{gi}.epoch_t": p.epoch_t.clone(), f"b{gi}.round_t": p.round_t.clone(),
                    f"b{gi}.counts": p.counts[:, : p.n_words].clone(),
                    f"storage{gi}": space.storage[gi][:, : space.gpu_slots].clone()})
        plan = space._plans[gi]
        if plan is not None:
            keep = plan.dst_row >= 0  # the torch plan keeps -1 where nothing is fetched
            out[f"plan{gi}"] = torch.stack([plan.src_rank, plan.src_slot, plan.dst_row])[:, keep]
            out[f"buffer_rows{gi}"] = space.storage[gi][:, space.gpu_slots + 1:].clone()
    out["tp_counters"] = space.tp_counters.clone()
    # the fused gates' claim hash is clean after every call (the torch path has none)
    out["claims_clean"] = torch.tensor(space.gate_claims_clean())
    return out


def drive(path: str, P: int, seed: int, shared: bool) -> list[list[tuple[str, object]]]:
    """One run of ``P`` ranks on ``path``; per rank, the list of (operation, result and
    snapshot) after every operation."""
    cfg = UlaCacheConfig(layout="tiny", row_bytes=24, n_layers=2,
                         layers_per_group=2 if shared else 1, gpu_slots=24, cpu_slots=80,
                         n_buckets=3, tp_size=P, buffer_slots=20, validate=False,
                         access_path=path, page_size=P * 4)
    N = 400

    def body(peers):
        space = TPAddressSpace(cfg, peers, n_logical=N)
        gen = torch.Generator().manual_seed(seed)  # same draws on every rank and both paths
        live: list[int] = []
        log = []

        def rand(hi, n):
            return torch.randint(0, hi, (n,), generator=gen)

        for step in range(10):
            space.begin_round()
            new = rand(N, 12)
            new[0] = new[1]  # a duplicate (invalid, masked)
            slots = space.place(new)
            fresh = sorted(set(new.tolist()) - set(live))
            for layer in range(cfg.n_layers):
                rows = (torch.arange(len(fresh) * 24, dtype=torch.int64).view(-1, 24) * 7
                        + layer + step).to(torch.uint8)
                space.write(layer, torch.tensor(fresh, dtype=torch.int64), rows)
            live += fresh
            log.append(("place", slots.clone(), snapshot(space)))
            for _ in range(2):
                pick = torch.tensor(live)[rand(len(live), 3 * 16)].view(3, 16)
                pick[0, :4] = -1
                pick[1, 0] = N + 5  # out of range: masked, counted
                dtype = (torch.int32, torch.int64)[step % 2]
                rows = space.access(0, pick.to(dtype))
                if not shared:
                    space.access(1, pick.to(dtype))
                log.append(("access", rows.clone(), snapshot(space)))
            if step % 3 == 2:
                gone = torch.tensor(live[:5])
                space.release(gone)
                live = live[5:]
                log.append(("release", None, snapshot(space)))
        for g in space.groups:
            g.check_integrity()
        for b in space.buffers:
            b.check_integrity()
        return log

    return run_ranks(P, body)


@pytest.mark.parametrize("P,shared,seed", [(2, True, 0), (2, False, 1), (4, True, 2)])
def test_tp_fused_matches_torch_every_operation(P, shared, seed):
    ref, fused = drive("torch", P, seed, shared), drive("fused", P, seed, shared)
    for rank in range(P):
        assert len(ref[rank]) == len(fused[rank])
        for i, ((op, r_out, r_state), (_, f_out, f_state)) in enumerate(zip(ref[rank],
                                                                          fused[rank])):
            where = f"rank {rank}, operation {i} ({op})"
            if r_out is not None:
                assert torch.equal(r_out, f_out), f"{where}: results differ"
            assert r_state.keys() == f_state.keys(), where
            for k in r_state:
                assert torch.equal(r_state[k], f_state[k]), f"{where}: {k} differs"
    moved = ref[0][-1][2]["tp_counters"].sum(0)
    names = dict(zip(TP_COUNTERS, moved.tolist()))
    assert names["peer_fetches"] and names["buffer_hits"] and names["buffer_evictions"]


def test_tp_fused_decode_equals_resident():
    """The reference DSA-MLA model decodes bit-identically through TP ranks on the fused
    path (a shared indexer group, FP8 rows; promotions, peer fetches, buffer evictions on
    every step)."""
    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=2)
    cfg = tp_config(geom, 2, access_path="fused")
    reports = run_ranks(2, lambda peers: run_equality(geom, cfg, PROMPTS, 6, peers=peers))
    assert_busy_equal(reports, 2, 6, (sum(PROMPTS) + 4 * 6) / 2)


# -- DCP TP mode (ulacache.stripe): the DP kernels over the global addresses, no gates --------
def drive_dcp(path: str, P: int, seed: int, device: str = "cpu", steps: int = 10
              ) -> list[list[tuple[str, object]]]:
    """:func:`drive` for the stripe space: place / write / access / release with duplicates,
    padding, out-of-range and released addresses in the accesses (validate off); results and
    state on the host whatever ``device`` ran them."""
    from ulacache.stripe import StripeAddressSpace

    cfg = UlaCacheConfig(layout="tiny", row_bytes=24, n_layers=2, layers_per_group=1,
                         gpu_slots=24, cpu_slots=80, n_buckets=3, tp_size=P,
                         tp_attention="dcp", validate=False, access_path=path,
                         page_size=P * 4)
    N = 400

    def body(peers):
        space = StripeAddressSpace(cfg, peers, n_logical=N)
        gen = torch.Generator().manual_seed(seed)
        live: list[int] = []
        gone: list[int] = []
        log = []

        def rand(hi, n):
            return torch.randint(0, hi, (n,), generator=gen)

        def snap():
            out = {f"g{gi}.{k}": v.cpu().clone() for gi, g in enumerate(space.groups)
                   for k, v in state(g).items()}
            out["storage"] = torch.stack([space.attn_rows(layer).cpu() for layer in range(2)])
            return out

        dev = space.device

        for step in range(steps):
            space.begin_round()
            new = rand(N, 6 * P)
            new[0] = new[1]
            slots = space.place(new.to(dev)).cpu()
            fresh = sorted(set(new.tolist()) - set(live) - set(gone))
            for layer in range(cfg.n_layers):
                rows = (torch.arange(len(fresh) * 24, dtype=torch.int64).view(-1, 24) * 7
                        + layer + step).to(torch.uint8)
                space.write(layer, torch.tensor(fresh, dtype=torch.int64, device=dev),
                            rows.to(dev))
            live += fresh
            log.append(("place", slots.clone(), snap()))
            for _ in range(2):
                pick = torch.tensor(live)[rand(len(live), 3 * 16)].view(3, 16)
                pick[0, :4] = -1
                pick[1, 0] = N + 5  # out of range: -1 and counted invalid on every rank
                if gone:
                    pick[2, 0] = gone[0]  # released: -1, counted invalid by its owner
                dtype = (torch.int32, torch.int64)[step % 2]
                rows = torch.stack([space.access(0, pick.to(dev, dtype)),
                                    space.access(1, pick.to(dev, dtype))]).cpu()
                log.append(("access", rows.clone(), snap()))
            if step % 3 == 2:
                space.release(torch.tensor(live[:5], device=dev))
                gone += live[:5]
                live = live[5:]
                log.append(("release", None, snap()))
        space.check_integrity()
        return log

    return run_ranks(P, body, device=device)


@pytest.mark.parametrize("P,seed,steps", [(2, 0, 10), (4, 1, 10)])
def test_dcp_fused_matches_torch_every_operation(P, seed, steps):
    ref, fused = drive_dcp("torch", P, seed, steps=steps), drive_dcp("fused", P, seed,
                                                                   steps=steps)
    for rank in range(P):
        assert len(ref[rank]) == len(fused[rank])
        for i, ((op, r_out, r_state), (_, f_out, f_state)) in enumerate(zip(ref[rank],
                                                                          fused[rank])):
            where = f"rank {rank}, operation {i} ({op})"
            if r_out is not None:
                assert torch.equal(r_out, f_out), f"{where}: results differ"
                assert op != "access" or int(f_out.min()) >= -1  # no buffered-TP verdicts
            for k in r_state:
                assert torch.equal(r_state[k], f_state[k]), f"{where}: {k} differs"
        counters = ref[rank][-1][2]["g0.counters"]
        from ulacache.group import COUNTERS

        named = dict(zip(COUNTERS, counters.tolist()))
        assert named["promotions"] and named["spills"] and named["invalid"], (rank, named)


@pytest.mark.gpu
def test_dcp_fused_on_a_gpu_matches_torch_on_cpu():
    """bench/device_check.sh: the DCP access's fused kernels compiled for the GPU (threads as
    ranks on one device) leave every table, row and result equal to the torch path's on CPU
    after every operation."""
    ref, gpu = drive_dcp("torch", 2, 3), drive_dcp("fused", 2, 3, device="cuda")
    for rank in range(2):
        for i, ((op, r_out, r_state), (_, g_out, g_state)) in enumerate(zip(ref[rank],
                                                                          gpu[rank])):
            if r_out is not None:
                assert torch.equal(r_out, g_out), (rank, i, op)
            for k in r_state:
                assert torch.equal(r_state[k], g_state[k]), (rank, i, op, k)


def test_dcp_fused_decode_matches_resident():
    from tests.test_stripe import PROMPTS as DCP_PROMPTS
    from tests.test_stripe import assert_close_and_busy, dcp_config

    geom = ModelGeometry.tiny(layout="fp8", layers_per_indexer=2)
    cfg = dcp_config(geom, 2, access_path="fused")
    reports = run_ranks(2, lambda peers: run_equality(geom, cfg, DCP_PROMPTS, 3, peers=peers))
    assert_close_and_busy(reports, 3, (sum(DCP_PROMPTS) + 4 * 3) / 2)
