"""bench/access_bench.py at toy sizes (on CPU the fused kernels run in Triton's interpreter):
the JSON contract, launches per group-step, fused == reference on every step, the measured hit
rate, a mismatch or an extra launch turning the exit status to 1, and bad arguments refused
with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import load_bench

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "access_bench.py"
TINY = ["--k", "32", "--pools", "64", "--steps", "2", "--warmup", "1", "--no-hisparse"]


ab = load_bench("access_bench")


def test_json_contract_subprocess():
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", "--batches", "1,4",
                          "--hit-rates", "0.75,0.99", "--pools", "128", "--k", "32",
                          "--steps", "2", "--warmup", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["ok"] is True
    assert set(res["env"]) >= {"device", "torch", "triton", "date", "git_commit"}
    cells = res["cells"]
    assert [(c["batch"], c["hit_target"]) for c in cells] == \
        [(1, 0.75), (1, 0.99), (4, 0.75), (4, 0.99)]
    for c in cells:
        assert c["identical"] is True and c["mismatch"] is None and c["error"] is None
        assert c["launches_per_step"] <= 4
        n = c["batch"] * c["k"]
        assert c["accesses_per_step"] == n and c["access_overflow"] == 0
        assert c["hit_measured"] == pytest.approx(round(c["hit_target"] * n) / n, abs=1e-6)
        assert c["promotions_per_step"] == n - round(c["hit_target"] * n)
        if res["env"]["device"] == "cpu":
            assert c["timing"] == "interpreter, not performance" and "speedup" not in c
    if res["env"]["device"] == "cpu":
        assert res["hisparse"]["ran"] is False and "CUDA" in res["hisparse"]["reason"]
        assert any("interpreter" in n for n in res["notes"])


def test_table_and_skipped_cells(capsys):
    # batch 4 x k 32 = 128 selections do not fit a 64-slot pool: skipped, the rest runs
    assert ab.main(["--batches", "1,4", "--hit-rates", "0.9", *TINY]) == 0
    out = capsys.readouterr().out
    assert "skipped batch 4 pool 64" in out and "a step must fit the pool" in out
    assert "result: ok" in out
    assert "interpreter, not performance" in out or "fused us" in out


def _corrupt(monkeypatch, extra_launch: bool):
    fa = ab.fused_access
    run = fa.FusedAccess.run

    def bad_run(self, addrs, place, out=None, **kw):
        run(self, addrs, place, out=out, **kw)
        if extra_launch:
            fa._launches += 1
        elif out is not None and not place:
            out.view(-1)[0] = -1  # one selection served as padding
    monkeypatch.setattr(fa.FusedAccess, "run", bad_run)


@pytest.mark.parametrize("extra_launch", [False, True], ids=["wrong-rows", "five-launches"])
def test_failures_exit_1(monkeypatch, capsys, extra_launch):
    _corrupt(monkeypatch, extra_launch)
    assert ab.main(["--json", "--batches", "1", "--hit-rates", "0.9", *TINY]) == 1
    (cell,) = json.loads(capsys.readouterr().out)["cells"]
    if extra_launch:
        assert cell["identical"] is True and cell["launches_per_step"] == 5
    else:
        assert cell["identical"] is False and "returned rows" in cell["mismatch"]


@pytest.mark.parametrize("argv, message", [
    (["--hit-rates", "0.5,1.5"], "--hit-rates must lie in (0, 1]"),
    (["--k", "0"], "--k must be >= 1"),
    (["--pools", "abc"], "invalid _pools value"),
    (["--batches", "4", "--k", "64", "--pools", "128"], "no cell fits: batch x k = 256 > 128"),
])
def test_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        ab.main(argv + ["--no-hisparse"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_pool_sizes():
    assert [ab.pool_size(x) for x in ("16", "2^10", "300", "64")] == [65536, 1024, 300, 64]


def test_selections_hit_exactly_the_target():
    args = ab.parse_args(["--layers", "2", "--row-bytes", "32", "--buckets", "4"], cuda=False)
    twins = ab.make_twins(64, 96, args, torch.device("cpu"))
    ab.fill(twins)
    ref = twins[0]
    assert bool((ref.gpu_owner[:64] >= 0).all()) and int((ref.loc >= 64).sum()) == 96
    assert ab.differs(*twins, pools=True) is None
    sel = ab.HitRateSelections(0.75, 2, 16, 0, torch.device("cpu")).step(ref)
    assert sel.shape == (2, 16) and sel.unique().numel() == 32
    assert int((ref.loc[sel] < 64).sum()) == 24  # round(0.75 x 32) on the GPU, 8 on the CPU
    # the 8 CPU rows are not GPU-resident (-1): counted once per layer; the rest hold their bytes
    assert ab.bad_rows(ref, ref.translate(sel), sel) == 16


def test_gpu_table_formats():
    """The CUDA branch of the table (no GPU here): a synthetic result of the JSON shape."""
    cell = {"batch": 64, "k": 2048, "pool": 1 << 20, "hit_target": 0.9, "hit_measured": 0.9,
            "identical": True, "mismatch": None, "error": None, "launches_per_step": 4.0,
            "torch_us": 900.0, "fused_us": 60.0, "speedup": 15.0, "torch_graph_us": 500.0,
            "fused_graph_us": None, "graph_speedup": None, "data_move_us": 35.2,
            "access_over_move": 1.7}
    bad = {"batch": 1, "k": 2048, "pool": 1 << 20, "hit_target": 0.7, "identical": False,
           "mismatch": None, "error": "RuntimeError: x"}
    res = {"env": {"device": "NVIDIA H200", "torch": "2", "triton": "3", "git_commit": None},
           "config": {"k": 2048, "layers": 1, "row_bytes": 656, "steps": 8, "warmup": 2},
           "notes": [], "cells": [cell, bad], "skipped": [], "h2d_copy_gbps": 55.0,
           "hisparse": {"ran": True, "reason": None, "rows": [
               {"batch": 64, "context": 32768, "gpu_rows": 266240, "ulacache_path": "fused",
                "ulacache_us": 80.0, "hisparse_us": 100.0, "ulacache_over_hisparse": 0.8,
                "hit_ulacache": 0.95, "hit_hisparse": 0.9, "valid": True}]}, "ok": False}
    text = ab.format_table(res)
    assert "15.00" in text and "1.70" in text and "ERROR RuntimeError: x" in text
    assert "x0.800" in text and "FAILED" in text
    assert ab.failed(bad) and not ab.failed(cell) and ab.failed({**cell, "launches_per_step": 5})
