"""bench/capacity.py: the paper's two capacity figures, the accounting's sanity, its JSON
contract, and (marked ``sglang``) that its per-token bytes equal SGLang 0.5.23's own sizing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from itertools import product
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_capacity", ROOT / "bench" / "capacity.py")
cap = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cap  # dataclasses resolve annotations through the module
_spec.loader.exec_module(cap)

GEOMS = list(product(("glm5", "dsv32"), ("fp8", "bf16")))
S = cap.LENGTHS


def inputs(model="glm5", layout="fp8", kv_gb=179.0, host_gb=192.0, **kw) -> cap.Inputs:
    return cap.Inputs(model, layout, "b300", int(kv_gb * cap.GB), int(host_gb * cap.GB), **kw)


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
def test_ulacache_dp_at_least_hisparse_and_sharded_keys_beat_replicated(model, layout):
    for kv, host in ((27, 128), (60, 256), (179, 192), (186, 64)):
        inp = inputs(model, layout, kv, host)
        ula, hs = cap.capacity(inp, "ulacache_dp"), cap.capacity(inp, "hisparse_dp")
        assert ula.unique >= hs.unique and ula.cpu_slots * inp.lat <= inp.host_bytes * 8
        shard = cap.capacity(inp, "ulacache_tp_shard")
        repl = cap.capacity(inp, "ulacache_tp_repl")
        assert shard.unique > repl.unique
        for n in S:
            assert (cap.max_requests(inp, "ulacache_dp", n)[0]
                    >= cap.max_requests(inp, "hisparse_dp", n)[0])
            assert (cap.max_requests(inp, "ulacache_tp_shard", n)[0]
                    >= cap.max_requests(inp, "ulacache_tp_repl", n)[0])
        # exclusive tiers: every latent slot holds a unique token
        assert ula.unique == ula.gpu_slots + ula.cpu_slots


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
            "ratio_at"}
    for r in res["rows"]:
        assert set(r) == keys
        assert set(r["max_requests"]) == set(r["ratio_at"]) == {str(n) for n in S}
        assert 0 < r["unique_fraction"] <= 1
        assert r["gpu_kv_bytes"] <= 8 * 179 * cap.GB and r["host_kv_bytes"] <= 8 * 192 * cap.GB
    assert set(res["paper_checks"]) == {"tp8_unique_fraction", "hisparse_fig2b"}


def test_table_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "c.png"
    assert cap.main(["--platforms", "h200", "--models", "dsv32", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ACCOUNTING" in out and "TP8 resident unique share: computed 12.5% vs paper 12.5%" in out
    assert "56.29% from 0.1M-rounded counts" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# SGLang's own sizing, evaluated in a child (publishing server args is process-global state).
_SGLANG_SIZES = textwrap.dedent("""
    import json, types, torch
    from sglang.srt.runtime_context import publish
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
