"""bench/decode_sweep.py: end to end at toy sizes, the locality generator against its real-trace
calibration targets, capacity/admission at equal memory, determinism with a seed."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import load_bench

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "typing-py-1024-k64.trace.npz"
GPL3 = ROOT / "ulacache" / "tools" / "data" / "gpl3.trace.npz"


ds = load_bench("decode_sweep")
TINY = dict(k=64, h_slots=128, gpu_rows=4000, host_rows=60000, steps=6, layers=4, buckets=8)


def _requests(n=40, max_input=3000, max_output=8):
    rng = np.random.default_rng(1)
    return [ds.Request(i, 0.0, int(rng.integers(200, max_input)), int(rng.integers(2, max_output)))
            for i in range(n)]


@pytest.fixture(scope="module")
def model():
    from ulacache.tools.traces import load_trace

    return ds.calibrate(load_trace(FIXTURE), layers=4, iters=3)


def test_end_to_end_writes_csv_md_json(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode_sweep.py"), "--json", "--quiet",
         "--levels", "2,4", "--steps", "5", "--requests", "40", "--k", "64", "--h-slots", "128",
         "--gpu-rows", "4000", "--host-rows", "60000", "--layers", "4", "--buckets", "8",
         "--max-input", "3000", "--max-output", "8", "--trace", str(FIXTURE), "--no-png",
         "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=120)
    res = json.loads(out.stdout)
    assert {"config", "locality", "rows", "peak_tokens_per_s", "peak_ratios"} <= set(res)
    assert {"ulacache/hisparse", "ulacache/resident"} <= set(res["peak_ratios"])
    with open(tmp_path / "decode_sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == ds.CSV_COLUMNS
    assert [(int(r["concurrency"]), r["policy"]) for r in rows] == [
        (c, p) for c in (2, 4) for p in ds.POLICIES]
    for r in rows:
        assert 0 <= float(r["gpu_hit_rate"]) <= 1
        assert float(r["step_ms"]) > 0 and float(r["tokens_per_s"]) > 0
        assert int(r["overflow"]) == 0
    md = (tmp_path / "decode_sweep.md").read_text()
    assert "| concurrency | policy |" in md and "Peak-throughput ratios" in md


def test_generator_reproduces_calibration_targets_on_real_trace():
    from ulacache.tools.traces import load_trace

    trace = load_trace(GPL3)
    m = ds.calibrate(trace, layers=6, iters=4, seed=0)
    pos = trace.positions.astype(np.int64)
    got = ds.trace_targets(ds.generate(m, trace.k, pos, seed=123)[None], pos, trace.k)
    assert abs(got["recent_share"] - m.recent_share) < 0.02
    assert abs(got["sink_prob"] - m.sink_prob) < 0.03
    assert abs(got["overlap"] - m.overlap) < 0.02
    assert np.abs(np.array(got["old_hist"]) - np.array(m.old_hist)).sum() < 0.25
    # the targets are the trace's own figures (not degenerate)
    assert 0.3 < m.recent_share < 0.9 and 0.3 < m.overlap < 0.95 and m.sink_prob > 0.5


def test_generator_scaled_selections_are_valid(model):
    gen = ds.SelectionGen(model, 2048, np.random.default_rng(0))
    for p in (100, 2047, 40000, 40001, 40002):
        s = gen.step(p)
        assert s.size == min(2048, p + 1) and np.unique(s).size == s.size
        assert s.min() >= 0 and s.max() == p


def test_resident_admits_fewer_at_equal_memory(model):
    cfg = ds.Config(**TINY)
    reqs = _requests()
    adm = {p: ds.run_level(p, 16, cfg, reqs, model)["admitted_max"] for p in ds.POLICIES}
    assert adm["resident"] < adm["ulacache"] and adm["resident"] < adm["hisparse"]
    # capacity rules themselves
    r = ds.Request(0, 0.0, 3000, 100)
    assert not ds.capacity_ok("resident", cfg, 1, 1000, r)
    assert ds.capacity_ok("ulacache", cfg, 1, 1000, r)
    assert ds.capacity_ok("hisparse", cfg, 1, 1000, r)
    assert not ds.capacity_ok("hisparse", cfg, cfg.gpu_rows // (cfg.h_slots + 64), 0, r)
    assert not ds.capacity_ok("ulacache", cfg, cfg.gpu_rows // (cfg.k + 1), 0, r)


def test_tiered_policies_miss_when_history_exceeds_gpu(model):
    cfg = ds.Config(**TINY)
    rows = {p: ds.run_level(p, 16, cfg, _requests(), model) for p in ds.POLICIES}
    assert rows["resident"]["gpu_hit_rate"] == 1.0 and rows["resident"]["pcie_mb_per_step"] == 0
    assert rows["hisparse"]["gpu_hit_rate"] < 1.0 and rows["hisparse"]["h2d_mb_per_step"] > 0
    assert rows["ulacache"]["ula_launches_per_step"] > 0


def test_launch_counts_are_the_real_paths():
    """The fused path's counts are its kernels (1 round start for all groups; 4 + 4 + 3 per
    group), the torch path's its aten ops (dozens per group); neither syncs the host."""
    fused = ds.count_launches("fused", 61)
    assert fused == {"round": 1, "place": 4, "access": 4, "release": 3, "syncs": 0}
    torch_path = ds.count_launches("torch", 61)
    assert torch_path["round"] > 61 * 10 and torch_path["access"] > 100
    cfg = ds.Config(layers=61, launch_us=2.0)
    assert ds.ula_control_seconds(cfg, fused, False) == pytest.approx((1 + 61 * 8) * 2e-6)
    assert ds.ula_control_seconds(cfg, fused, True) == pytest.approx((1 + 61 * 11) * 2e-6)


def test_deterministic_with_seed(model):
    cfg = ds.Config(**TINY)
    timing = {"cpu_ctl_ms_per_step"}
    a = ds.sweep(cfg, [4], _requests(), model, progress=False)["rows"]
    b = ds.sweep(cfg, [4], _requests(), model, progress=False)["rows"]
    strip = [{k: v for k, v in r.items() if k not in timing} for r in a]
    assert strip == [{k: v for k, v in r.items() if k not in timing} for r in b]
    g1 = ds.generate(model, 64, np.arange(500, 700), seed=5)
    g2 = ds.generate(model, 64, np.arange(500, 700), seed=5)
    g3 = ds.generate(model, 64, np.arange(500, 700), seed=6)
    assert np.array_equal(g1, g2) and not np.array_equal(g1, g3)
