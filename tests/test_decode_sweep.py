"""bench/decode_sweep.py: end to end at toy sizes, the locality generator against its real-trace
calibration targets, capacity/admission at equal memory, determinism with a seed."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import load_bench
from ulacache.tools.launches import fused_countable

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


def _without_triton(tmp_path: Path) -> dict:
    """An environment in which ``import triton`` fails, as after ``pip install -e '.[test]'``."""
    blocker = tmp_path / "no_triton"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None\n")
    return {**os.environ, "PYTHONPATH": str(blocker)}


@pytest.mark.parametrize("triton", [True, False], ids=["with-triton", "without-triton"])
def test_end_to_end_writes_csv_md_json(tmp_path, triton):
    """Without Triton the sweep still runs: the fused path is not counted (the markdown says
    so) and ulacache is timed on the torch path."""
    if triton and not fused_countable():
        pytest.skip("counting the fused path needs Triton: pip install 'ulacache[cuda]'")
    env = None if triton else _without_triton(tmp_path)
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode_sweep.py"), "--json", "--quiet",
         "--levels", "2,4", "--steps", "5", "--requests", "40", "--k", "64", "--h-slots", "128",
         "--gpu-rows", "4000", "--host-rows", "60000", "--layers", "4", "--buckets", "8",
         "--max-input", "3000", "--max-output", "8", "--trace", str(FIXTURE), "--no-png",
         "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=120, env=env)
    res = json.loads(out.stdout)
    assert set(res["ula_launch_counts"]) == ({"fused", "torch"} if triton else {"torch"})
    assert res["config"]["ula_path"] == ("fused" if triton else "torch")
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
    assert ("fused path's launches were not counted" in md) is not triton


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
    if not fused_countable():
        pytest.skip("counting the fused path needs Triton: pip install 'ulacache[cuda]'")
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


def test_sparse_mla_stand_in_matches_a_dense_reference():
    """The torch sparse-MLA stand-in (dequantised FP8 rows, masked rows skipped) equals a
    per-request loop over the valid rows."""
    import torch

    dr = load_bench("decode_rows")
    gen = torch.Generator().manual_seed(0)
    n, R, k, H = 50, 3, 7, 2
    lat = (torch.randn(n, 512, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(n, 4, generator=gen) + 0.5
    rope = torch.randn(n, 64, generator=gen).to(torch.bfloat16)
    pool = torch.cat([lat.view(torch.uint8), scale.view(torch.uint8), rope.view(torch.uint8)],
                     1).unsqueeze(0)
    assert pool.shape == (1, n, dr.ROW_BYTES)
    rows = torch.randint(0, n, (R, k), generator=gen)
    rows[1, 4:] = -1
    q = torch.randn(R, H, 576, generator=gen).to(torch.bfloat16)
    out = dr.sparse_mla(q, pool, rows)
    deq = (lat.to(torch.float32).view(n, 4, 128) * scale.unsqueeze(-1)).view(n, 512)
    for r in range(R):
        idx = rows[r][rows[r] >= 0]
        key = torch.cat([deq[idx], rope[idx].float()], 1)
        p = torch.softmax(q[r].float() @ key.T / 576 ** 0.5, -1)
        ref = p @ deq[idx]
        assert torch.allclose(out[r].float(), ref, atol=0.05, rtol=0.05)


def test_hisparse_real_rows_land_where_the_model_says():
    """HiSparse's data movement with real rows: after each step every selected position's
    row is in the request's device buffer at the slot the model chose (rows encode their
    host row), and the newest token's backup reaches the mirror."""
    import torch

    from ulacache.tools.hisparse import RESERVED_SLOTS, HiSparseBuffer

    dr = load_bench("decode_rows")
    H, k, ctx = 16, 8, 60
    real = dr.RealRows("hisparse", torch.device("cpu"), 2 * (H + RESERVED_SLOTS), 200, H,
                       RESERVED_SLOTS, 2, k)
    real.host[0, :200, :8] = torch.arange(200, dtype=torch.int64).view(-1, 1).view(torch.uint8)
    real.host[0, 60:80], real.host[0, 160:180] = 0, 0  # decoded later: backed up by the steps
    host_rows = [np.arange(0, 80), np.arange(100, 180)]
    bufs = [HiSparseBuffer(H), HiSparseBuffer(H)]
    for i, rows in enumerate(host_rows):
        real.hisparse_admit(i, rows)
    rng = np.random.default_rng(1)
    for step in range(12):
        p = ctx + step
        sels = [np.sort(rng.choice(p, k - 1, replace=False)).tolist() + [p] for _ in bufs]
        sels = [np.array(s) for s in sels]
        for b, s in zip(bufs, sels):
            b.step(s, p)
        prev = -1 if step == 0 else p - 1  # the prompt is mirrored; later tokens back up
        real.hisparse_step([0, 1], host_rows, sels, bufs, [prev, prev])
        for i in range(2):  # the forward writes the newest token's row into the reserved slot
            real.pool[0, i * real.stride + H, :8] = torch.tensor(
                [int(host_rows[i][p])]).view(torch.uint8)
        for i, (b, s) in enumerate(zip(bufs, sels)):
            others = s != p  # the newest token's row is written by the forward, not loaded
            slots = i * real.stride + b.last_slots[others]
            got = real.pool[0, torch.from_numpy(slots), :8].contiguous().view(torch.int64)
            got = got.view(-1)
            assert torch.equal(got, torch.from_numpy(host_rows[i][s[others]])), (step, i)
    assert len(real.seconds) == 12


def test_real_rows_sweep_measures_every_policy(model):
    """--real-rows on CPU (tiny): every policy's steps move and read real rows and are timed;
    the simulated figures are the same as without real rows (same decisions)."""
    base = dict(TINY, heads=2, steps=5)
    plain = ds.sweep(ds.Config(**base), [4], _requests(), model, progress=False)
    real = ds.sweep(ds.Config(**base, real_rows=True), [4], _requests(), model, progress=False)
    for a, b in zip(plain["rows"], real["rows"]):
        assert b["measured_layer_ms"] > 0 and b["tokens_per_s_measured"] > 0, b["policy"]
        for key in ("gpu_hit_rate", "h2d_mb_per_step", "admitted_mean", "overflow"):
            assert a[key] == b[key], (b["policy"], key)
    assert "measured ulacache/hisparse" in real["peak_ratios"]
    assert "Measured peak ratios" in ds.markdown(real)
