"""``ulacache rehearse`` at production geometry, every combination CI promises (marked
``sglang``: it builds SGLang 0.5.23's configurator and ulacache's real pool, allocator and
coordinator on the meta device).

The rehearsals run in two child processes (publishing server args is process-global; one
import of SGLang each), DP and TP, each pinned to one xdist worker (``xdist_group``: CI runs
``--dist loadgroup``). Each combination must fit: start-up allocations within SGLang's KV
budget (up to SGLang's own padding pages), the CPU tier within the host budget, every call's
transient peak within the memory outside the static pool, nothing left allocated after a call,
no device value read, on the fused access path. Each combination is the launch of a capacity
column of ``bench/capacity.py`` (every FP8 column and GLM-5's BF16 on H200; DP with the
prefill stage, TP with replicated index-K; GLM-5 FP8's TP columns with index-K striped by
page, ``stripe_index_k``), computed here: its ``cpu_ratio``, its
``--max-running-requests`` (DP at high ratios: the requests whose decode step fits the pool)
and, where the host caps the pool (B300 DP), SGLang's ``--max-total-tokens`` at the column's
pool. The rehearsal must get the column's pool and
per-token charge from SGLang's real configurator (issue 21, item 5). TP runs the prefill
through 2 of the layers, the first and the last (same shapes in every layer; a call that left
memory behind is caught whatever the number of layers; all layers take minutes).

Refusals: a CPU tier over the host budget (through the command line: exit 1, one line naming
it), a headroom smaller than a call's transient peak, and a pool too small for one step's
selections.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

RUNNING = 32  # requests per attention worker (the plans that are not capacity columns)
MIB = 2**20
ENV = dict(os.environ, HF_HUB_OFFLINE="1")
MODELS = {"glm-5": "glm5", "deepseek-v3.2": "dsv32"}
# what ships: staged DP, TP with replicated index-K, TP with index-K striped by page, buffered
# and under SGLang's DCP (mode "dcp")
SYSTEMS = {"dp": "ulacache_dp", "tp": "ulacache_tp_repl", "tp_stripe": "ulacache_tp_shard",
           "dcp_stripe": "ulacache_dcp_shard"}


def capacity_columns() -> dict[tuple[str, str, str, str], dict]:
    """``bench/capacity.py``'s capacity column per (model, gpu, mode, layout): the launch each
    one is (ratio, SGLang pool, --max-running-requests per worker, host cap)."""
    from ulacache.tools.capacity import run

    res = run(layouts="fp8,bf16", systems=tuple(SYSTEMS.values()))
    by = {(r["model"], r["platform"], r["system"], r["layout"]): r for r in res["rows"]}
    return {(m, g, mode, lay): by[(key, g, system, lay)] for m, key in MODELS.items()
            for g in ("h200", "b300") for mode, system in SYSTEMS.items()
            for lay in ("fp8", "bf16") if (key, g, system, lay) in by}  # DCP: fp8 only


CAPACITY = capacity_columns()
# the GLM-5 FP8 8xB300 DP column: host-bound at cpu_ratio 2 (1,864,768 tokens per GPU)
CAPPED = CAPACITY[("glm-5", "b300", "dp", "fp8")]["pool_tokens"]


def plan(model, gpu, mode, config=None, **kw) -> dict:
    return {"model": model, "gpu": gpu, "mode": mode, "ulacache_config": config,
            "max_running_requests": RUNNING * (8 if mode == "dp" else 1),
            "prefill_layers": 2 if mode in ("tp", "dcp") else 0, **kw}


def capacity_plan(model, gpu, mode, layout="fp8") -> dict:
    """The launch of a capacity column: its ratio, its running requests and, where the host
    caps the pool, SGLang's --max-total-tokens at the column's pool."""
    col = CAPACITY[(model, gpu, mode, layout)]
    config = {"cpu_ratio": col["ratio"]}
    if mode in ("tp_stripe", "dcp_stripe"):
        mode, config["stripe_index_k"] = mode.split("_")[0], True
    return plan(model, gpu, mode, config,
                max_running_requests=col["running"] * (8 if mode == "dp" else 1),
                max_total_tokens=col["pool_tokens"] if col["host_bound"] else None,
                layout=layout)


# every FP8 column, and BF16 for GLM-5 on H200 (the other BF16 columns: test_capacity's
# hooked-configurator check; each rehearsal costs about 25 s of CI)
# DCP: the headline column (GLM-5 FP8 on 8xH200); the others by hand (docs/tp-over-dcp.md)
REHEARSED = [(m, g, mode, lay) for (m, g, mode, lay) in CAPACITY
             if (lay == "fp8" or (m, g) == ("glm-5", "h200")) and
             (mode != "tp_stripe" or (m, lay) == ("glm-5", "fp8")) and
             (mode != "dcp_stripe" or (m, g, lay) == ("glm-5", "h200", "fp8"))]


def name_of(model, gpu, layout) -> str:
    return f"{model}/{gpu}" + ("" if layout == "fp8" else f"/{layout}")


BATCHES = {
    "dp": {**{name_of(m, g, lay): capacity_plan(m, g, "dp", lay)
              for (m, g, mode, lay) in REHEARSED if mode == "dp"},
           "draft": plan("glm-5", "h200", "dp", {"cpu_ratio": 4}, draft_tokens=3),
           "prefetch": plan("glm-5", "h200", "dp", {"cpu_ratio": 4, "prefetch": {
               "sources": ["previous_layer", "draft"], "fetch_cap": 256}}, draft_tokens=3),
           "headroom": plan("deepseek-v3.2", "h200", "dp", {"cpu_ratio": 4},
                            mem_fraction_static=0.99995),
           "small pool": plan("glm-5", "h200", "dp", {"cpu_ratio": 40}),
           # the capacity tool's B300 pick, with its pool: SGLang's --max-total-tokens cap
           "capped": plan("glm-5", "b300", "dp", {"cpu_ratio": 2}, max_total_tokens=CAPPED)},
    "tp": {**{name_of(m, g, lay): capacity_plan(m, g, "tp", lay)
              for (m, g, mode, lay) in REHEARSED if mode == "tp"},
           **{"stripe:" + name_of(m, g, lay): capacity_plan(m, g, "tp_stripe", lay)
              for (m, g, mode, lay) in REHEARSED if mode == "tp_stripe"},
           **{"dcp:" + name_of(m, g, lay): capacity_plan(m, g, "dcp_stripe", lay)
              for (m, g, mode, lay) in REHEARSED if mode == "dcp_stripe"}},
}

_CHILD = textwrap.dedent("""
    import json, logging, sys
    logging.disable(logging.WARNING)
    from ulacache.tools.rehearse import Plan, rehearse
    plans = json.loads(sys.stdin.read())
    print(json.dumps({name: rehearse(Plan(**kw)) for name, kw in plans.items()}))
