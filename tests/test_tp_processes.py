"""TP mode in real processes: P = 2 and P = 4 spawned CPU processes joined by a gloo group,
pools shared through POSIX shared memory (:class:`ulacache.ipc.ShmPeers`), each running the
reference DSA-MLA model over its rank of the striped cache with the sharded indexer. Every
step's logits, attention outputs, top-k and chosen tokens must equal the rank's own fully
resident single-rank run, for bf16 and FP8 rows and per-layer and shared selection groups,
with promotions, buffer evictions and peer reads on every step.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 8
VARIANTS = [("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, P: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    from tests.test_tp import PROMPTS, tp_config
    from ulacache.ipc import ShmPeers
    from ulacache.oracle.driver import run_equality
    from ulacache.oracle.refmodel import ModelGeometry

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=P)
    try:
        results = {}
        for layout, lpi in VARIANTS:
            geom = ModelGeometry.tiny(layout=layout, layers_per_indexer=lpi)
            with ShmPeers() as peers:
                rep = run_equality(geom, tp_config(geom, P), PROMPTS, STEPS, peers=peers)
            results[f"{layout}-{lpi}"] = {
                "mismatches": rep.mismatches[:5], "steps": rep.steps,
                "moved": {k: rep.moved_per_step[k] for k in
                          ("promotions", "peer_fetches", "buffer_evictions", "buffer_hits",
                           "buffer_overflow", "peer_missing", "access_overflow")}}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("P", [2, 4])
def test_tp_processes_decode_equals_resident(P, tmp_path):
    mp.spawn(_rank_main, args=(P, _free_port(), str(tmp_path)), nprocs=P, join=True)
    for rank in range(P):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(results) == sorted(f"{a}-{b}" for a, b in VARIANTS)
        for name, res in results.items():
            assert res["mismatches"] == [], (rank, name, res["mismatches"])
            assert res["steps"] == STEPS
            moved = res["moved"]
            for what in ("promotions", "peer_fetches", "buffer_evictions"):
                assert all(v > 0 for v in moved[what]), (rank, name, what, moved[what])
            for what in ("buffer_overflow", "peer_missing", "access_overflow"):
                assert sum(moved[what]) == 0, (rank, name, what)
