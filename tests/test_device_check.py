"""bench/device_check.sh's command line and its summary (bench/device_summary.py): a usage
line for --help, refusals of a missing or extra argument, a bench that could not run shown
as "not measured" with its own reason, never as an internal error or rc=0, the header's steps
and timeouts matching the script, and bench/prefetch_overlap.py's figures and CPU refusal."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "device_check.sh"
SUMMARY = ROOT / "bench" / "device_summary.py"
OVERLAP = ROOT / "bench" / "prefetch_overlap.py"


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


def test_header_lists_every_timeout_with_its_default_and_the_worst_case_sum():
    """The header's environment list is the script's timeouts with the defaults it uses, and
    its worst case is their sum (every step at its timeout)."""
    lines = SCRIPT.read_text().splitlines()
    header = "\n".join(x for x in lines if x.startswith("#"))
    code = "\n".join(x for x in lines if not x.lstrip().startswith("#"))
    used = {k: int(v) for k, v in re.findall(r"\$\{(\w+_TIMEOUT):-(\d+)\}", code)}
    documented = {k: int(v) for k, v in
                  re.findall(r"(\w+_TIMEOUT) \((?:default )?(\d+) s\)", header)}
    assert used == documented and "PREFETCH_TIMEOUT" in used
    worst = re.search(r"worst case \(every step at its timeout\) is (\d+) s", header)
    assert worst and int(worst.group(1)) == sum(used.values())


def test_script_runs_the_prefetch_overlap_step_and_hands_its_status_to_the_summary():
    text = SCRIPT.read_text()
    assert 'bench/prefetch_overlap.py --quick --json' in text
    assert '> "$LOGDIR/prefetch_overlap.json" 2> "$LOGDIR/prefetch_overlap.log"' in text
    assert 'prefetch_overlap="$PREFETCH_RC"' in text
    assert '[ "$PREFETCH_RC" -eq 1 ]' in text  # an invalid measurement fails the check
    steps = re.findall(r"^# (\d)\. ", text, flags=re.M)
    assert steps == [str(i) for i in range(1, len(steps) + 1)]
    assert "# 4. bench/prefetch_overlap.py --quick" in text


def _overlap_result(a: float, b: float, both: float, copy: float = 0.15,
                    copy_both: float = 0.31) -> dict:
    """bench/prefetch_overlap.py's JSON, assembled by its own report() from stand-in medians."""
    from tests.helpers import load_bench

    po = load_bench("prefetch_overlap")
    args = po.parse_args(["--quick"])
    groups = list(range(1, args.layers))
    setup = SimpleNamespace(groups=groups, row_bytes=656, layers_per_group=1, n=40960,
                            hits=12288, fused=True)
    attn = SimpleNamespace(what="bmm ...", gflop=36.5)
    reps = 3
    bench = SimpleNamespace(
        times={"attention": [a] * reps, "prefetch": [b] * reps, "both": [both] * reps,
               "copy": [copy] * reps, "copy_both": [copy_both] * reps},
        moved={"prefetch": [[args.rows] * len(groups)] * reps,
               "both": [[args.rows] * len(groups)] * reps},
        evicted={"prefetch": [(0, args.rows * len(groups))] * reps,
                 "both": [(0, args.rows * len(groups))] * reps},
        bytes_per_group=args.rows * 656)
    timer = SimpleNamespace(host_ms=[0.6, 0.8], sleep_ms=2.0)
    env = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
           "access_path": "fused", "python": "3.12.3"}
    return po.report(args, env, setup, attn, bench, timer, 12.0)