""")


@functools.cache  # once per worker: pytest may tear a module fixture down and set it up again
def run_batch(name: str) -> dict:
    p = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(BATCHES[name]),
                       capture_output=True, text=True, timeout=1500, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def dp_reports():
    return run_batch("dp")


@pytest.fixture(scope="module")
def tp_reports():
    return run_batch("tp")


def check_fits(report: dict) -> None:
    assert report["ok"], report["fails"]
    assert report["access_path"] == "fused"
    # start-up: within SGLang's budget but for SGLang's own padding pages (< 64 MiB)
    assert report["device_persistent"] - report["budget"] < 64 * MIB
    assert report["by_owner"]["host"] <= report["host_budget"]
    assert 0 < report["transient_peak"] < report["headroom"]
    assert report["headroom_left"] > 0
    # the persistent scratch is allocated once at start-up and charged: a call's transient
    # peak stays far below one 2^24-entry scratch (~470 MB), the pre-issue-20 growth, and no
    # call leaves memory behind
    assert report["transient_peak"] < 400 * MIB
    assert max(report["retained"].values()) <= 1 * MIB
    assert {"prefill", "decode", "finish", "abort"} <= set(report["transient"])
    assert any("fused.shared_scratch" in name or "_gates" in name for name in report["allocations"])
    # production mode reads no device value on any of these paths (a read is a host sync: it
    # would stall the scheduler's CPU side under overlap scheduling)
    assert report["value_reads"] == {}


def check_agrees(report: dict, name: str, mode: str) -> None:
    """Issue 21's item 5: the rehearsal of a capacity column gets the pool and the per-token
    charge ``bench/capacity.py`` computes for it, from SGLang's real configurator."""
    if name.startswith("stripe:"):
        name, mode = name[len("stripe:"):], "tp_stripe"
    if name.startswith("dcp:"):
        name, mode = name[len("dcp:"):], "dcp_stripe"
    model, gpu, *layout = name.split("/")
    col = CAPACITY[(model, gpu, mode, layout[0] if layout else "fp8")]
    assert report["pool_tokens"] == col["pool_tokens"], (name, col["ratio"])
    assert report["cell_bytes"] == col["cell_bytes"], (name, col["ratio"])


