"""bench/decode_sweep.py: the equal-bytes sweep end to end at toy sizes, SGLang's admission
rules for each policy, the pools from the capacity accounting, the shared selection and HiSparse
caches, retraction, the locality generator against its real-trace calibration targets,
determinism with a seed, and the real-rows path."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import load_bench
from ulacache.tools import capacity
from ulacache.tools.launches import fused_countable

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "typing-py-1024-k64.trace.npz"
GPL3 = ROOT / "ulacache" / "tools" / "data" / "gpl3.trace.npz"


ds = load_bench("decode_sweep")
TINY = dict(k=64, h_slots=128, gpu_rows=4000, host_rows=16000, steps=6, warmup=2, layers=4,
            buckets=8, page=4)


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
    """The whole pipeline at 1/32 size: two tunings a side, two seeds. Without Triton the
    sweep still runs: the fused path is not counted (the markdown says so) and ulacache is
    timed on the torch path."""
    if triton and not fused_countable():
        pytest.skip("counting the fused path needs Triton: pip install 'ulacache[cuda]'")
    env = None if triton else _without_triton(tmp_path)
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode_sweep.py"), "--json", "--quiet",
         "--levels", "2,4", "--steps", "5", "--warmup", "2", "--seeds", "2", "--scale", "32",
         "--requests", "40", "--hs-buffers", "4096", "--hs-ratios", "2,4", "--ula-ratios",
         "2,4", "--wb-ratios", "2,4", "--pf-ratios", "2,4", "--max-input", "3000",
         "--max-output", "64", "--trace", str(FIXTURE), "--no-png", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=300, env=env)
    res = json.loads(out.stdout)
    assert set(res["ula_launch_counts"]) == ({"fused", "torch"} if triton else {"torch"})
    assert res["config"]["ula_path"] == ("fused" if triton else "torch")
    assert set(res["best"]) == {"ulacache", "ulacache_wb", "ulacache_pf", "hisparse",
                                "resident"}
    assert len(res["tunings"]) == 2 + 2 + 2 + 2 + 1
    assert "ulacache_pf/hisparse tokens_per_s" in res["peak_ratios"]
    assert "ulacache_pf/ulacache tokens_per_s" in res["peak_ratios"]
    assert "ulacache/ulacache_wb tokens_per_s" in res["peak_ratios"]
    assert "ulacache_wb/hisparse tokens_per_s" in res["peak_ratios"]
    for key in ("ulacache/hisparse tokens_per_s", "ulacache/hisparse tokens_per_s_duplex",
                "ulacache/hisparse tokens_per_s_overlap", "ulacache/resident tokens_per_s"):
        v = res["peak_ratios"][key]
        assert len(v["per_seed"]) == 2 and v["min"] <= v["mean"] <= v["max"]
    # each column tuned apart: its best tuning holds the seed-0 maximum of that column
    for system, by_metric in res["best_by_metric"].items():
        seed0 = [r for r in res["rows"] if r["seed"] == 0 and r["policy"] == system]
        for metric, label in by_metric.items():
            assert max(r[metric] for r in seed0 if r["tuning"] == label) == \
                max(r[metric] for r in seed0)
        assert res["peaks"][system][0]["tokens_per_s_overlap"] == \
            max(r["tokens_per_s_overlap"] for r in seed0)
    with open(tmp_path / "decode_sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == ds.CSV_COLUMNS
    assert {r["seed"] for r in rows} == {"0", "1"}
    for r in rows:
        assert 0 <= float(r["gpu_hit_rate"]) <= 1 and int(r["steps"]) == 5
        assert int(r["admitted_max"]) <= int(r["concurrency"])  # --max-running-requests
        assert float(r["step_ms"]) > 0 and float(r["tokens_per_s"]) > 0
        assert int(r["overflow"]) == 0
        # overlap >= duplex >= serial: each hides more of the same transfers
        assert float(r["tokens_per_s_overlap"]) >= float(r["tokens_per_s_duplex"]) - 1e-6
        assert float(r["tokens_per_s_duplex"]) >= float(r["tokens_per_s"]) - 1e-6
    md = (tmp_path / "decode_sweep.md").read_text()
    assert "Peak ratios over seeds" in md and "Favours:" in md and "(best)" in md
    assert ("fused path's launches were not counted" in md) is not triton


def test_worker_processes_give_the_same_figures(tmp_path):
    """``--jobs 2`` (forked workers, each generating the selections it needs) gives exactly
    the rows, bests and ratios of a serial run: a request's selections depend only on (seed,
    request), not on which runs came first in the process."""
    got = []
    for jobs in (1, 2):
        out = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "decode_sweep.py"), "--json", "--quiet",
             "--jobs", str(jobs), "--levels", "2,4", "--steps", "5", "--warmup", "2",
             "--seeds", "2", "--scale", "32", "--requests", "40", "--hs-buffers", "4096",
             "--hs-ratios", "2,4", "--ula-ratios", "2,4", "--policies",
             "ulacache,hisparse,resident", "--max-input", "3000", "--max-output", "64",
             "--trace", str(FIXTURE), "--no-png", "--out", str(tmp_path / str(jobs))],
            capture_output=True, text=True, check=True, timeout=300)
        got.append(json.loads(out.stdout))
    serial, forked = got
    assert len(serial["rows"]) == len(forked["rows"]) > 0
    wall = "cpu_ctl_ms_per_step"  # the control plane's CPU time: measured, never equal
    for a, b in zip(serial["rows"], forked["rows"]):
        assert {k: v for k, v in a.items() if k != wall} == \
            {k: v for k, v in b.items() if k != wall}
    assert serial["best"] == forked["best"]
    assert serial["peak_ratios"] == forked["peak_ratios"]


def test_real_rows_cli_reports_the_measured_ratio(tmp_path):
    """``--real-rows`` (as bench/device_check.sh runs it, here on CPU at 1/32 size): every
    level is measured and the JSON carries the measured ratio device_summary.py prints."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode_sweep.py"), "--json", "--quiet",
         "--real-rows", "--device", "cpu", "--heads", "2", "--scale", "32", "--seeds", "1",
         "--hs-buffers", "4096", "--hs-ratios", "4", "--ula-ratios", "2", "--wb-ratios", "2",
         "--levels", "2",
         "--steps", "3", "--warmup", "1", "--requests", "20", "--max-input", "3000",
         "--max-output", "64", "--trace", str(FIXTURE), "--no-png", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=300)
    res = json.loads(out.stdout)
    assert res["peak_ratios"]["measured ulacache/hisparse"] > 0
    assert all(r["tokens_per_s_measured"] > 0 for r in res["rows"])
    assert "measured ulacache/hisparse" in (tmp_path / "decode_sweep.md").read_text()


