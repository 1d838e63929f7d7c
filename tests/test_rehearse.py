"""``ulacache rehearse`` at production geometry, every combination CI promises (marked
``sglang``: it builds SGLang 0.5.23's configurator and ulacache's real pool, allocator and
coordinator on the meta device).

Each combination runs ``ulacache rehearse --json`` in its own process (publishing server args
is process-global) and must fit: start-up allocations within SGLang's KV budget (up to SGLang's
own padding pages), the CPU tier within the host budget, every call's transient peak within the
memory outside the static pool, on the fused access path. The ratios are ``bench/capacity.py``'s
picks, except B300 DP, where its pick (cpu_ratio 2) assumes a pool capped below SGLang's budget:
a real launch sizes the pool from the whole budget and its CPU tier overflows the host (checked
below as a refusal). TP runs the prefill through 4 of the layers (same shapes in every layer;
all layers take minutes on the meta device).

Refusals: a CPU tier over the host budget, a headroom smaller than a call's transient peak and a
pool too small for one step's selections each exit 1 with a line naming what does not fit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

# cpu_ratio per (model, gpu, mode): bench/capacity.py's picks (B300 DP: see the docstring)
RATIOS = {("glm-5", "h200", "dp"): 11, ("glm-5", "h200", "tp"): 11,
          ("glm-5", "b300", "dp"): 1, ("glm-5", "b300", "tp"): 117,
          ("deepseek-v3.2", "h200", "dp"): 22, ("deepseek-v3.2", "h200", "tp"): 23,
          ("deepseek-v3.2", "b300", "dp"): 1, ("deepseek-v3.2", "b300", "tp"): 159}
RUNNING = 32  # requests per attention worker
MIB = 2**20


def rehearse(model: str, gpu: str, mode: str, *extra: str, config: dict | None = None
             ) -> tuple[int, dict | None, str]:
    cfg = config if config is not None else {"cpu_ratio": RATIOS[(model, gpu, mode)]}
    argv = [sys.executable, "-m", "ulacache.tools.cli", "rehearse", "--model", model, "--gpu",
            gpu, "--mode", mode, "--ulacache-config", json.dumps(cfg), "--max-running-requests",
            str(RUNNING * (8 if mode == "dp" else 1)), "--json", *extra]
    if mode == "tp":
        argv += ["--prefill-layers", "4"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    try:
        report = json.loads(p.stdout)
    except json.JSONDecodeError:
        report = None
    return p.returncode, report, p.stderr[-3000:]


def check_fits(report: dict) -> None:
    assert report["ok"], report["fails"]
    assert report["access_path"] == "fused"
    # start-up: within SGLang's budget but for SGLang's own padding pages (< 64 MiB)
    assert report["device_persistent"] - report["budget"] < 64 * MIB
    assert report["by_owner"]["host"] <= report["host_budget"]
    assert 0 < report["transient_peak"] < report["headroom"]
    assert report["headroom_left"] > 0
    # the persistent scratch is allocated once at start-up and charged: a call's transient
    # peak stays far below one 2^24-entry scratch (~470 MB), the pre-issue-20 growth
    assert report["transient_peak"] < 400 * MIB
    phases = set(report["transient"])
    assert {"prefill", "decode", "finish", "abort"} <= phases
    assert any("fused._scratch" in name or "_gates" in name for name in report["allocations"])
    # production mode reads no device value on any of these paths (a read is a host sync: it
    # would stall the scheduler's CPU side under overlap scheduling)
    assert report["value_reads"] == {}


@pytest.mark.parametrize("model,gpu,mode", sorted(RATIOS))
def test_every_combination_fits(model, gpu, mode):
    rc, report, err = rehearse(model, gpu, mode)
    assert report is not None, err
    check_fits(report)
    assert rc == 0
    cfg = report["config"]
    assert cfg["chunk_tokens"] == (8192 if gpu == "h200" else 16384) // (8 if mode == "dp" else 1)


def test_draft_tokens_add_a_verify_batch():
    rc, report, err = rehearse("glm-5", "h200", "dp", "--speculative-num-draft-tokens", "3",
                               config={"cpu_ratio": 4})
    assert report is not None, err
    check_fits(report)
    assert "verify" in report["transient"] and report["config"]["steps"] == 3
    assert rc == 0


def test_cpu_tier_over_the_host_budget_is_refused():
    rc, report, _ = rehearse("glm-5", "b300", "dp", config={"cpu_ratio": 2})
    assert rc == 1 and not report["ok"]
    assert any("CPU tier" in f and "host budget" in f for f in report["fails"])


def test_transient_peak_over_the_headroom_is_refused_naming_the_call():
    rc, report, _ = rehearse("deepseek-v3.2", "h200", "dp", "--mem-fraction-static", "0.99995",
                             config={"cpu_ratio": 4})
    assert rc == 1 and not report["ok"]
    assert any("transient peak" in f and "outside the static pool" in f for f in report["fails"])


def test_pool_too_small_for_a_step_does_not_start():
    rc, report, _ = rehearse("glm-5", "h200", "dp", config={"cpu_ratio": 40})
    assert rc == 1 and not report["ok"]
    assert any("one step's selections" in f for f in report["fails"])
