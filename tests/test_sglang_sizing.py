"""The sizing hook on SGLang 0.5.23's real ``DefaultPoolConfigurator`` (marked ``sglang``).

In a child process (publishing server args is process-global state) with HiSparse's ratio 5
(``cpu_ratio`` 4) published, a small DSA model (4 layers, bf16 rows of 160 B, index-K 132 B per
layer, top-k sharing pattern ``FSFF``: selection groups ``[0, 1], [2], [3]``):

- SGLang's own configurator is built stock and through the hook, in DP and in TP mode (P = 4),
  and sizes the pool from one byte budget;
- DP: ulacache's real pool is built at the hooked token count ``N`` (through the pool-build
  hook, so with the groups and the prefill stage it really builds) beside SGLang's stock
  HiSparse pool at the same ``N``; every device byte ulacache's pool allocates beyond the
  stock pool's must be what the hook charged, and the tables alone must be within the core
  formula's bound.

Checked here: the cell grows by exactly the core's per-token table bytes
(``ulacache.sizing.table_bytes_per_slot`` for the groups of SGLang's own pattern) less the
index-K of the shared layer (layer 1: the pool gives it none, as stock SGLang does without
HiSparse), the fixed
overhead by its fixed bytes plus the pool's extra rows, and the token count times the per-token
bytes plus the fixed bytes fits the budget. A hook that forgot the tables, counted layers
instead of selection groups or used ``cpu_ratio`` for the ratio fails the exact comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

AVAIL = 8 << 20  # the byte budget SGLang's profiler would hand the configurator
LAYERS, ROW, INDEX_K, RATIO, BUCKETS, P, MAX_REQS, TOP_K = 4, 160, 132, 5, 8, 4, 4, 32
GROUPS = [[0, 1], [2], [3]]
SHARED = [1]  # layers that reuse the previous layer's top-k: no index-K
# the coordinator's int32 [R, top_k] rows per group + int64 [R] row ids, R = MAX_REQS + 1
OUTPUTS = len(GROUPS) * (MAX_REQS + 1) * TOP_K * 4 + (MAX_REQS + 1) * 8

_CHILD = textwrap.dedent(f"""
    import json, sys, types, torch
    sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
    from transformers import PretrainedConfig
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from tests.helpers import device_table_bytes
    from ulacache.config import SGLangOptions
    from ulacache.patches import classes, launch, sglang_sizing as sz

    sa = prepare_server_args(["--model-path", "dummy", "--device", "cpu", "--enable-hisparse",
                              "--hisparse-config", json.dumps({{"host_to_device_ratio": {RATIO}}}),
                              "--max-running-requests", "{MAX_REQS}"])
    sa.resolve_once()
    publish(sa, role="scheduler")
    hf = PretrainedConfig(architectures=["GlmMoeDsaForCausalLM"], index_head_dim=128,
                          index_topk={TOP_K}, num_hidden_layers={LAYERS},
                          index_topk_pattern="FSFF")
    mc = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, kv_lora_rank=64,
                               qk_rope_head_dim=16, num_hidden_layers={LAYERS}, context_len=4096,
                               linear_attn_registry_result=None)
    kvc = types.SimpleNamespace(
        model_config=mc, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="bfloat16",
        use_mla_backend=True, pool_page_size=64, server_args=sa, is_draft_worker=False,
        pp_size=1, mambaish_config=None, spec_algorithm=SpeculativeAlgorithm.NONE,
        layer_info=types.SimpleNamespace(start_layer=0, end_layer={LAYERS},
                                         num_effective_layers={LAYERS}))
    out = {{}}

    def configure(opts):
        launch.sglang_options = lambda: opts
        if opts is None:
            c = DefaultPoolConfigurator(kvc)
        else:
            c = object.__new__(DefaultPoolConfigurator)
            sz.pool_configurator_init_around(DefaultPoolConfigurator.__init__, c, kvc)
        n = c.calculate_pool_sizes({AVAIL}, 64).max_total_num_tokens
        return {{"cell": c._cell_size, "fixed": c._fixed_overhead_bytes, "tokens": n}}

    out["stock"] = configure(None)
    dp = SGLangOptions(cpu_ratio={RATIO - 1}, n_buckets={BUCKETS})
    out["dp"] = configure(dp)
    launch.tp_group = lambda: types.SimpleNamespace(world_size={P})
    out["tp"] = configure(SGLangOptions(mode="tp", cpu_ratio={RATIO - 1}, n_buckets={BUCKETS}))
    lp = launch.plan_launch(kvc)  # what the hook charged and the pool-building hook passes
    out["sized"] = {{"buffer_slots": lp.buffer_slots, "tp_size": lp.tp_size}}

    N = out["dp"]["tokens"]
    kw = dict(page_size=64, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=16,
              layer_num={LAYERS}, device="cpu", index_head_dim=128, enable_memory_saver=False,
              kv_cache_dim=80, max_running_requests={MAX_REQS}, host_to_device_ratio={RATIO})
    launch.sglang_options = lambda: dp
    pool = classes._build_dsa_kv_pool_around(
        lambda self: classes.UlaCacheDSATokenToKVPool(N, **kw), kvc)  # the hook's plan
    stock = HiSparseDSATokenToKVPool(N, **kw)
    # the CPU tier and its free stacks: pinned host memory
    host = [t for g in pool.core.groups for t in (g.pools.cpu, g.pools.cpu_free_host)]
    mods = ("ulacache", "sglang.srt.mem_cache")
    out["groups"] = pool.ula_groups
    out["stage_bytes"] = pool._stage_storage.nbytes
    out["tables"] = sum(device_table_bytes(
        pool.core, host + [g.pools.gpu for g in pool.core.groups]).values())
    out["ours"] = sum(device_table_bytes(pool, host, modules=mods).values())
    out["theirs"] = sum(device_table_bytes(stock, [], modules=mods).values())
    out["index_rows"] = [b.shape[0] for b in pool.index_k_with_scale_buffer]
    out["stock_index_rows"] = [b.shape[0] for b in stock.index_k_with_scale_buffer]
    out["elided"] = sum(stock.index_k_with_scale_buffer[i].nbytes for i in {SHARED})
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def sized():
    pytest.importorskip("sglang")
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_dp_cell_grows_by_the_tables_of_the_real_groups(sized):
    from ulacache.sizing import table_bytes_per_slot

    assert sized["groups"] == GROUPS  # the pool's groups: SGLang's pattern, via the build hook
    stock, dp = sized["stock"], sized["dp"]
    assert stock == {"cell": LAYERS * (ROW + INDEX_K * RATIO), "fixed": 0,
                     "tokens": AVAIL // stock["cell"] // 64 * 64}
    per, fixed = table_bytes_per_slot(len(GROUPS), ratio=RATIO, page_size=64,
                                      n_buckets=BUCKETS)
    assert dp["cell"] - stock["cell"] == per - len(SHARED) * INDEX_K * RATIO
    assert per > 0
    # + the tail page + the coordinator's output rows (R = MAX_REQS + padding row, 1 step)
    # + the prefill stage: one layer of the context length's rows (PoolRows: sink page,
    # 4,096 rows, scratch, padding to a page: 4,224 rows)
    assert dp["fixed"] - stock["fixed"] == fixed + 64 * LAYERS * ROW + OUTPUTS + 4224 * ROW
    assert dp["tokens"] == (AVAIL - dp["fixed"]) // dp["cell"] // 64 * 64
    # this toy's tables (255 B) weigh less than the shared layer's index-K (660 B): more tokens
    assert dp["cell"] < stock["cell"] and dp["tokens"] > stock["tokens"]


def test_what_the_dp_pool_allocates_beyond_stock_is_charged(sized):
    """Every device byte ulacache's pool (tables, tail page) holds beyond SGLang's stock
    HiSparse pool of the same size is in the hook's charge; the tables within the formula's
    bound (slack: under 1 B per token plus a superblock of policy words per bucket row)."""
    from ulacache.sizing import table_bytes_per_slot

    N, stock, dp = sized["dp"]["tokens"], sized["stock"], sized["dp"]
    # the CPU pool runs the torch path: no fused call scratch is allocated (the hook charges
    # it all the same: extra <= charged below)
    per, fixed = table_bytes_per_slot(len(GROUPS), ratio=RATIO, page_size=64,
                                      n_buckets=BUCKETS, call_scratch=False)
    assert sized["tables"] <= per * N + fixed <= sized["tables"] + N + 3 * (BUCKETS + 3) * 204 + 1
    extra = sized["ours"] - sized["theirs"]
    charged = (dp["cell"] - stock["cell"]) * N + dp["fixed"] - stock["fixed"]
    assert sized["stage_bytes"] == 4224 * ROW  # allocated as charged (the plan's stage)
    assert sized["tables"] + 64 * LAYERS * ROW + sized["stage_bytes"] - sized["elided"] \
        <= extra <= charged


def test_shared_layers_get_no_index_k_and_their_charge_goes(sized):
    """SGLang builds the HiSparse pool without ``skip_topk_layers`` (its elision is off under
    HiSparse), so the pool takes the plan's flags: the shared layer's index-K buffer has no
    rows, every anchor's is the stock size; what it frees covers the charge taken back."""
    rows, stock_rows = sized["index_rows"], sized["stock_index_rows"]
    assert all(r > 0 for r in stock_rows)
    assert rows == [0 if i in SHARED else stock_rows[i] for i in range(LAYERS)]
    assert sized["elided"] >= len(SHARED) * INDEX_K * RATIO * sized["dp"]["tokens"]


def test_tp_cell_charges_one_pth_of_the_latent_the_buffer_and_the_tables(sized):
    from ulacache.sizing import table_bytes_per_slot

    stock, tp = sized["stock"], sized["tp"]
    B = MAX_REQS * (TOP_K + 1)
    assert sized["sized"] == {"buffer_slots": B, "tp_size": P}
    per, fixed = table_bytes_per_slot(len(GROUPS), ratio=RATIO, page_size=64,
                                      n_buckets=BUCKETS, tp_size=P, buffer_slots=B,
                                      layers=LAYERS)
    latent = LAYERS * ROW
    assert tp["cell"] - stock["cell"] == \
        per - (latent - -(-latent // P)) - len(SHARED) * INDEX_K * RATIO
    assert tp["fixed"] - stock["fixed"] == fixed + (B + 2 * 64) * LAYERS * ROW + OUTPUTS
    assert 0 < tp["tokens"] * tp["cell"] + tp["fixed"] <= AVAIL
    assert tp["tokens"] % 64 == 0
