"""bench/device_check.sh's command line and its summary (bench/device_summary.py): a usage
line for --help, refusals of a missing or extra argument, and a bench that could not run shown
as "not measured" with its own reason, never as an internal error or rc=0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "device_check.sh"
SUMMARY = ROOT / "bench" / "device_summary.py"


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_help_prints_usage_and_runs_nothing(tmp_path):
    for flag in ("--help", "-h"):
        p = _sh(flag)
        assert p.returncode == 0 and p.stdout.startswith("usage: bash bench/device_check.sh")
        assert "LOGDIR" in p.stdout and p.stderr == ""
    assert not (ROOT / "--help").exists()


def test_bad_command_lines_are_refused_with_exit_2(tmp_path):
    for args in ((), ("--quick",), (str(tmp_path / "a"), str(tmp_path / "b"))):
        p = _sh(*args)
        assert p.returncode == 2 and "usage: bash bench/device_check.sh" in p.stderr, args
        assert p.stdout == ""
    assert not (tmp_path / "a").exists()


def _summary(logdir: Path, **rcs: int) -> str:
    args = [str(logdir), "0"] + [f"{k}={v}" for k, v in rcs.items()]
    p = subprocess.run([sys.executable, str(SUMMARY), *args], capture_output=True, text=True,
                       timeout=60, check=True)
    return p.stdout


def test_summary_says_not_measured_with_the_bench_s_own_reason(tmp_path):
    (tmp_path / "bandwidth.json").write_text("")  # what a bench that exits 2 leaves
    (tmp_path / "bandwidth.log").write_text("bench/bandwidth.py needs a CUDA device; none is "
                                            "available\n")
    (tmp_path / "hisparse_h2h.json").write_text("")
    (tmp_path / "hisparse_h2h.log").write_text("bench/hisparse_head_to_head.py: not measured: "
                                               "no CUDA device (...)\n")
    (tmp_path / "access.log").write_text("Traceback ...\nRuntimeError: boom\n")
    sweep = {"rows": [{"concurrency": 72, "policy": "ulacache", "admitted_mean": 70.0,
                       "gpu_hit_rate": 0.9, "measured_layer_ms": 0.5,
                       "tokens_per_s_measured": 1000.0, "tokens_per_s": 1100.0}],
             "peak_ratios": {"measured ulacache/hisparse": 1.1}}
    (tmp_path / "decode_sweep.json").write_text(json.dumps(sweep))
    out = _summary(tmp_path, pytest=0, bandwidth=2, access=1, hisparse_h2h=2, decode_sweep=0)
    assert "bandwidth: not measured: bench/bandwidth.py needs a CUDA device" in out
    assert "hisparse_h2h: not measured: bench/hisparse_head_to_head.py: not measured: no CUDA" \
        in out
    assert "access: FAILED (exit 1): RuntimeError: boom" in out
    assert "decode_sweep: ok" in out and "measured ulacache/hisparse x1.10" in out
    assert "list index" not in out and "rc=0" not in out
    assert "no per-file results" in out  # no pytest XML in this folder


def test_summary_of_a_zero_exit_without_json_is_a_failure(tmp_path):
    (tmp_path / "bandwidth.json").write_text("")
    (tmp_path / "bandwidth.log").write_text("")
    out = _summary(tmp_path, pytest=0, bandwidth=0, access=124, hisparse_h2h=0, decode_sweep=0)
    assert "bandwidth: FAILED: exit 0 but no JSON result in bandwidth.json" in out
    assert "access: FAILED: timed out" in out


def test_summary_prints_the_duplex_factor(tmp_path):
    """bench/bandwidth.py's duplex rows ((H2D + D2H) / swap) reach the summary, the figure
    bench/decode_sweep.py --duplex-factor takes."""
    bw = {"h2d_copy_gbps": 55.0, "d2d_copy_gbps": 3000.0,
          "rows": [{"kernel": "swap", "row_bytes": 656, "rows": 16384, "gbps": 80.0,
                    "ratio": 1.45}],
          "duplex": [{"row_bytes": 656, "rows": 16384, "serial_ms": 0.5, "swap_ms": 0.3,
                      "duplex_factor": 1.6667}]}
    (tmp_path / "bandwidth.json").write_text(json.dumps(bw))
    (tmp_path / "bandwidth.log").write_text("")
    out = _summary(tmp_path, pytest=0, bandwidth=0)
    assert "duplex swap   656 B   16384 rows: (H2D + D2H) / swap = 1.67" in out


def test_duplex_factor_arithmetic():
    """Serial directions over one swap: equal times mean full duplex (2.0)."""
    from tests.helpers import load_bench

    bw = load_bench("bandwidth")
    assert bw.duplex_row(656, 100, 0.3, 0.2, 0.25)["duplex_factor"] == 2.0
    assert bw.duplex_row(656, 100, 0.3, 0.2, 0.5)["duplex_factor"] == 1.0
    r = bw.duplex_row(1152, 2048, 0.3, 0.3, 0.4)
    assert (r["serial_ms"], r["swap_ms"], r["duplex_factor"]) == (0.6, 0.4, 1.5)
