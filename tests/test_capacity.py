"""The capacity accounting (ulacache.tools.capacity; bench/capacity.py is its command line):
the paper's two capacity figures, the accounting's sanity, its JSON
contract, that its ulacache columns charge what the SGLang sizing hook charges
(``ulacache.sizing.table_bytes_per_slot`` and ``coordinator_output_bytes``), and (marked
``sglang``) that its per-token bytes equal SGLang 0.5.23's own sizing, the hook's included."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import textwrap
from functools import cached_property
from itertools import product
from pathlib import Path

import pytest

from ulacache.pblru import DEFAULT_BUCKETS
from ulacache.tools import capacity as cap

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_capacity", ROOT / "bench" / "capacity.py")
cli = importlib.util.module_from_spec(_spec)  # the command line (table, PNG, JSON)
sys.modules[_spec.name] = cli
_spec.loader.exec_module(cli)

GEOMS = list(product(("glm5", "dsv32"), ("fp8", "bf16")))
S = cap.LENGTHS


def inputs(model="glm5", layout="fp8", kv_gb=179.0, host_gb=192.0, **kw) -> cap.Inputs:
    return cap.Inputs(model, layout, "b300", int(kv_gb * cap.GB), int(host_gb * cap.GB), **kw)


class SharedIndexer(cap.Inputs):
    """GLM-5 with one indexer per 4 layers (GLM-5.2's IndexShare shape): 20 selection groups
    over 78 layers, so a charge per layer and a charge per group differ."""

    @cached_property
    def geometry(self):
        return cap.ModelGeometry.glm5(layout=self.layout, layers_per_indexer=4)


def test_paper_tp8_unique_share_is_one_eighth():
    """Figure 2(a): resident TP8 stores every token on every rank, 12.5% unique."""
    assert cap.paper_checks()["tp8_unique_fraction"] == {"computed": 0.125, "paper": 0.125}
    for model, layout in GEOMS:
        c = cap.capacity(inputs(model, layout), "sglang_tp")
        assert c.unique > 0 and 8 * c.unique == c.gpu_slots


def test_paper_hisparse_30m_unique_in_53m_slots():
    """Figure 2(b): 30.0M CPU + 23.3M GPU slots, 56.29% unique (8xB300, GLM-5 FP8)."""
    hs = cap.paper_checks()["hisparse_fig2b"]
    assert round(hs["cpu_slots"] / 1e6, 1) == 30.0 and hs["unique"] == hs["cpu_slots"]
    assert round(hs["gpu_slots"] / 1e6, 1) == 23.3
    assert round((hs["cpu_slots"] + hs["gpu_slots"]) / 1e6, 1) == 53.3
    assert round(100 * hs["unique_fraction_from_rounded_millions"], 2) == 56.29
    assert abs(hs["unique_fraction"] - 0.5629) < 2e-4
    assert round(hs["alt_reading_gpu_slots"] / 1e6, 1) != 23.3  # the other reading does not
    # the table's HiSparse model on the same budgets holds the same 30.0M unique tokens
    assert round(cap.capacity(inputs(), "hisparse_dp").unique / 1e6, 1) == 30.0


@pytest.mark.parametrize("model,layout", GEOMS)
def test_more_memory_never_less_capacity(model, layout):
    for system in cap.SYSTEMS:
        for (kv0, h0), (kv1, h1) in (((60, 128), (120, 128)), ((60, 64), (60, 192))):
            a, b = inputs(model, layout, kv0, h0), inputs(model, layout, kv1, h1)
            assert cap.capacity(b, system).unique >= cap.capacity(a, system).unique, system
            ra = [cap.max_requests(a, system, n)[0] for n in S]
            rb = [cap.max_requests(b, system, n)[0] for n in S]
            assert all(y >= x for x, y in zip(ra, rb)), (system, ra, rb)
            assert rb == sorted(rb, reverse=True), (system, rb)  # longer requests: fewer


@pytest.mark.parametrize("model,layout", GEOMS)
def test_ulacache_against_hisparse_and_sharded_keys_beat_replicated(model, layout, monkeypatch):
    """Exclusive tiers beat an inclusive mirror on unique tokens whenever the host binds; where
    the GPU binds (high ratios), ulacache's tables (~24 B per logical token per group, one group
    per layer) and its coordinator's output rows can cost it more than HiSparse saves, and only
    they: without them ulacache DP is never below HiSparse."""
    budgets = ((27, 128), (60, 256), (179, 192), (186, 64))
    for kv, host in budgets:
        inp = inputs(model, layout, kv, host)
        ula, hs = cap.capacity(inp, "ulacache_dp"), cap.capacity(inp, "hisparse_dp")
        assert ula.cpu_slots * inp.lat <= inp.host_bytes * 8
        assert ula.unique == ula.gpu_slots + ula.cpu_slots  # exclusive: every slot unique
        if kv >= 179:  # host-bound: B300-like GPU budget
            assert ula.unique >= hs.unique
            for n in S:
                assert (cap.max_requests(inp, "ulacache_dp", n)[0]
                        >= cap.max_requests(inp, "hisparse_dp", n)[0])
        shard = cap.capacity(inp, "ulacache_tp_shard")
        repl = cap.capacity(inp, "ulacache_tp_repl")
        assert shard.unique > repl.unique
        for n in S:
            assert (cap.max_requests(inp, "ulacache_tp_shard", n)[0]
                    >= cap.max_requests(inp, "ulacache_tp_repl", n)[0])
    with_tables = [cap.capacity(inputs(model, layout, kv, h), "ulacache_dp").unique
                   for kv, h in budgets]
    monkeypatch.setattr(cap, "_tables", lambda *a, **k: (0, 0))
    monkeypatch.setattr(cap, "coordinator_outputs", lambda *a, **k: 0)
    for (kv, host), charged in zip(budgets, with_tables):
        inp = inputs(model, layout, kv, host)
        free = cap.capacity(inp, "ulacache_dp").unique
        assert free >= max(charged, cap.capacity(inp, "hisparse_dp").unique)


def test_ulacache_dp_charge_is_the_sizing_hooks():
    """DeepSeek-V3.2 FP8, cpu_ratio 4 (docs/sglang.md's example): SGLang's cell 80,276 B
    (61 x (656 + 5 x 132)) + ulacache's tables and fused call scratch 2,416 B per GPU slot, the
    formula's own figure;
    fixed: the tables' fixed bytes + the tail page (64 rows per layer) + the coordinator's
    output rows for 64 running requests + the padding row (61 groups x 65 x 2048 x 4 B + 65 x
    8 B = 32,481,800 B) + the prefill stage (one layer, 163,968 rows of 656 B). The pool is
    SGLang's ``(D - fixed) // cell`` in whole pages. The figures move with the ratio."""
    from ulacache.sizing import table_bytes_per_slot

    inp = inputs("dsv32", "fp8", host_gb=10**6)
    per, fixed = table_bytes_per_slot(61, ratio=5, page_size=64, n_buckets=DEFAULT_BUCKETS,
                                      policy="pblru")
    assert (inp.groups, per) == (61, 2416)
    cell, fix = cap.ulacache_dp_charge(inp, 4)
    assert cell == 61 * (656 + 5 * 132) + per == 80276 + 2416
    # + the prefill stage: 163,840 context rows + sink page + scratch, in whole pages
    assert inp.stage_bytes == 163968 * 656
    assert fix == fixed + 64 * 61 * 656 + 32481800 + 163968 * 656
    assert cap.ulacache_dp_charge(inp, 4, staged=False) == (cell, fix - 163968 * 656)
    assert cap.ulacache_dp_pool(inp, 4) == (inp.kv_bytes - fix) // cell // 64 * 64
    # the tables' per-slot cost grows with the ratio (mapping, claim table)
    cells = [cap.ulacache_dp_charge(inp, c)[0] - 61 * (656 + 132 * (1 + c)) for c in range(6)]
    assert cells == sorted(cells) and len(set(cells)) == 6
    assert cap.ulacache_dp_charge(inputs(), 4)[0] - 78 * (656 + 5 * 132) == 3076  # GLM-5


def test_ulacache_tp_charge_is_the_sizing_hooks():
    """TP: ``ceil(lat / P)`` + index-K in full + the rank's tables per global GPU token; fixed:
    the tables' fixed bytes (buffer holders, PB-LRU over B per group) + (B + 128) rows per
    layer (sink page, scratch, B buffer rows, padding to a page) + the coordinator's output
    rows (as in DP: 64 + 1 request slots)."""
    from ulacache.sizing import table_bytes_per_slot

    inp = inputs("dsv32", "fp8")
    B = cap.tp_buffer_rows(inp, 64)
    per, fixed = table_bytes_per_slot(61, ratio=5, page_size=64, n_buckets=DEFAULT_BUCKETS,
                                      policy="pblru", tp_size=8, buffer_slots=B, layers=61)
    cell, fix = cap.ulacache_tp_charge(inp, 4, B)
    assert cell == -(-61 * 656 // 8) + 5 * 61 * 132 + per
    assert cell - per == 45262 and per == 299  # docs/sglang.md's DeepSeek-V3.2 TP8 example
    assert fix == fixed + (B + 128) * 61 * 656 + 32481800
    shard_cell, shard_fix = cap.ulacache_tp_charge(inp, 4, B, shard_index=True)
    # striped (stripe_index_k): index-K / P per token, three pages per indexer layer fixed
    assert shard_cell == -(-61 * 656 // 8) + -(-5 * 61 * 132 // 8) + per
    assert shard_fix == fix + 3 * 64 * 61 * 132


def _hand_fixed(inp, mode, c, running, buffer_rows=0):
    """The sizing hook's fixed bytes by hand from ``ulacache.sizing``: tables' fixed part, the
    DP tail page and prefill stage (one layer of the context length's rows, page-aligned
    around a sink page and a scratch row) or the TP rows, and the output rows per selection
    group over ``running + 1`` slots of ``draft`` steps."""
    from ulacache.sizing import table_bytes_per_slot

    tp = mode == "tp"
    _, fixed = table_bytes_per_slot(inp.groups, ratio=1 + c, page_size=64,
                                    n_buckets=DEFAULT_BUCKETS, policy="pblru",
                                    tp_size=8 if tp else 1, buffer_slots=buffer_rows,
                                    layers=inp.layers if tp else 0)
    stage = -(-(64 + cap.CONTEXT_LEN[inp.model] + 1) // 64) * 64 * inp.row
    rows = (buffer_rows + 128) * inp.lat if tp else 64 * inp.lat + stage
    steps = (running + 1) * inp.draft_tokens
    return fixed + rows + inp.groups * steps * inp.top_k * 4 + steps * 8


def test_output_rows_are_charged_per_selection_group():
    """With 20 selection groups over 78 layers, 128 running requests and 3 draft tokens, the
    output rows are 20 x 129 x 3 x 2048 x 4 B + 129 x 3 x 8 B in both modes, on top of the
    charge without them: not per layer, not dropped, not for one step, not for ``running``
    slots without the padding row."""
    inp = SharedIndexer("glm5", "fp8", "b300", 179 * cap.GB, 192 * cap.GB, draft_tokens=3,
                        running=128)
    assert (inp.groups, inp.layers) == (20, 78)
    out = 20 * 129 * 3 * 2048 * 4 + 129 * 3 * 8
    assert cap.coordinator_outputs(inp) == out == 63_409_176
    assert cap.coordinator_outputs(inp, 0) == 20 * 3 * 2048 * 4 + 3 * 8
    B = cap.tp_buffer_rows(inp, 128)
    for c in (0, 3):
        assert cap.ulacache_dp_charge(inp, c)[1] == _hand_fixed(inp, "dp", c, 128)
        assert cap.ulacache_tp_charge(inp, c, B)[1] == _hand_fixed(inp, "tp", c, 128, B)
        # the charge moves with `running` by exactly the rows' difference
        for running in (0, 7):
            d = cap.coordinator_outputs(inp) - cap.coordinator_outputs(inp, running)
            assert (cap.ulacache_dp_charge(inp, c)[1]
                    - cap.ulacache_dp_charge(inp, c, running)[1]) == d
            assert (cap.ulacache_tp_charge(inp, c, B)[1]
                    - cap.ulacache_tp_charge(inp, c, B, running=running)[1]) == d
    # the capacity columns charge Inputs.running: more running requests, fewer unique tokens
    small, big = inputs(kv_gb=27, host_gb=128, running=1), inputs(kv_gb=27, host_gb=128)
    for system in ("ulacache_dp_whole", "ulacache_tp_repl", "ulacache_tp_shard"):
        assert cap.capacity(big, system).unique < cap.capacity(small, system).unique, system
    # ... but never more than a DP launch can run (the coordinator refuses a step that does
    # not fit the pool): the staged column's pool (c = 64 here) holds the decode step of
    # fewer than 64 requests, so it charges (and rehearses) only those
    pt = cap.capacity(big, "ulacache_dp")
    step = big.top_k + 1
    assert pt.running < 64 and pt.running * step <= pt.pool < (pt.running + 1) * step
    huge = cap.capacity(inputs(kv_gb=40, host_gb=128, running=4096), "ulacache_dp_whole")
    assert 64 < huge.running < 4096 and huge.running * step <= huge.pool


@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_admission_charges_the_admitted_count(mode):
    """The concurrency columns charge the output rows (and in TP the buffer) for the admitted
    ``R`` itself, whatever ``Inputs.running`` says: a GPU budget that fits exactly 4 requests of
    32K per worker with their output rows admits 4 (DP: 32 over 8 ranks) and one byte less
    admits 3. No CPU tier (host 0), 20 selection groups (a per-layer charge would not fit), 2
    draft tokens."""
    S = 32768
    probe = SharedIndexer("glm5", "fp8", "b300", 0, 0, draft_tokens=2)
    system = "ulacache_dp" if mode == "dp" else "ulacache_tp_repl"
    B = cap.tp_buffer_rows(probe, 4, S) if mode == "tp" else 0
    cell = (cap.ulacache_dp_charge(probe, 0)[0] if mode == "dp"
            else cap.ulacache_tp_charge(probe, 0, B)[0])
    exact = _hand_fixed(probe, mode, 0, 4, B) + 4 * S * cell
    scale = 8 if mode == "dp" else 1
    for running in (1, 64, 4096):  # the capacity columns' setting does not enter
        at = SharedIndexer("glm5", "fp8", "b300", exact, 0, draft_tokens=2, running=running)
        below = SharedIndexer("glm5", "fp8", "b300", exact - 1, 0, draft_tokens=2,
                              running=running)
        assert cap.max_requests(at, system, S) == (4 * scale, 0)
        assert cap.max_requests(below, system, S) == (3 * scale, 0)


def test_uncharged_device_memory():
    """What SGLang's sizing leaves uncharged, per GPU: HiSparse's mapping over its logical
    tokens and its coordinator's request-slot tables (GLM-5 by hand: 4,907,040 B per slot with
    a 202,752-token context); ulacache only its logical page list (its coordinator rows are
    charged by the sizing hook)."""
    inp = inputs()
    hs = cap.capacity(inp, "hisparse_dp")
    u = cap.uncharged(inp, "hisparse_dp", hs.ratio, hs.pool)
    assert u["per_request_slot"] == (2 * 4 * 78 * 4160 + 2 * 78 * 4096 + 8 * 4160
                                     + 8 * (202752 + 4 + 64) + 8 * 2048) == 4907040
    assert u["fixed"] == 8 * (2 * hs.pool + 65) + 8 * (2 * hs.pool // 64)
    assert u["request_slots"] == 4097  # 1.88M slots / 202,752 x 512 > 4096: the cap, + slot 0
    assert u["total"] == u["fixed"] + 4097 * 4907040
    ula = cap.capacity(inp, "ulacache_dp")
    v = cap.uncharged(inp, "ulacache_dp", ula.ratio, ula.pool)
    assert (v["per_request_slot"], v["request_slots"]) == (0, 65)
    assert v["fixed"] == v["total"] == 8 * ((1 + ula.ratio) * ula.pool // 64)
    assert cap.uncharged(inp, "ulacache_tp_repl", 4, 10**6) == {
        "fixed": 8 * (5 * 10**6 // 64), "per_request_slot": 0, "request_slots": 65,
        "total": 8 * (5 * 10**6 // 64)}
    assert cap.uncharged(inp, "sglang_dp", None, 10**6) is None
    small = inputs(kv_gb=27)  # a small pool: SGLang's floor of 2048 request slots
    assert cap.sglang_request_slots(small, cap.resident_pool(small)) == 2049


def test_resident_and_tp_buffer_arithmetic():
    """Hand numbers: GLM-5 FP8 resident cell 78 x (656 + 132) = 61,464 B; the TP buffer rule."""
    inp = inputs(kv_gb=179.0)
    assert (inp.lat, inp.idx) == (51168, 10296)
    assert cap.resident_pool(inp) == 179 * 10**9 // 61464 // 64 * 64
    assert cap.tp_buffer_rows(inp, 64) == 64 * 2049
    assert cap.tp_buffer_rows(inp, 1, 131072) == 131072 - 16384  # a prefill's peer share


def test_json_contract():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "capacity.py"), "--json", "--png", "",
         "--platforms", "b300", "--models", "glm5", "--layouts", "fp8"],
        capture_output=True, text=True, check=True, timeout=120)
    res = json.loads(out.stdout)
    assert set(res) == {"assumptions", "paper_checks", "rows"}
    assert res["assumptions"]["accounting"].startswith("arithmetic")
    assert [r["system"] for r in res["rows"]] == list(cap.SYSTEMS)
    keys = {"platform", "model", "layout", "system", "ratio", "unique_tokens",
            "gpu_latent_slots", "cpu_latent_slots", "unique_fraction", "gpu_kv_bytes",
            "host_kv_bytes", "tokens_per_gpu_gb", "tokens_per_host_gb", "max_requests",
            "ratio_at", "uncharged_gpu_bytes", "gpu_bytes_by_component",
            "gpu_bytes_per_unique_token", "cell_bytes", "table_bytes_per_gpu_token",
            "tables_fraction_of_cell", "pool_tokens", "running", "host_bound"}
    for r in res["rows"]:
        assert set(r) == keys
        assert set(r["max_requests"]) == set(r["ratio_at"]) == {str(n) for n in S}
        assert 0 < r["unique_fraction"] <= 1
        assert r["gpu_kv_bytes"] <= 8 * 179 * cap.GB and r["host_kv_bytes"] <= 8 * 192 * cap.GB
        u = r["uncharged_gpu_bytes"]
        assert (u is None) == r["system"].startswith("sglang")
        assert u is None or u["total"] == u["fixed"] + u["per_request_slot"] * u["request_slots"]
    assert set(res["paper_checks"]) == {"tp8_unique_fraction", "hisparse_fig2b"}


def test_table_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "c.png"
    assert cli.main(["--platforms", "h200", "--models", "dsv32", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ACCOUNTING" in out and "TP8 resident unique share: computed 12.5% vs paper 12.5%" in out
    assert "56.29% from 0.1M-rounded counts" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# SGLang's own sizing, evaluated in a child (publishing server args is process-global state).
_SGLANG_SIZES = textwrap.dedent("""
    import json, types, torch
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
    from sglang.srt.mem_cache.sparsity import parse_hisparse_config

    ARCH = {"glm5": ("GlmMoeDsaForCausalLM", 78), "dsv32": ("DeepseekV32ForCausalLM", 61)}
    DT = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
    out = {"cells": {}}
    for ratio in (0, 1, 2, 5):  # 0: stock resident pool; else HiSparse at that ratio
        extra = [] if not ratio else ["--enable-hisparse", "--hisparse-config",
                                      json.dumps({"host_to_device_ratio": ratio})]
        sa = prepare_server_args(["--model-path", "dummy", "--device", "cpu"] + extra)
        sa.resolve_once()
        publish(sa, role="scheduler")
        for (model, (arch, layers)), (layout, dt) in [(m, d) for m in ARCH.items()
                                                      for d in DT.items()]:
            hf = types.SimpleNamespace(architectures=[arch], index_head_dim=128,
                                       index_topk=2048, num_hidden_layers=layers)
            mc = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, kv_lora_rank=512,
                                       qk_rope_head_dim=64, num_hidden_layers=layers)
            kvc = types.SimpleNamespace(
                model_config=mc, kv_cache_dtype=dt, use_mla_backend=True, server_args=sa,
                is_draft_worker=False, pp_size=1, mambaish_config=None,
                layer_info=types.SimpleNamespace(start_layer=0, end_layer=layers,
                                                 num_effective_layers=layers))
            self = object.__new__(DefaultPoolConfigurator)
            out["cells"][f"{model}/{layout}/{ratio}"] = {
                "row": calculate_mla_kv_cache_dim(model_config=mc, kv_cache_dtype=dt)
                * torch._utils._element_size(dt),
                "cell": DefaultPoolConfigurator._compute_cell_size(self, kvc, layers),
                "index": DefaultPoolConfigurator._compute_dsa_indexer_cell_size(
                    self, kvc=kvc, num_layers=layers)}
    sa = prepare_server_args(["--model-path", "dummy", "--device", "cpu", "--enable-hisparse"])
    sa.resolve_once()
    publish(sa, role="scheduler")
    c = parse_hisparse_config()
    out["defaults"] = {"top_k": c.top_k, "device_buffer_size": c.device_buffer_size,
                       "host_to_device_ratio": c.host_to_device_ratio}
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.sglang
def test_formulas_equal_sglang_sizing():
    """Our per-token bytes equal SGLang's: resident cell ``lat + idx``, HiSparse cell
    ``lat + idx * ratio``, the latent row, and HiSparse's default buffer (2 x top_k = 4096)."""
    pytest.importorskip("sglang")
    out = subprocess.run([sys.executable, "-c", _SGLANG_SIZES], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    for model, layout in GEOMS:
        inp = inputs(model, layout)
        for ratio in (0, 1, 2, 5):
            got = res["cells"][f"{model}/{layout}/{ratio}"]
            assert got["row"] == inp.row
            assert got["index"] == inp.idx * max(ratio, 1)
            assert got["cell"] == inp.lat + inp.idx * max(ratio, 1)
            if ratio:  # HiSparse's device pool per rank is SGLang's: budget // that cell
                x = ratio
                g = inp.kv_bytes // got["cell"] // cap.PAGE * cap.PAGE
                assert cap.hisparse_pool(inputs(model, layout, host_gb=10**6), x) == g
            else:
                assert cap.resident_pool(inp) == inp.kv_bytes // got["cell"] // 64 * 64
    assert res["defaults"] == {"top_k": 2048, "device_buffer_size": 4096,
                               "host_to_device_ratio": 2}
    assert cap.Inputs("glm5", "fp8", "b300", 1, 1).device_buffer == 4096


# SGLang's real configurator through ulacache's sizing hook, in a child (as above).
_HOOKED_SIZES = textwrap.dedent(f"""
    import itertools, json, sys, types, torch
    sys.path.insert(0, {str(ROOT)!r})
    from transformers import PretrainedConfig
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from ulacache.config import SGLangOptions
    from ulacache.patches import launch, sglang_sizing as sz

    ARCH = {{"glm5": ("GlmMoeDsaForCausalLM", 78), "dsv32": ("DeepseekV32ForCausalLM", 61),
            "glm52": ("GlmMoeDsaForCausalLM", 78)}}
    # glm52: SGLang reads the sharing from indexer_types (dsa_layer_skips_topk)
    TYPES = {{"glm52": json.loads(sys.argv[2])}}
    CONTEXT_LEN = {cap.CONTEXT_LEN!r}  # SGLang's context_len: sizes the prefill stage
    DTYPES = {{"fp8": (torch.float8_e4m3fn, "fp8_e4m3"), "bf16": (torch.bfloat16, "bfloat16")}}
    budget = int(sys.argv[1])
    launch.tp_group = lambda: types.SimpleNamespace(world_size=8)
    out = {{}}
    for c in (2, 4):
        sa = prepare_server_args(["--model-path", "dummy", "--device", "cpu",
                                  "--enable-hisparse", "--hisparse-config",
                                  json.dumps({{"host_to_device_ratio": 1 + c}}),
                                  "--max-running-requests", "64"])
        sa.resolve_once()
        publish(sa, role="scheduler")
        for (model, (arch, layers)), (layout, (dtype, dtype_str)) in itertools.product(
                ARCH.items(), DTYPES.items()):
            extra = {{"indexer_types": TYPES[model]}} if model in TYPES else {{}}
            hf = PretrainedConfig(architectures=[arch], index_head_dim=128, index_topk=2048,
                                  num_hidden_layers=layers, **extra)
            mc = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, kv_lora_rank=512,
                                       qk_rope_head_dim=64, num_hidden_layers=layers,
                                       context_len=CONTEXT_LEN[model],
                                       linear_attn_registry_result=None)
            kvc = types.SimpleNamespace(
                model_config=mc, kv_cache_dtype=dtype,
                kv_cache_dtype_str=dtype_str, use_mla_backend=True, pool_page_size=64,
                server_args=sa, is_draft_worker=False, pp_size=1, mambaish_config=None,
                spec_algorithm=SpeculativeAlgorithm.NONE,
                layer_info=types.SimpleNamespace(start_layer=0, end_layer=layers,
                                                 num_effective_layers=layers))
            for mode in ("dp", "tp", "tp_stripe", "dcp_stripe"):
                opts = SGLangOptions(mode=mode.split("_")[0], cpu_ratio=c,
                                     stripe_index_k=mode != "dp" and mode != "tp")
                launch.sglang_options = sz.sglang_options = lambda: opts
                # a --dcp-size 8 launch's parallel widths: stock charges index-K x 8 per token
                dcp = 8 if mode == "dcp_stripe" else 1
                get_parallel().override_permanently(dcp_enabled=dcp > 1, dcp_size=dcp,
                                                    attn_dcp_size=dcp)
                conf = object.__new__(DefaultPoolConfigurator)
                sz.pool_configurator_init_around(DefaultPoolConfigurator.__init__, conf, kvc)
                lp = launch.plan_launch(kvc)  # what the sizing hook charged, the pool builds
                out[f"{{model}}/{{layout}}/{{mode}}/{{c}}"] = {{
                    "cell": conf._cell_size, "fixed": conf._fixed_overhead_bytes,
                    "tokens": conf.calculate_pool_sizes(budget, 64).max_total_num_tokens,
                    "groups": len(lp.layer_groups(layers)),
                    "sized": {{"buffer_slots": lp.buffer_slots, "tp_size": lp.tp_size}}
                    if mode != "dp" else {{}}}}
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.sglang
def test_ulacache_columns_equal_the_hooked_sglang_sizing():
    """capacity.py's ulacache cell, fixed overhead (tables, tail page or TP rows, coordinator
    output rows), pool size and group count are what SGLang's real ``DefaultPoolConfigurator``
    gives through ``patches/sglang_sizing.py``: GLM-5, DeepSeek-V3.2 and the GLM-5.2-style
    preset (21 indexer layers; the hook takes the shared layers' index-K back), FP8 and BF16
    KV, ``cpu_ratio`` 2 and 4, DP, TP8 and TP8 with index-K striped by page, buffered and
    under DCP (``--dcp-size 8`` published), ``--max-running-requests 64``
    (``Inputs.running``)."""
    pytest.importorskip("sglang")
    budget = inputs().kv_bytes
    anchors = set(cap.indexer_layers(78, cap.SHARING["glm52"]))
    types_ = json.dumps(["full" if la in anchors else "shared" for la in range(78)])
    out = subprocess.run([sys.executable, "-c", _HOOKED_SIZES, str(budget), types_],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    for model, layout in itertools.product(("glm5", "dsv32", "glm52"), ("fp8", "bf16")):
        # the GPU budget alone binds, as in SGLang; 64 = the published --max-running-requests
        inp = inputs(model, layout, host_gb=10**6, running=64)
        B = cap.tp_buffer_rows(inp, 64)
        for c in (2, 4):
            dp, tp = res[f"{model}/{layout}/dp/{c}"], res[f"{model}/{layout}/tp/{c}"]
            assert dp["groups"] == tp["groups"] == inp.groups == inp.anchors
            assert inp.anchors == (21 if model == "glm52" else inp.layers)
            assert (dp["cell"], dp["fixed"]) == cap.ulacache_dp_charge(inp, c)
            assert dp["tokens"] == cap.ulacache_dp_pool(inp, c)
            assert tp["sized"] == {"buffer_slots": B, "tp_size": 8}
            assert (tp["cell"], tp["fixed"]) == cap.ulacache_tp_charge(inp, c, B)
            assert tp["tokens"] == cap.ulacache_tp_pool(inp, c, B, False)
            st = res[f"{model}/{layout}/tp_stripe/{c}"]  # index-K striped by page
            assert (st["cell"], st["fixed"]) == cap.ulacache_tp_charge(inp, c, B, True)
            assert st["tokens"] == cap.ulacache_tp_pool(inp, c, B, True)
            # mode "dcp" (--dcp-size 8): no buffer, the stripe's DP tables, stock's index-K
            # x dcp_size taken back
            dc = res[f"{model}/{layout}/dcp_stripe/{c}"]
            assert dc["sized"] == {"buffer_slots": 0, "tp_size": 8}
            assert (dc["cell"], dc["fixed"]) == cap.ulacache_tp_charge(inp, c, 0, True, dcp=True)
            assert dc["tokens"] == cap.ulacache_tp_pool(inp, c, 0, True, dcp=True)


def test_gpu_bytes_split_by_component():
    """Every row's GPU bytes split into latent, index-K, tables and fixed parts that sum to
    what SGLang's sizing charges; the tables' share of the cell is the sizing hook's figure."""
    res = cap.run(platforms="h200", models="glm5", layouts="fp8", lengths=(131072,))
    rows = {r["system"]: r for r in res["rows"]}
    for r in rows.values():
        parts = r["gpu_bytes_by_component"]
        assert set(parts) == {"latent", "index_k", "tables", "fixed"}
        assert sum(parts.values()) == r["gpu_kv_bytes"]
        per = r["gpu_bytes_per_unique_token"]
        assert abs(sum(per.values()) * r["unique_tokens"] - r["gpu_kv_bytes"]) < 1e-3 * \
            r["gpu_kv_bytes"]
    for name in ("sglang_dp", "hisparse_dp", "hisparse_tp"):
        assert rows[name]["gpu_bytes_by_component"]["tables"] == 0
        assert rows[name]["tables_fraction_of_cell"] == 0.0
    dp = rows["ulacache_dp"]
    inp = inputs()
    per = cap._tables(inp.groups, 1 + dp["ratio"])[0]
    cell = cap.ulacache_dp_charge(inp, dp["ratio"])[0]
    assert dp["table_bytes_per_gpu_token"] == per and dp["cell_bytes"] == cell
    assert dp["tables_fraction_of_cell"] == per / cell
    # index-K for every logical token: (1 + cpu_ratio) rows per GPU slot
    assert dp["gpu_bytes_by_component"]["index_k"] == \
        dp["gpu_latent_slots"] * inp.idx * (1 + dp["ratio"])


def test_shared_index_preset_charges_index_k_of_the_indexer_layers_only():
    """glm52: GLM-5 with index_topk_freq 4, offset 3: 21 of 78 layers run the indexer. HiSparse
    (SGLang 0.5.23 under HiSparse) is charged every layer's index-K, resident SGLang and
    ulacache the indexer layers' only, and ulacache builds one selection group per indexer."""
    layers = cap.indexer_layers(78, cap.SHARING["glm52"])
    assert len(layers) == 21 and layers[:5] == [0, 1, 2, 6, 10] and layers[-1] == 74
    g5, g52 = inputs("glm5"), inputs("glm52")
    assert (g52.anchors, g52.groups, g52.idx, g52.idx_anchors) == (21, 21, 78 * 132, 21 * 132)
    assert (g5.anchors, g5.idx_anchors) == (78, g5.idx)
    for c in (1, 4):
        cell = cap.ulacache_dp_charge(g52, c)[0]
        assert cell == g52.lat + 21 * 132 * (1 + c) + cap._tables(21, 1 + c)[0]
    assert cap.hisparse_pool(g52, 3) == cap.hisparse_pool(g5, 3)  # every layer, both
    assert cap.resident_pool(g52) > cap.resident_pool(g5)
    for kv in (26.85, 179.0):
        a, b = inputs("glm5", kv_gb=kv), inputs("glm52", kv_gb=kv)
        assert cap.capacity(b, "ulacache_dp").unique >= cap.capacity(a, "ulacache_dp").unique


@pytest.mark.sglang  # transformers comes with the SGLang venv (CI stage 2)
def test_the_sharing_rule_is_transformers_glm_moe_dsa():
    """:func:`capacity.indexer_layers` is how transformers' ``glm_moe_dsa`` config derives
    ``indexer_types`` from ``index_topk_freq`` and ``index_skip_topk_offset``."""
    transformers = pytest.importorskip("transformers")
    mapping = transformers.CONFIG_MAPPING
    if "glm_moe_dsa" not in mapping:
        pytest.skip("this transformers has no glm_moe_dsa config")
    for n, freq, offset in ((78, 4, 3), (8, 4, 3), (20, 2, 1)):
        types_ = mapping["glm_moe_dsa"](num_hidden_layers=n, index_topk_freq=freq,
                                        index_skip_topk_offset=offset).indexer_types
        assert [i for i, t in enumerate(types_) if t == "full"] == \
            cap.indexer_layers(n, (freq, offset))


def test_staged_dp_holds_at_least_hisparse_dp_everywhere():
    """Issue 21's DP condition on the published budgets: ulacache DP8 with its prefill stage
    (the default) holds at least HiSparse DP8's unique tokens and admits at least its requests
    at 32K / 64K / 128K; GLM-5 and DeepSeek-V3.2, FP8 and BF16, 8xH200 and 8xB300. Without the
    stage (the whole-request rule) it does not on 8xH200 GLM-5 FP8. Each capacity row keeps its
    rule: staged, a pool of at least a chunk (8K on H200, 16K on B300) that holds one decode
    step of the 128K requests the system is full of; stage 0, a pool of at least 128K."""
    res = cap.run(models="glm5,dsv32")
    by = {(r["platform"], r["model"], r["layout"], r["system"]): r for r in res["rows"]}
    for plat in ("h200", "b300"):
        for model in ("glm5", "dsv32"):
            for layout in ("fp8", "bf16"):
                key = (plat, model, layout)
                ula, hs = by[key + ("ulacache_dp",)], by[key + ("hisparse_dp",)]
                assert ula["unique_tokens"] >= hs["unique_tokens"], key
                for n, r in hs["max_requests"].items():
                    assert ula["max_requests"][n] >= r, (key, n)
                g = ula["gpu_latent_slots"] // 8
                assert g >= cap.PLATFORMS[plat].chunk
                assert 2049 * ((1 + ula["ratio"]) * g // 131072) <= g
                assert by[key + ("ulacache_dp_whole",)]["gpu_latent_slots"] // 8 >= 131072
    key = ("h200", "glm5", "fp8")
    assert by[key + ("ulacache_dp_whole",)]["unique_tokens"] < \
        by[key + ("hisparse_dp",)]["unique_tokens"]


def test_tp_columns_own_pools_hold_their_share_of_a_step():
    """Every striped column is a launch that starts: each rank's own pool (``pool_tokens /
    P`` rows) holds its share of one decode step of the column's running requests with the
    margin for uneven steps, what ``check_step_capacity`` of both striped spaces demands
    (``ulacache.striping.step_share_bound``; striped GLM-5 FP8 on 8xH200 once picked c = 85,
    whose 16,384 own rows miss even the balanced 64 x 2,049 / 8 = 16,392)."""
    from ulacache.striping import step_share_bound

    res = cap.run(models="glm5,dsv32")
    tp = [r for r in res["rows"] if r["system"] in cap.TP_SYSTEMS]
    assert len(tp) == 20  # DCP: fp8 only
    for r in tp:
        own = r["pool_tokens"] // 8
        assert own >= step_share_bound(r["running"] * 2049, 8), (
            r["platform"], r["model"], r["layout"], r["system"], r["ratio"])
