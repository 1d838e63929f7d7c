"""The PB-LRU vs LRU benchmark runs end to end at toy sizes and keeps its JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pblru_vs_lru_json_contract():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pblru_vs_lru.py"), "--json", "--sizes", "10,12",
         "--batch", "4", "--topk", "64", "--history", "4096", "--steps", "6", "--warmup", "1",
         "--buckets", "4"],
        capture_output=True, text=True, check=True, timeout=300)
    rows = json.loads(out.stdout)["rows"]
    assert [r["slots"] for r in rows] == [1024, 4096]
    for r in rows:
        assert set(r) == {"slots"} | {f"{p}_{m}" for p in ("pblru", "lru") for m in
                                      ("ms_per_step", "policy_ms_per_step", "hit_rate", "misses")}
        for p in ("pblru", "lru"):
            assert r[f"{p}_ms_per_step"] >= r[f"{p}_policy_ms_per_step"] > 0
            assert 0 < r[f"{p}_hit_rate"] < 1 and r[f"{p}_misses"] > 0


def test_trace_misses_json_contract():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trace_misses.py"),
         str(ROOT / "tests" / "fixtures" / "typing-py-1024-k64.trace.npz"), "--layers", "0",
         "--sizes", "512", "--json", "--buckets", "64"],
        capture_output=True, text=True, check=True, timeout=300)
    res = json.loads(out.stdout)
    assert res["layers"] == [0]
    misses = {v: by["512"] for v, by in res["misses"].items()}
    assert set(misses) == {"lru", "pblru", "pblru_per_round"}
    # the recorded figures of docs/benchmarks.md for this layer (64 buckets, as recorded)
    assert misses == {"lru": 54, "pblru": 55, "pblru_per_round": 181}


def test_trace_misses_compares_bucket_counts():
    """``--compare-buckets N`` replaces the per-round column by PB-LRU at N buckets (the
    figures of docs/benchmarks.md for this layer: 32 buckets, 53 misses)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trace_misses.py"),
         str(ROOT / "tests" / "fixtures" / "typing-py-1024-k64.trace.npz"), "--layers", "0",
         "--sizes", "512", "--json", "--buckets", "64", "--compare-buckets", "32"],
        capture_output=True, text=True, check=True, timeout=300)
    misses = {v: by["512"] for v, by in json.loads(out.stdout)["misses"].items()}
    assert misses == {"lru": 54, "pblru": 55, "pblru_32_buckets": 53}


def test_tp_control_json_contract():
    """Owner-held vs replicated control metadata: replication multiplies the ops and the
    metadata by P (fixed-shape code), owner-held exchanges the int32 slot tables."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tp_control.py"), "--json", "--tp", "2,4",
         "--steps", "3", "--gpu-slots", "256"],
        capture_output=True, text=True, check=True, timeout=300)
    rows = json.loads(out.stdout)["rows"]
    assert [r["P"] for r in rows] == [2, 4]
    for r in rows:
        o, p = r["owner"], r["replicated"]
        assert p["ops_per_step"] == r["P"] * o["ops_per_step"] > 0
        assert p["metadata_bytes"] == r["P"] * o["metadata_bytes"]
        assert o["exchange_bytes"] == 2 * (r["P"] - 1) * r["bs"] * r["k"] * 4
        assert o["ms_per_step"] > 0 and p["ms_per_step"] > 0


def test_index_stripe_width_json_contract():
    """Classed tables are ceil(W / P) pages wide, balanced (every rank exactly its share), and
    their logits one P-th of a plain allocator's; the plain tables' slowest rank holds more
    than its share."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "index_stripe_width.py"), "--json", "--requests",
         "4", "--pages", "96", "--ranks", "4", "--top-k", "256", "--repeats", "1"],
        capture_output=True, text=True, check=True, timeout=300)
    row = json.loads(out.stdout)
    assert row["classed"]["table_pages"] == 24 and row["plain"]["table_pages"] == 96
    assert row["classed"]["slowest_rank_pages_over_share"] == 1.0
    assert row["plain"]["slowest_rank_pages_over_share"] > 1.0
    assert row["ratios"]["logits_bytes"] == 0.25
    assert row["classed"]["rank_candidates_ms"] > 0 and row["plain"]["rank_candidates_ms"] > 0
    # the merge's all-gather: 4 rows x 256 x 8 B sent by each rank, 3 peers' received
    assert row["exchange"]["payload_bytes_per_rank"] == 4 * 256 * 8
    assert row["exchange"]["recv_bytes_per_rank"] == 3 * 4 * 256 * 8
    assert row["exchange"]["merge_ms"] > 0