def test_equal_bytes_pools_are_the_capacity_accounting():
    """Every system gets the same device and host bytes; its pools are what the capacity
    accounting (SGLang's sizing) gives it, at full size and divided by the scale."""
    base = ds.Config(scale=8)
    seen = set()
    for t in (ds.Tuning("hisparse", 4, 3072), ds.Tuning("ulacache", 4), ds.Tuning("resident")):
        cfg, charge = ds.equal_bytes(base, "h200", "dsv32", t, 64)
        seen.add((charge["kv_bytes"], charge["host_bytes"]))
        inp = ds.budget_inputs("h200", "dsv32", t.h_slots or 4096)
        want = {"hisparse": capacity.hisparse_pool(inp, 4),
                "ulacache": capacity.ulacache_dp_pool(inp, 4, running=64),
                "resident": capacity.resident_pool(inp)}[t.system]
        assert cfg.gpu_rows == want and cfg.host_rows == t.ratio * want
        assert (cfg.k, cfg.layers, cfg.row_bytes) == (2048, 61, 656)
        small = cfg.scaled(8)
        assert (small.k, small.gpu_rows, small.page) == (256, want // 8, 8)
        assert (charge["uncharged_gpu_bytes"] > 0) == (t.system != "resident")
    assert len(seen) == 1  # one budget


def test_admission_follows_sglang(model):
    """HiSparse: ``min(logical, device)`` free, buffers of ``min(pages(len), H)`` or ``H +
    page``; ulacache: unique room, the prompt within the GPU pool; both charge the running
    requests' remaining output x the new-token ratio; a page per request starting one."""
    cfg = ds.Config(**TINY)
    hs, ula = ds.Memory("hisparse", cfg), ds.Memory("ulacache", cfg)
    assert hs.buffer(10) == 12 and hs.buffer(124) == 124 and hs.buffer(125) == 132
    assert hs.buffer(5000) == 132

    def live(pos, left, rid=0):
        return ds._Live(ds.Request(rid, 0.0, pos, left), pos, left, pos)

    running = [live(1000, 4), live(50, 4, 1)]
    assert hs.free(running) == min(16000 - 1000 - 52, 4000 - 132 - 52)
    assert ula.free(running) == 4000 + 16000 - 1000 - 52
    assert not ula.admits([], 4001, 1, 0.7)  # the prompt must fit the GPU pool (prefill)
    assert ula.admits([], 3000, 1, 0.7)
    # the device binds HiSparse: a prompt the device cannot hold while it prefills waits
    assert not hs.admits(running, 3813, 1, 0.0) and ula.admits(running, 3813, 1, 0.0)
    assert hs.admits(running, 3810, 1, 0.0)
    # the running requests' remaining output is charged at the ratio
    big = [live(100, 3000)]
    small = ds.Memory("ulacache", replace(cfg, host_rows=2000))  # 6000 unique
    assert small.admits(big, 3900, 1, 0.0) and not small.admits(big, 3900, 1, 1.0)
    assert ds.level_refused("ulacache", cfg, 4000 // 65 + 1) and \
        not ds.level_refused("ulacache", cfg, 4000 // 65)
    full = [live(4, 1, i) for i in range(4)]  # every request starts a page now
    assert ds.Memory("resident", replace(cfg, gpu_rows=16 + 16)).decode_room(full)
    assert not ds.Memory("resident", replace(cfg, gpu_rows=16 + 15)).decode_room(full)


def test_selection_and_hisparse_caches_replay_a_live_stream(model):
    """The caches return exactly what a request's own generator and buffer produce, whatever
    order runs ask in."""
    from ulacache.tools.hisparse import HiSparseBuffer

    sel = ds.SelectionCache(model, 64, seed=3)
    hc = ds.HiSparseCache(sel)
    gen = ds.SelectionGen(model, 64, np.random.default_rng([3, 7]))
    buf = HiSparseBuffer(128)
    for p in range(300, 340):
        want = gen.step(p)
        assert np.array_equal(sel.get(7, p), want)
        assert hc.get(128, 7, 300, p) == buf.step(want, p)
    first = ds.SelectionGen(model, 64, np.random.default_rng([3, 7])).step(300)
    assert np.array_equal(sel.get(7, 300), first)  # earlier positions stay readable
    with pytest.raises(ValueError, match="precedes"):
        sel.get(7, 299)


def test_retraction_keeps_the_core_consistent(model):
    """A unique pool too small for the admitted requests' outputs: decode steps retract the
    newest requests, their rows are released and re-placed on readmission; the core never
    overflows and stays consistent."""
    # scale 64: the estimate clips each request's output at 4096 / 64 = 64 tokens, so eight
    # requests of 200 + 400 tokens are admitted into 2400 unique slots and outgrow them
    cfg = ds.Config(**{**TINY, "gpu_rows": 1200, "host_rows": 1200, "steps": 150, "warmup": 0,
                       "scale": 64})
    reqs = [ds.Request(i, 0.0, 200, 400) for i in range(8)]
    row = ds.run_level("ulacache", 8, cfg, reqs, model)
    assert row["retracted"] > 0 and row["overflow"] == 0 and row["tokens_per_s"] > 0
    hs = ds.run_level("hisparse", 8, replace(cfg, host_rows=2400), reqs, model)
    assert hs["overflow"] == 0


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


def test_tiered_policies_miss_when_history_exceeds_gpu(model):
    cfg = ds.Config(**TINY)
    rows = {p: ds.run_level(p, 16, cfg, _requests(), model) for p in ds.SYSTEMS}
    assert rows["resident"]["gpu_hit_rate"] == 1.0 and rows["resident"]["h2d_mb_per_step"] == 0
    assert rows["hisparse"]["gpu_hit_rate"] < 1.0 and rows["hisparse"]["h2d_mb_per_step"] > 0
    assert rows["ulacache"]["ula_launches_per_step"] > 0
    # HiSparse writes back one row per request per step; ulacache its evicted rows
    assert rows["hisparse"]["d2h_mb_per_step"] > 0
    # shadows change nothing on the GPU side (hits, promotions, admission), only the D2H:
    # rows written back a second time
    on, off = rows["ulacache"], rows["ulacache_wb"]
    for key in ("gpu_hit_rate", "h2d_mb_per_step", "admitted_mean", "finished"):
        assert on[key] == off[key], key
    assert off["d2h_evict_mb_per_step"] > 0
    assert on["d2h_evict_mb_per_step"] < 0.5 * off["d2h_evict_mb_per_step"]
    assert on["d2h_mb_per_step"] < off["d2h_mb_per_step"]


def test_draft_prefetch_moves_misses_off_the_critical_path(model):
    """ulacache_pf: the same launch and admission as ulacache; with every draft accepted the
    access's misses (critical-path H2D) mostly become prefetches; with none, the prediction
    is the previous step's selection, which is resident: almost nothing moves. The draft's
    query doubles the attention, and prefetch bytes the step's compute cannot hide are on the
    step (a slow link)."""
    cfg = ds.Config(**TINY)
    base = ds.run_level("ulacache", 16, cfg, _requests(), model)
    exact = ds.run_level("ulacache_pf", 16, replace(cfg, acceptance=1.0), _requests(), model)
    never = ds.run_level("ulacache_pf", 16, replace(cfg, acceptance=0.0), _requests(), model)
    assert exact["admitted_mean"] == base["admitted_mean"]
    assert exact["h2d_mb_per_step"] < 0.5 * base["h2d_mb_per_step"]
    assert exact["prefetch_mb_per_step"] > 0.5 * base["h2d_mb_per_step"]
    assert exact["gpu_hit_rate"] > base["gpu_hit_rate"]
    assert never["prefetch_mb_per_step"] < 0.2 * exact["prefetch_mb_per_step"]
    assert exact["attn_ms"] == pytest.approx(2 * base["attn_ms"], rel=0.05)
    assert base["prefetch_mb_per_step"] == 0 and base["prefetch_excess_ms"] == 0
    slow = ds.run_level("ulacache_pf", 16, replace(cfg, acceptance=1.0, pcie_gbs=0.01),
                        _requests(), model)
    assert slow["prefetch_excess_ms"] > 0
    capped = ds.run_level("ulacache_pf", 16, replace(cfg, acceptance=1.0, fetch_cap=0),
                          _requests(), model)
    assert capped["prefetch_mb_per_step"] == 0
    assert capped["h2d_mb_per_step"] == pytest.approx(base["h2d_mb_per_step"])


def test_duplex_time_follows_the_measured_factor():
    """Factor 1.0 is serial, 2.0 (and no measurement) the ideal max(H2D, D2H); in between the
    paired bytes cost 2 / F each."""
    cfg = ds.Config(pcie_gbs=1.0)  # 1 GB/s: seconds = GB
    h, d = 3e9, 1e9
    assert ds.duplex_seconds(cfg, h, d) == pytest.approx(3.0)
    assert ds.duplex_seconds(replace(cfg, duplex_factor=2.0), h, d) == pytest.approx(3.0)
    assert ds.duplex_seconds(replace(cfg, duplex_factor=1.0), h, d) == pytest.approx(4.0)
    assert ds.duplex_seconds(replace(cfg, duplex_factor=1.6), h, d) == pytest.approx(2 / 1.6 + 2)


def test_other_time_is_a_roofline_over_the_batch():
    cfg = ds.Config()
    weights = cfg.weights_gb / (cfg.hbm_tbs * 1e3)
    assert ds.other_seconds(cfg, 1) == pytest.approx(weights)
    big = 4096
    assert ds.other_seconds(cfg, big) == pytest.approx(
        big * 2 * cfg.active_params_b * 1e9 / (cfg.mlp_tflops * 1e12))
    assert ds.other_seconds(replace(cfg, other_ms=20.0), 500) == pytest.approx(0.02)


def test_launch_counts_are_the_real_paths():
    """The fused path's counts are its kernels (1 round start for all groups; 4 + 4 + 3 per
    group), the torch path's its aten ops (dozens per group); neither syncs the host."""
    if not fused_countable():
        pytest.skip("counting the fused path needs Triton: pip install 'ulacache[cuda]'")
    fused = ds.count_launches("fused", 61)
    assert fused == {"round": 1, "place": 4, "access": 4, "release": 3, "prefetch": 4,
                     "syncs": 0}
    torch_path = ds.count_launches("torch", 61)
    assert torch_path["round"] > 61 * 10 and torch_path["access"] > 100
    cfg = ds.Config(layers=61, launch_us=2.0)
    assert ds.ula_control_seconds(cfg, fused, False) == pytest.approx((1 + 61 * 8) * 2e-6)
    assert ds.ula_control_seconds(cfg, fused, True) == pytest.approx((1 + 61 * 11) * 2e-6)


def test_deterministic_with_seed(model):
    cfg = ds.Config(**TINY)
    timing = {"cpu_ctl_ms_per_step"}
    for policy in ds.SYSTEMS:
        a = ds.run_level(policy, 4, cfg, _requests(), model)
        b = ds.run_level(policy, 4, cfg, _requests(), model)
        assert {k: v for k, v in a.items() if k not in timing} == \
            {k: v for k, v in b.items() if k not in timing}
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
    with pytest.raises(ValueError, match="simulated only"):
        ds.run_level("ulacache_pf", 4, ds.Config(**base, real_rows=True), _requests(), model)
    for policy in (p for p in ds.SYSTEMS if p != "ulacache_pf"):
        a = ds.run_level(policy, 4, ds.Config(**base), _requests(), model)
        b = ds.run_level(policy, 4, ds.Config(**base, real_rows=True), _requests(), model)
        assert b["measured_layer_ms"] > 0 and b["tokens_per_s_measured"] > 0, policy
        for key in ("gpu_hit_rate", "h2d_mb_per_step", "admitted_mean", "overflow"):
            assert a[key] == b[key], (policy, key)
