"""bench/hisparse_head_to_head.py on the CPU: the standalone build's command line and sources,
equal-memory sizing, the shared selection stream, byte-for-byte validation, both sides driven
through the CPU stand-in (HiSparseBuffer for the kernel, ulacache's torch reference path), the
table and JSON contract, and the no-GPU / no-sources exits. The kernel itself: ``-m gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import load_bench
from ulacache.tools.hisparse import HiSparseBuffer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "hisparse_head_to_head.py"


h2h = load_bench("hisparse_head_to_head")
SMALL = dict(k=64, h_slots=128, reserved=64, row_bytes=656)
CPU = torch.device("cpu")


def _tree(site: Path) -> None:
    for req in h2h.Sources.REQUIRED:
        attr, rel = req.split("/", 1)
        p = getattr(h2h.sources_in(site), attr) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("//")


# -- (1) build command and sources -----------------------------------------------------------------
def test_template_and_wrapper_match_sglangs_instantiation():
    assert h2h.template_args() == "960, 2048, 4096, true, false, 1, false, false, false"
    src = h2h.wrapper_source(64, 128, 256)
    assert '#include "kvcacheio/hisparse.cuh"' in src
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(load_cache_to_device_buffer, " \
           "(load_cache_to_device_buffer<256, 64, 128, true, false, 1, false, false, false>));" \
        in src
    assert src.index("namespace sglang {") < src.index("TVM_FFI_DLL_EXPORT")


def test_build_command_flags(tmp_path):
    srcs = h2h.sources_in(tmp_path / "site")
    cmd = h2h.build_command(Path("a.cu"), Path("a.so"), srcs, "/opt/cuda")
    assert cmd[0] == "/opt/cuda/bin/nvcc"
    for flag in ("-shared", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a",
                 "-DSGL_CUDA_ARCH=900", "-std=c++20", "-O3", "--expt-relaxed-constexpr",
                 "-ltvm_ffi", "-lcudart", "-L/opt/cuda/lib64"):
        assert flag in cmd, flag
    for inc in (srcs.jit_include, srcs.jit_csrc, srcs.tvm_include):
        assert f"-I{inc}" in cmd
    assert f"-L{srcs.tvm_lib}" in cmd
    assert cmd[-3:] == ["-o", "a.so", "a.cu"]
    assert "-DSGL_CUDA_ARCH=1000" in h2h.build_command(Path("a"), Path("b"), srcs, "/c", "100a")


def test_sources_missing_lists_each_absent_file(tmp_path):
    site = tmp_path / "site"
    assert len(h2h.sources_in(site).missing()) == len(h2h.Sources.REQUIRED)
    _tree(site)
    assert h2h.sources_in(site).missing() == []
    (site / "sglang/kernels/jit/csrc/kvcacheio/hisparse.cuh").unlink()
    assert [Path(p).name for p in h2h.sources_in(site).missing()] == ["hisparse.cuh"]


def test_unpack_extracts_only_what_the_build_needs(tmp_path):
    site = tmp_path / "site"
    _tree(site)
    (site / "sglang" / "srt").mkdir(parents=True)
    (site / "sglang" / "srt" / "big.py").write_text("x")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    assert h2h.unpack(wheels, tmp_path / "out") is None  # nothing carried
    for name, top in ((h2h.SGLANG_WHEEL, "sglang"),
                      ("apache_tvm_ffi-0.1.11-cp312-abi3-manylinux_2_28_x86_64.whl", "tvm_ffi")):
        with zipfile.ZipFile(wheels / name, "w") as z:
            for p in (site / top).rglob("*"):
                if p.is_file():
                    z.write(p, p.relative_to(site).as_posix())
    assert h2h.find_wheels(wheels)[0].name == h2h.SGLANG_WHEEL
    srcs = h2h.unpack(wheels, tmp_path / "out")
    assert srcs is not None and srcs.missing() == []
    assert not (tmp_path / "out" / "sglang" / "srt").exists()


# -- (3) sizing ------------------------------------------------------------------------------------
def test_equal_memory_sizing():
    sz = h2h.sizing(256, 131072, 10)
    assert sz.gpu_rows == 256 * (4096 + 64)
    assert sz.gpu_bytes == sz.gpu_rows * 656
    assert sz.stride == 131072 + 10 + 64 and sz.host_rows == 256 * sz.stride
    assert h2h.sizing(1, 32768, 4).gpu_rows == 4160
    with pytest.raises(ValueError, match="fast path"):
        h2h.sizing(4, 4000, 4)
    with pytest.raises(ValueError, match="must fit"):
        h2h.sizing(1, 40000, 4, k=4097)
    assert set(sz.to_dict()) >= {"gpu_rows", "host_bytes", "stride", "batch", "context"}


# -- (2) the shared stream -------------------------------------------------------------------------
def test_stream_is_deterministic_and_shaped_like_topk():
    a = h2h.selection_stream(3, 700, 5, 64, seed=7)
    b = h2h.selection_stream(3, 700, 5, 64, seed=7)
    assert a.shape == (5, 3, 64) and a.dtype == np.int32
    assert np.array_equal(a, b)
    assert not np.array_equal(a, h2h.selection_stream(3, 700, 5, 64, seed=8))
    assert not np.array_equal(a[:, 0], a[:, 1])  # requests draw their own streams
    for t, p in enumerate(h2h.newest_positions(700, 5)):
        for r in range(3):
            row = a[t, r]
            assert np.unique(row).size == 64 and row.min() >= 0 and row.max() == p
    # reuse + recent window: consecutive steps share picks
    assert len(np.intersect1d(a[3, 0], a[4, 0])) > 16


def test_both_sides_see_identical_selections(monkeypatch):
    seen = {}
    real = h2h.run_side

    def spy(side, sz, stream, warmup, gbps):
        seen[side.name] = stream.copy()
        return real(side, sz, stream, warmup, gbps)

    monkeypatch.setattr(h2h, "run_side", spy)
    args = h2h.parse_args(["--cpu", "--batches", "2", "--contexts", "300", "--steps", "2",
                           "--warmup", "1", "--k", "64", "--h-slots", "128"])
    h2h.run(args, CPU, None)
    assert set(seen) == {"hisparse", "ulacache"}
    assert np.array_equal(seen["hisparse"], seen["ulacache"])


# -- (5) validation --------------------------------------------------------------------------------
def test_encode_rows_identify_addresses_and_check_rows_catches_corruption():
    a = torch.tensor([0, 1, 255, 256, 70000, 33_554_431])
    rows = h2h.encode_rows(a, 656, chunk=4)
    assert rows.shape == (6, 656) and rows.dtype == torch.uint8
    assert torch.unique(rows, dim=0).shape[0] == 6
    assert int.from_bytes(bytes(rows[4, :8].tolist()), "little") == 70000
    pool = torch.cat([rows, torch.zeros(1, 656, dtype=torch.uint8)])
    locs = torch.tensor([[5, 4, 3], [2, 1, -1]], dtype=torch.int32)
    addrs = torch.tensor([[33_554_431, 70000, 256], [255, 1, -1]])
    assert h2h.check_rows(pool, locs, addrs) == 0
    pool[3, 100] ^= 1
    assert h2h.check_rows(pool, locs, addrs) == 1
    assert h2h.check_rows(pool, locs, torch.tensor([[33_554_431, 70000, 256], [255, 1, 0]])) == 2
    locs[0, 0] = -1  # a real selection without a GPU row
    assert h2h.check_rows(pool, locs, addrs) == 2


@pytest.mark.parametrize("batch,context", [(1, 300), (3, 1000)])
def test_cpu_standins_validate_byte_for_byte(batch, context):
    sz = h2h.sizing(batch, context, 6, **SMALL)
    stream = h2h.selection_stream(batch, context, 6, 64, seed=1)
    hs = h2h.run_side(h2h.HiSparseSide(sz, CPU), sz, stream, 1, None)
    ula = h2h.run_side(h2h.UlaSide(sz, CPU), sz, stream, 1, None)
    for r in (hs, ula):
        assert r.valid and r.mismatched_rows == 0 and r.steps == 5
        assert r.accesses == 5 * batch * 64 and 0 < r.hit_rate < 1
        assert len(r.times_us) == 5 and r.time_us_median > 0
    assert hs.model_agrees
    # the stand-in's counts are HiSparseBuffer's, replayed independently
    models, miss = [HiSparseBuffer(128) for _ in range(batch)], 0
    for t, p in enumerate(h2h.newest_positions(context, 6)):
        for r, m in enumerate(models):
            m_t = m.step(stream[t, r], int(p))[1]
            miss += m_t if t >= 1 else 0  # the warmup step is not counted
    assert hs.h2d_bytes_per_step_layer == miss * 656 / 5
    assert hs.d2h_bytes_per_step_layer == batch * 656  # the newest-token backup


def test_corrupted_hisparse_state_is_reported():
    sz = h2h.sizing(2, 400, 3, **SMALL)
    stream = h2h.selection_stream(2, 400, 3, 64, seed=2)
    side = h2h.HiSparseSide(sz, CPU)
    side.host[:] = 0  # every miss now loads wrong bytes
    res = h2h.run_side(side, sz, stream, 0, None)
    assert not res.valid and res.mismatched_rows > 0


# -- (4) table, JSON and the exits -----------------------------------------------------------------
def test_summarise_and_ratios():
    r = h2h.CellResult("hisparse", 4, 32768, 2, 16640, 656)
    h2h.summarise(r, accesses=1000, misses=250, h2d_rows=250, d2h_rows=8,
                  times_s=[1e-5, 3e-5], h2d_gbps=50.0)
    assert r.hit_rate == 0.75 and r.h2d_bytes_per_step_layer == 250 * 656 / 2
    assert r.time_us_median == 20.0 and r.h2d_floor_us == round(125 * 656 / 50e9 * 1e6, 2)
    u = h2h.summarise(h2h.CellResult("ulacache", 4, 32768, 2, 16640, 656), 1000, 100, 100, 4,
                      [1e-5, 1e-5], 50.0)
    (q,) = h2h.ratio_rows([r.to_dict(), u.to_dict()])
    assert q["time_hisparse_over_ulacache"] == 2.0
    assert q["pcie_hisparse_over_ulacache"] == round((250 + 8) / (100 + 4), 3)


def test_json_contract_and_table(capsys):
    rc = h2h.main(["--cpu", "--json", "--batches", "1,2", "--contexts", "100,400",
                   "--steps", "2", "--warmup", "1", "--k", "64", "--h-slots", "128"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res) == {"config", "device", "kernel", "h2d_copy_gbps", "rows", "ratios",
                        "skipped"}
    assert res["kernel"] is False and res["h2d_copy_gbps"] is None
    assert len(res["rows"]) == 4 and len(res["ratios"]) == 2
    assert {(s["batch"], s["context"]) for s in res["skipped"]} == {(1, 100), (2, 100)}
    for row in res["rows"]:
        assert set(h2h.ROW_FIELDS) <= set(row) and row["valid"]
        assert row["gpu_rows"] == row["batch"] * (128 + 64)
    table = h2h.format_table(res)
    assert "hisparse" in table and "ulacache" in table and "skipped batch 1 ctx 100" in table


def test_no_cuda_is_not_measured_exit_2_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "not measured: no CUDA device" in out.stderr


def test_missing_sources_is_not_measured_exit_2_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert h2h.main(["--wheel-dir", str(tmp_path / "none")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "not measured: SGLang's kernel sources are not carried" in err
    assert h2h.SGLANG_WHEEL in err and "header" in err
    assert "sglang==0.5.23 apache-tvm-ffi==0.1.11" in h2h.__doc__


# -- the kernel itself -----------------------------------------------------------------------------
@pytest.mark.gpu
def test_kernel_matches_model_and_host_rows(tmp_path):
    srcs = h2h.unpack(h2h.WHEEL_DIR, tmp_path)
    if srcs is None or srcs.missing():
        pytest.skip("sglang / apache-tvm-ffi wheels not carried in .whl-hisparse/")
    kernel = h2h.build_kernel(srcs, tmp_path, h2h.K, h2h.H_SLOTS)
    dev = torch.device("cuda")
    sz = h2h.sizing(4, 32768, 4)
    stream = h2h.selection_stream(4, 32768, 4, h2h.K, seed=0)
    res = h2h.run_side(h2h.HiSparseSide(sz, dev, kernel), sz, stream, 1, None)
    assert res.model_agrees and res.valid, res
    ula = h2h.run_side(h2h.UlaSide(sz, dev), sz, stream, 1, None)
    assert ula.valid, ula