DP_NAMES = sorted(k for k in BATCHES["dp"] if "/" in k)
TP_NAMES = sorted(BATCHES["tp"])


@pytest.mark.xdist_group("rehearse_dp")
@pytest.mark.parametrize("name", DP_NAMES)
def test_every_dp_combination_fits(dp_reports, name):
    report = dp_reports[name]
    check_fits(report)
    check_agrees(report, name, "dp")
    assert report["config"]["chunk_tokens"] == (8192 if "h200" in name else 16384) // 8


@pytest.mark.xdist_group("rehearse_tp")
@pytest.mark.parametrize("name", TP_NAMES)
def test_every_tp_combination_fits(tp_reports, name):
    report = tp_reports[name]
    check_fits(report)
    check_agrees(report, name, "tp")
    assert report["config"]["chunk_tokens"] == (8192 if "h200" in name else 16384)
    index_k = report["allocations"]["pool.index_key_cache.buffer[*]"]["bytes"]
    pages = (report["pool_tokens"] * (1 + report["plan"]["ulacache_config"]["cpu_ratio"])
             + 64 + 1) // 64  # SGLang's IndexKeyCache count over the logical space
    layers = 78 if name.split("/")[0].endswith("glm-5") else 61
    # striped: ceil(pages / 8) + trash and zero pages per layer; replicated: every page
    stored = -(-pages // 8) + 2 if name.startswith(("stripe:", "dcp:")) else pages
    assert index_k == stored * 64 * 132 * layers, (name, index_k, stored)
    buffered = [k for k in report["allocations"] if ".buffers" in k or "_gates" in k]
    if name.startswith("dcp:"):  # mode "dcp": the DP core over the stripe, no buffer, no gates
        assert buffered == [] and report["plan"]["mode"] == "dcp", buffered
    else:
        assert buffered, name


@pytest.mark.xdist_group("rehearse_dp")
def test_draft_tokens_add_a_verify_batch(dp_reports):
    report = dp_reports["draft"]
    check_fits(report)
    assert "verify" in report["transient"] and report["config"]["steps"] == 3


@pytest.mark.xdist_group("rehearse_dp")
def test_prefetch_allocations_are_charged_and_nothing_outlives_a_step(dp_reports):
    """The look-ahead prefetch at production geometry (GLM-5 on an H200, both sources, a
    verify batch): its claim table, fused scratch, budgets and draft buffers are allocated at
    start-up within SGLang's budget (the sizing hook charges them), and a decode or verify
    step keeps no selection alive after it returns (the rehearsal's retained check)."""
    report = dp_reports["prefetch"]
    check_fits(report)
    names = set(report["allocations"])
    assert {"coord.prefetch.sources[*].buffers[*]", "pool.core.groups[*].prefetch_claim",
            "coord.prefetch.budgets"} <= names
    assert report["retained"]["decode"] == report["retained"]["verify"] == 0
    # the prefetch's bytes came out of the pool: fewer tokens than the same launch without
    assert report["pool_tokens"] < dp_reports["draft"]["pool_tokens"]


@pytest.mark.xdist_group("rehearse_dp")
def test_transient_peak_over_the_headroom_is_refused_naming_the_call(dp_reports):
    report = dp_reports["headroom"]
    assert not report["ok"]
    assert any("transient peak" in f and "outside the static pool" in f for f in report["fails"])


@pytest.mark.xdist_group("rehearse_dp")
def test_max_total_tokens_caps_the_pool_so_the_cpu_tier_fits_the_host(dp_reports):
    report = dp_reports["capped"]
    check_fits(report)
    assert report["pool_tokens"] == CAPPED
    col = CAPACITY[("glm-5", "b300", "dp", "fp8")]
    assert col["host_bound"] and col["ratio"] == 2


@pytest.mark.xdist_group("rehearse_dp")
def test_pool_too_small_for_a_step_does_not_start(dp_reports):
    report = dp_reports["small pool"]
    assert not report["ok"]
    assert any("one step's selections" in f for f in report["fails"])


@pytest.mark.xdist_group("rehearse_tp")
def test_cli_refuses_a_cpu_tier_over_the_host_budget_in_one_line():
    p = subprocess.run(
        [sys.executable, "-m", "ulacache.tools.cli", "rehearse", "--model", "glm-5", "--gpu",
         "b300", "--mode", "dp", "--ulacache-config", '{"cpu_ratio": 2}',
         "--max-running-requests", "256"],
        capture_output=True, text=True, timeout=900, env=ENV)
    assert p.returncode == 1
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("  DOES NOT FIT:") and "CPU tier" in last and "host budget" in last
