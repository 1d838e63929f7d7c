"""The summary table ``bench/device_check.sh`` prints last (and writes to LOGDIR/summary.txt).

    python bench/device_summary.py LOGDIR T0 pytest=RC bandwidth=RC access=RC \\
        prefetch_overlap=RC hisparse_h2h=RC decode_sweep=RC

Each stage's figures come from its JSON in LOGDIR. A stage that exited 2 is "not measured"
(the benches say why in one stderr line, kept in its log, and that line is shown); any other
non-zero exit is "FAILED" with the last line of its log. A stage's JSON is only read when the
stage succeeded, so a missing or partial file never shows up as an internal error.
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

LOGS = {"bandwidth": ("bandwidth.json", "bandwidth.log"), "access": ("access.json", "access.log"),
        "prefetch_overlap": ("prefetch_overlap.json", "prefetch_overlap.log"),
        "hisparse_h2h": ("hisparse_h2h.json", "hisparse_h2h.log"),
        "decode_sweep": ("decode_sweep.json", "decode_sweep.log")}
UNMEASURED = 2  # the benches' exit status when nothing could be measured (no CUDA, no sources)
OVERLAP_TARGET = 0.75  # bench/prefetch_overlap.py's TARGET_RATIO, when its JSON lacks one


def last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return f"(no log {path.name})"
    return lines[-1].strip() if lines else f"({path.name} is empty)"


def load(logdir: Path, stage: str, rc: int) -> tuple[dict | None, str]:
    """(the stage's JSON or None, its status line)."""
    js, log = (logdir / name for name in LOGS[stage])
    if rc == UNMEASURED:
        return None, f"{stage}: not measured: {last_line(log)}"
    if rc == 124:
        return None, f"{stage}: FAILED: timed out (see {log})"
    if rc != 0:
        return None, f"{stage}: FAILED (exit {rc}): {last_line(log)}"
    try:
        text = js.read_text().strip()
        return json.loads(text.splitlines()[-1]), f"{stage}: ok"
    except (OSError, ValueError, IndexError):
        return None, f"{stage}: FAILED: exit 0 but no JSON result in {js.name} (see {log})"


def pytest_lines(logdir: Path, rc: int) -> list[str]:
    lines = [f"pytest -m gpu: {'pass' if rc == 0 else f'FAIL (exit {rc})'}"]
    try:  # per test file: passed / failed / skipped (TP over CUDA IPC, peers, kernels, graphs)
        tally: dict[str, Counter] = {}
        for case in ET.parse(logdir / "pytest_gpu.xml").iter("testcase"):
            kind = "failed" if case.find("failure") is not None or \
                case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "passed"
            parts = (case.get("classname") or "(skipped at collection)").split(".")
            name = next((x for x in parts if x.startswith("test_")), parts[-1])
            tally.setdefault(name, Counter())[kind] += 1
    except (OSError, ET.ParseError):
        return lines + [f"  (no per-file results: pytest did not get far; see "
                        f"{logdir / 'pytest_gpu.log'})"]
    for name, c in sorted(tally.items()):
        lines.append(f"  {name:<28} passed {c['passed']:>3}  failed {c['failed']:>3}  "
                     f"skipped {c['skipped']:>3}")
    return lines


def bandwidth_lines(res: dict) -> list[str]:
    lines = [f"h2d_copy {res['h2d_copy_gbps']:.1f} GB/s   d2d_copy {res['d2d_copy_gbps']:.1f} GB/s",
             f"{'kernel':<14}{'row B':>6}{'rows':>8}{'GB/s':>9}{'ratio':>7}  target"]
    for r in res["rows"]:
        tgt = ""
        if r["kernel"] == "host_gather" and r["row_bytes"] == 656 and r["rows"] >= 16384:
            tgt = ">=0.85 " + ("ok" if r["ratio"] >= 0.85 else "MISS")
        elif r["kernel"] == "device_gather" and r["rows"] >= 16384:
            tgt = ">=0.60 " + ("ok" if r["ratio"] >= 0.60 else "MISS")
        lines.append(f"{r['kernel']:<14}{r['row_bytes']:>6}{r['rows']:>8}{r['gbps']:>9.1f}"
                     f"{r['ratio']:>7.3f}  {tgt}")
    for d in res.get("duplex", []):  # decode_sweep.py --duplex-factor takes it
        lines.append(f"duplex swap {d['row_bytes']:>5} B {d['rows']:>7} rows: (H2D + D2H) / "
                     f"swap = {d['duplex_factor']:.2f} (2.0 full duplex, 1.0 serial)")
    return lines


def access_lines(acc: dict) -> list[str]:
    lines = [f"{'batch':>6}{'pool':>9}{'hit':>7}{'launch':>7}{'same':>5}{'speed-up':>9}"
             f"{'access/data':>12}  target <= 1.10"]
    for c in acc.get("cells", []):
        ad = c.get("access_over_move")
        lines.append(f"{c.get('batch', '?'):>6}{c.get('pool', '?'):>9}"
                     f"{c.get('hit_measured', float('nan')):>7.3f}"
                     f"{c.get('launches_per_step', float('nan')):>7.2f}"
                     f"{'yes' if c.get('identical') else 'NO':>5}"
                     f"{c.get('graph_speedup') or c.get('speedup') or float('nan'):>9.2f}"
                     f"{ad if ad is None else round(ad, 3)!s:>12}"
                     + ("" if ad is None else ("  ok" if ad <= 1.10 else "  MISS")))
    return lines


def overlap_lines(res: dict) -> list[str]:
    """bench/prefetch_overlap.py: the prefetch stream against the attention stand-in, as a
    ratio to the serial time (target marked), and the plain pinned-copy control."""
    att, pf, ct = res["attention"], res["prefetch"], res["control"]
    tgt = res.get("target_ratio", OVERLAP_TARGET)
    mark = "ok" if pf["ratio"] <= tgt else "MISS"
    if pf["ideal"] > tgt:
        mark += f" (ideal {pf['ideal']:.2f} > {tgt}: sides unbalanced)"
    lines = [f"{'':<10}{'alone ms':>9}{'GB/s':>7}{'+attn ms':>9}{'ratio':>7}{'ideal':>7}"
             f"{'hidden':>7}  target <= {tgt}"]
    for name, r, tail in (("prefetch", pf, mark), ("torch H2D", ct, "(control)")):
        lines.append(f"{name:<10}{r['ms']:>9.3f}{r['gbps']:>7.1f}{r['both_ms']:>9.3f}"
                     f"{r['ratio']:>7.3f}{r['ideal']:>7.3f}{r['hidden']:>7.2f}  {tail}")
    lines.append(f"  attention {att['ms']:.3f} ms over {att['layers']} layers; "
                 f"{pf['rows_per_step_median']:.0f} rows prefetched per step"
                 + ("" if res.get("launch_hidden", True) else "; host launches NOT hidden"))
    return lines


def h2h_lines(res: dict) -> list[str]:
    lines = [f"{'system':<10}{'batch':>6}{'context':>9}{'hit':>7}{'us/step':>9}{'valid':>6}"]
    for r in res.get("rows", []):
        lines.append(f"{r['system']:<10}{r['batch']:>6}{r['context']:>9}{r['hit_rate']:>7.3f}"
                     f"{r['time_us_median']:>9.1f}{'yes' if r['valid'] else 'NO':>6}")
    return lines


def sweep_lines(sw: dict) -> list[str]:
    lines = [f"{'conc':>5} {'policy':<9}{'admitted':>9}{'hit':>7}{'layer ms':>9}"
             f"{'tok/s meas':>11}{'tok/s model':>12}"]
    for r in sw["rows"]:
        lines.append(f"{r['concurrency']:>5} {r['policy']:<9}{r['admitted_mean']:>9.1f}"
                     f"{r['gpu_hit_rate']:>7.3f}{r['measured_layer_ms']:>9.3f}"
                     f"{r['tokens_per_s_measured']:>11.0f}{r['tokens_per_s']:>12.0f}")
    lines.append("  " + ", ".join(f"{k} x{v:.2f}" for k, v in sw["peak_ratios"].items()
                                  if k.startswith("measured")))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    logdir, t0 = Path(argv[0]), float(argv[1])
    rcs = {k: int(v) for k, v in (a.split("=", 1) for a in argv[2:])}
    out = [f"== summary ({time.time() - t0:.0f} s)"]
    out += pytest_lines(logdir, rcs.get("pytest", 1))
    for stage, fmt in (("bandwidth", bandwidth_lines), ("access", access_lines),
                       ("prefetch_overlap", overlap_lines), ("hisparse_h2h", h2h_lines),
                       ("decode_sweep", sweep_lines)):
        res, status = load(logdir, stage, rcs.get(stage, 1))
        out.append(status)
        if res is not None:
            try:
                out += fmt(res)
            except (KeyError, TypeError, ValueError) as e:  # a JSON of another shape
                out.append(f"  (its JSON lacks {e}; see {logdir / LOGS[stage][0]})")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