def test_summary_shows_the_overlap_ratio_against_its_target(tmp_path):
    res = _overlap_result(0.3, 0.2, 0.35)
    assert (res["prefetch"]["ratio"], res["prefetch"]["ideal"]) == (0.7, 0.6)
    assert res["prefetch"]["gbps"] == round(3 * 4096 * 656 / 0.2e-3 / 1e9, 2)
    assert res["target_met"] and res["launch_hidden"] and res["notes"] == []
    (tmp_path / "prefetch_overlap.json").write_text(json.dumps(res) + "\n")
    (tmp_path / "prefetch_overlap.log").write_text("")
    out = _summary(tmp_path, pytest=0, prefetch_overlap=0)
    assert "prefetch_overlap: ok" in out
    row = next(x for x in out.splitlines() if x.startswith("prefetch "))
    assert row.split()[1:] == ["0.200", f"{res['prefetch']['gbps']:.1f}", "0.350", "0.700",
                               "0.600", "0.75", "ok"], row
    control = next(x for x in out.splitlines() if x.startswith("torch H2D"))
    assert "0.689" in control and "(control)" in control
    assert "12288 rows prefetched per step" in out and "target <= 0.75" in out

    (tmp_path / "prefetch_overlap.json").write_text(json.dumps(_overlap_result(0.3, 0.2, 0.45)))
    assert "0.900  0.600   0.25  MISS" in _summary(tmp_path, prefetch_overlap=0)
    unbalanced = _overlap_result(0.9, 0.1, 0.95)
    assert unbalanced["notes"] and not unbalanced["target_met"]
    (tmp_path / "prefetch_overlap.json").write_text(json.dumps(unbalanced))
    assert "MISS (ideal 0.90 > 0.75: sides unbalanced)" in _summary(tmp_path, prefetch_overlap=0)


def test_summary_says_the_overlap_was_not_measured_with_its_reason(tmp_path):
    (tmp_path / "prefetch_overlap.json").write_text("")
    (tmp_path / "prefetch_overlap.log").write_text(
        "prefetch_overlap: needs CUDA (torch 2.13.0+cpu sees no CUDA device); nothing measured\n")
    out = _summary(tmp_path, pytest=0, prefetch_overlap=2)
    assert "prefetch_overlap: not measured: prefetch_overlap: needs CUDA (torch" in out
    (tmp_path / "prefetch_overlap.log").write_text(
        "filled ...\nprefetch_overlap: FAILED: a timed prefetch moved nothing (both step 3, "
        "group 2: 0 of 4096 rows)\n")
    out = _summary(tmp_path, pytest=0, prefetch_overlap=1)
    assert "prefetch_overlap: FAILED (exit 1): prefetch_overlap: FAILED: a timed prefetch " \
           "moved nothing" in out


def test_overlap_arithmetic():
    """Serial: both = a + b (ratio 1, nothing hidden); perfect: both = max(a, b)."""
    from tests.helpers import load_bench

    po = load_bench("prefetch_overlap")
    assert po.overlap(1.0, 1.0, 2.0) == {"ratio": 1.0, "ideal": 0.5, "hidden": 0.0}
    assert po.overlap(1.0, 1.0, 1.0) == {"ratio": 0.5, "ideal": 0.5, "hidden": 1.0}
    assert po.overlap(3.0, 1.0, 3.5) == {"ratio": 0.875, "ideal": 0.75, "hidden": 0.5}


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_prefetch_overlap_without_cuda_exits_2_with_one_line(extra):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the bench measures (bench/device_check.sh runs it)")
    p = subprocess.run([sys.executable, str(OVERLAP), "--quick", *extra], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefetch_overlap: needs CUDA ("), p.stderr


def test_prefetch_overlap_refuses_bad_arguments_with_exit_2():
    from tests.helpers import load_bench

    po = load_bench("prefetch_overlap")
    for argv in (["--rows", "0"], ["--layers", "1"], ["--pred-hit", "1"],
                 ["--rows", "4096", "--cpu-slots", "8192"],
                 ["--rows", "16000", "--pred-hit", "0.5"]):  # one call: 16000 + 16000 entries
        with pytest.raises(SystemExit) as e:
            po.parse_args(argv)
        assert e.value.code == 2, argv
