"""Mode ``"dcp"`` under SGLang 0.5.23 (``--ulacache-config '{"mode": "dcp"}'``), on CPU.

Two spawned processes form a real TP group over gloo (as ``test_sglang_tp.py``); each builds
ulacache's real pool, allocator and coordinator in mode ``"dcp"`` over SGLang's own classes
and runs the same calls (SPMD). Per rank:

- every row ``swap_in_selected_pages`` / the prefill translation returns is one of this
  rank's own GPU rows and holds exactly the bytes written for its logical token; a selection
  owned by the peer comes back ``-1`` (the partial attention's padding), never a row;
- own rows hold exactly the live tokens with ``loc % P == rank``; every live token reads back
  from its owner (GPU or CPU tier);
- the pool's rows are the DP layout over ``N / P`` own slots (no buffer, nothing shared), and
  it tells SGLang's MLA write that its rows are resolved (``dcp_replicated``);
- ``alloc_extend`` agrees across ranks; the look-ahead prefetch serves each rank's stripe
  (verify batches included) without changing a row.

Single-process: the FlashMLA DCP branch (``patches/sglang_dcp.py``) against a torch
reference of FlashMLA's sparse decode, merged across two ranks' rows by SGLang's own
``cp_lse_ag_out_rs_mha`` correction arithmetic, equals attention over all rows; the model
override, server arguments and sizing hook in mode ``"dcp"``.

Not run here: SGLang refuses a DCP group on CPU (``parallel_state.py:2656-2663``), so no
forward pass runs under ``--dcp-size``; FlashMLA itself (sm_90), CUDA graphs, a real model.
"""

from __future__ import annotations

import json
import math
import os
import traceback
import types

import pytest
import torch

from .helpers import sglang_tp_ranks_init, spawn_ranks

sglang = pytest.importorskip("sglang")
pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang_dcp")]

P, PAGE, KVL, ROPE, L, N, K = 2, 64, 64, 16, 4, 512, 32
TIMEOUT_S = 240


def _harness(rank: int, **kw):
    from .test_sglang_tp import TPHarness

    class DCPHarness(TPHarness):
        """TPHarness in mode "dcp": a row exactly for each own selection."""

        def check_rows(self, layer: int, rows: torch.Tensor, locs: torch.Tensor,
                       buf: torch.Tensor | None = None) -> None:
            assert rows.dtype == torch.int32
            own = (locs >= 0) & (locs % P == self.rank)
            assert torch.equal(rows >= 0, own), (self.rank, layer)
            buf = self.pool.kv_buffer[layer] if buf is None else buf
            # an own row of the pool, or while a staged batch runs, of this rank's stage
            rows_held = self.pool.ula_stage.capacity if self.pool.staging else self.G
            for r, loc in zip(rows.reshape(-1).tolist(), locs.reshape(-1).tolist()):
                if r < 0:
                    continue
                assert PAGE <= r < PAGE + rows_held, (loc, r)  # an own row, nothing else
                if not torch.equal(buf[r, 0], self.latent[(layer, loc)]):
                    assert not self.strict, (self.rank, layer, loc, r)
                    self.mismatches += 1
                    continue
                self.seen["own"] += 1

    return DCPHarness(rank=rank, mode="dcp", **kw)


def scenario_decode(rank: int) -> dict:
    h = _harness(rank, shared=False, validate=True)
    for idx, n in ((1, 300), (2, 420), (3, 250)):  # ~485 tokens per rank > G = 256
        h.prefill(idx, n, chunk=160)
        h.check()
    h.coord.collect_ready_reqs()
    for _ in range(6):
        h.decode_step([1, 2, 3])
    h.check()
    h.finish(2)
    h.prefill(4, 90, chunk=90)
    for _ in range(2):
        h.decode_step([1, 3, 4])
    h.check()
    counters = h.core.counters()
    for idx in (1, 3, 4):
        h.finish(idx)
    h.check()
    out = {"seen": h.seen["own"], "capacity_back": h.alloc.available_size() == h.alloc.size_full,
           "kind": type(h.core).__name__, "dcp_replicated": h.pool.dcp_replicated,
           "write_span": h.pool._write_loc_dcp_span,
           "counters": {k: sum(c[k] for c in counters) for k in
                        ("promotions", "spills", "access_overflow", "place_overflow",
                         "invalid")}}
    h.close()
    return out


def scenario_shared(rank: int) -> dict:
    """Shared-index layers, production mode (validate off); then a mutant: the pool's rows
    read as if every selection were this rank's (the stripe ignored) must read wrong bytes."""
    h = _harness(rank, shared=True, validate=False)
    for idx, n in ((1, 350), (2, 300)):
        h.prefill(idx, n, chunk=200)
    h.coord.collect_ready_reqs()
    for _ in range(4):
        h.decode_step([1, 2])
    h.check()
    seen = h.seen["own"]
    space = h.core
    real = space._split

    def no_stripe(addrs, name):
        flat, inrange, mine, lpos = real(addrs, name)
        return flat, inrange, inrange, torch.where(inrange, flat // P, -1)
    space._split = no_stripe
    h.strict = False
    caught = 0
    try:
        h.decode_step([1, 2])
    except AssertionError:
        caught = 1  # a peer's selection came back as a row
    h.close()
    return {"seen": seen, "mutant_caught": caught + h.mismatches}


def scenario_pressure(rank: int) -> dict:
    h = _harness(rank, shared=False, validate=True)
    h.prefill(1, 100, chunk=100)
    z, before = torch.zeros(1, dtype=torch.int64), h.alloc.available_size()
    n = 2 * h.G + 2  # rank 0 owns G + 1 tokens: more than its own pool
    too_long = h.alloc.alloc_extend(z, z, torch.tensor([n]), torch.tensor([n]),
                                    torch.tensor([-1]), n) is None
    logical = h.alloc.logical_attn_allocator
    real = logical.alloc_extend
    if rank == 0:
        logical.alloc_extend = lambda *a, **k: None
    locs = h.alloc.alloc_extend(z, z, torch.tensor([100]), torch.tensor([100]),
                                torch.tensor([-1]), 100)
    logical.alloc_extend = real
    one_rank = locs is None
    if locs is not None:
        h.alloc.free(locs)
    out = {"too_long": too_long, "logical_one_rank": one_rank,
           "capacity_unchanged": h.alloc.available_size() == before,
           "kv_rows": h.pool.kv_buffer[0].shape[0], "G": h.G}
    h.check()
    h.close()
    return out


def scenario_prefetch(rank: int) -> dict:
    """The look-ahead prefetch (both sources, a small cap) over each rank's stripe: every row
    still holds its bytes (checked after decode steps; a verify leaves its dead draft
    mapped)."""
    from ulacache.config import PrefetchConfig

    h = _harness(rank, shared=False, validate=True,
                 prefetch=PrefetchConfig(sources=("previous_layer", "draft"), fetch_cap=16))
    for idx, n in ((1, 300), (2, 420), (3, 250)):
        h.prefill(idx, n, chunk=160)
    h.coord.collect_ready_reqs()
    for i in range(8):
        if i % 4 == 3:
            h.verify_step([1, 2, 3])
        else:
            h.decode_step([1, 2, 3])
            h.check()
    counters = h.core.counters()
    for idx in (1, 2, 3):
        h.finish(idx)
    h.check()
    out = {"capacity_back": h.alloc.available_size() == h.alloc.size_full,
           "counters": {k: sum(c[k] for c in counters) for k in
                        ("prefetches", "promotions", "access_overflow")}}
    h.close()
    return out


STAGE = 1400  # prefill_stage tokens: 700 rows per rank


def scenario_stage(rank: int) -> dict:
    """A request ~5x the group's GPU pool (650 own tokens per rank against G = 256 own slots)
    prefilled in chunks through each rank's stage, then decoded (its spilled rows promoted
    back), checks on and off; the stage's admission by each rank's own share."""
    from ulacache.patches import sglang_pool

    sglang_pool.chunked_prefill_size = lambda: 128  # a launch's resolved chunk (+ a page <= G)
    out = {}
    for validate in (True, False):
        h = _harness(rank, shared=validate, validate=validate, prefill_stage=STAGE)
        stage = h.pool.usable_stage()
        h.prefill(1, 1300, chunk=128)  # from the fifth chunk on (> 2 G tokens), staged
        staged = h.staged_chunks
        h.prefill(2, 150, chunk=150)  # beside it, a short one: one round of the pool
        from_cpu = stage.staged_from_cpu
        h.check()
        promoted = h.core.counters()[0]["promotions"]
        h.coord.collect_ready_reqs()
        for _ in range(4):
            h.decode_step([1, 2])
        h.check()
        counters = h.core.counters()
        h.finish(1)
        h.finish(2)
        h.check()
        out[f"validate={validate}"] = {
            "capacity": stage.capacity, "staged": staged, "from_cpu": from_cpu,
            "seen": h.seen["own"], "promoted_in_decode": counters[0]["promotions"] - promoted,
            "overflow": sum(c["access_overflow"] + c["invalid"] for c in counters),
            "capacity_back": h.alloc.available_size() == h.alloc.size_full}
        if validate:
            a = h.alloc
            out["fits"] = [a.prefill_fits(lens) for lens in
                           ([2 * h.G], [STAGE], [700, 700], [STAGE + 1], [701, 699])]
            z = torch.zeros(1, dtype=torch.int64)
            before = a.available_size()
            refused = []
            for n in (STAGE + 1, 2 * h.G + 2):  # past the stage; new tokens past a rank's pool
                refused.append(a.alloc_extend(z, z, torch.tensor([n]), torch.tensor([n]),
                                              torch.tensor([-1]), n) is None)
            out["refused"] = refused
            out["unchanged"] = a.available_size() == before
            out["too_long"] = a.max_new_tokens_for_memory(
                STAGE + 1, 16, token_capacity=a.size_full, sliding_window_size=None,
                chunk_size=None) is None
        h.close()
    return out


SCENARIOS = {"decode": scenario_decode, "shared": scenario_shared, "pressure": scenario_pressure,
             "prefetch": scenario_prefetch, "stage": scenario_stage}


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ["SGLANG_DSA_TOPK_BROADCAST"] = "1"
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        sglang_tp_ranks_init(rank, P, port)
        # what a --dcp-size P launch publishes (SGLang refuses to build the DCP group itself
        # on CPU): the pool checks that its stripe is SGLang's DCP group, and SGLang's MLA
        # write would localize the rows again without the pool's dcp_replicated
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(dcp_enabled=True, dcp_size=P, attn_dcp_size=P,
                                            attn_dcp_rank=rank)
        results = {name: fn(rank) for name, fn in SCENARIOS.items()}
    except BaseException:  # noqa: BLE001 - reported to the parent
        results = {"error": traceback.format_exc()}
    with open(path, "w") as f:
        json.dump(results, f)
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_rank_main, P, tmp_path_factory.mktemp("ula_sgl_dcp"), TIMEOUT_S)


def test_every_row_is_own_and_holds_its_bytes(ranks):
    for rank, res in enumerate(ranks):
        r = res["decode"]
        assert r["kind"] == "StripeAddressSpace" and r["seen"] > 0, r
        c = r["counters"]
        assert c["promotions"] > 0 and c["spills"] > 0, (rank, c)
        assert c["access_overflow"] == c["place_overflow"] == c["invalid"] == 0, (rank, c)
        assert r["capacity_back"]
        assert r["dcp_replicated"] is True and r["write_span"] == 1


def test_shared_layers_and_a_pool_that_ignores_the_stripe(ranks):
    for res in ranks:
        assert res["shared"]["seen"] > 0
        assert res["shared"]["mutant_caught"] > 0


def test_prefetch_over_each_stripe_keeps_every_rows_bytes(ranks):
    for rank, res in enumerate(ranks):
        c = res["prefetch"]["counters"]
        assert c["prefetches"] > 0 and c["promotions"] > 0, (rank, c)
        assert c["access_overflow"] == 0 and res["prefetch"]["capacity_back"], (rank, c)


def test_alloc_extend_agrees_and_the_pool_has_no_buffer(ranks):
    got = [res["pressure"] for res in ranks]
    for r in got:
        assert r["too_long"] and r["logical_one_rank"] and r["capacity_unchanged"], r
        # sink page, N / P own slots, scratch row, padding to a page: no buffer rows
        assert r["G"] == N // P and r["kv_rows"] == -(-(PAGE + N // P + 1) // PAGE) * PAGE


def test_a_request_five_times_the_pool_prefills_through_each_ranks_stage(ranks):
    for rank, res in enumerate(ranks):
        r = res["stage"]
        for key in ("validate=True", "validate=False"):
            s = r[key]
            assert s["capacity"] == STAGE // P and s["staged"] == 11 - 4, (rank, key, s)
            assert s["from_cpu"] > 0 and s["promoted_in_decode"] > 0 and s["seen"] > 0, s
            assert s["overflow"] == 0 and s["capacity_back"], (rank, key, s)
        # a rank's own share decides: 700 + 700 fits 700 rows each, 701 + 699 does not
        assert r["fits"] == [True, True, True, False, False], (rank, r["fits"])
        assert r["refused"] == [True, True] and r["unchanged"] and r["too_long"], r


# ---------------------------------------------------------------------------------------------
# the FlashMLA DCP branch against a torch reference of FlashMLA's sparse decode
# ---------------------------------------------------------------------------------------------
def reference_flash_mla(q, k_cache, block_table, cache_seqlens, head_dim_v,
                        tile_scheduler_metadata, num_splits, softmax_scale, indices,
                        is_fp8_kvcache, kv_format, **_):
    """FlashMLA's sparse decode over fp8 V32 rows (656 B: 512 fp8 + 4 fp32 scales + 64 bf16
    rope), as its tests' reference computes it: ``(out [T, 1, H, d_v], lse [T, H, 1])``,
    natural-log LSE, ``-1`` indices masked, ``+inf`` LSE and zero output for a query with no
    valid index."""
    from ulacache.oracle.rowpack import unpack_rows

    assert is_fp8_kvcache and kv_format == "V32"
    rows = k_cache.reshape(-1, 656)
    idx = indices[:, 0].long()  # [T, K]
    valid = idx >= 0
    lat = unpack_rows(rows[idx.clamp(min=0)].view(torch.uint8), "fp8", 512, 64, 128)
    qf = q[:, 0].float()  # [T, H, 576]
    s = torch.einsum("thd,tkd->thk", qf, lat) * softmax_scale
    s = torch.where(valid[:, None, :], s, -math.inf)
    lse = torch.logsumexp(s, -1)  # [T, H]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("thk,tkd->thd", p, lat[..., :head_dim_v])
    lse = torch.where(valid.any(-1)[:, None], lse, math.inf)
    return out[:, None].to(torch.bfloat16), lse[..., None]


def test_flashmla_branch_partials_merge_to_full_attention(monkeypatch):
    """Two ranks, each the rows it owns (the others -1), 32 query heads of which 16 per rank
    locally (the DCP layer runs all 32, padded to FlashMLA's 64): the partial outputs and
    base-2 LSEs the branch returns, merged as SGLang's DSA merge does (``exp2`` weights),
    equal FlashMLA's attention over every row; a query with no own row weighs nothing."""
    import sys

    from ulacache.oracle.rowpack import pack_rows
    from ulacache.patches import sglang_dcp

    # SGLang's FlashMLA wrapper module imports the CUDA-only wheel: the branch calls it by
    # name, so the module is replaced by one whose kernel is the torch reference
    monkeypatch.setitem(sys.modules, "sglang.kernels.ops.attention.flash_mla_interface",
                        types.SimpleNamespace(flash_mla_with_kvcache=reference_flash_mla))
    gen = torch.Generator().manual_seed(3)
    T, H, topk, n_rows = 3, 32, 16, 128
    latent = torch.randn(n_rows, 576, generator=gen)
    latent[:, 512:] = latent[:, 512:].bfloat16().float()
    cache = pack_rows(latent, "fp8", 64, 128).view(n_rows // 64, 64, 1, 656)
    sel = torch.stack([torch.randperm(n_rows, generator=gen)[:topk] for _ in range(T)])
    sel[2] = torch.arange(0, 2 * topk, 2)  # query 2: every selection on rank 0
    q = torch.randn(T, H, 576, generator=gen).bfloat16()
    meta = types.SimpleNamespace(dsa_cache_seqlens_int32=None, flashmla_metadata=types.
                                 SimpleNamespace(flashmla_metadata=None, num_splits=None))
    layer = types.SimpleNamespace(tp_q_head_num=H, head_dim=576)
    parts = []
    for rank in range(P):
        pool = types.SimpleNamespace(ula_options=types.SimpleNamespace(mode="dcp"))
        backend = types.SimpleNamespace(
            dcp_size=P, dcp_rank=rank, num_dcp_q_heads=H, token_to_kv_pool=pool,
            flashmla_kv_num_q_heads=sglang_dcp.flashmla_heads(H), physical_page_size=64,
            kv_cache_dim=656, dsa_kv_cache_store_fp8=True, dsa_index_topk=topk,
            flashmla_kv_format="V32")
        own = torch.where(sel % P == rank, sel, -1).to(torch.int32)
        out, lse = sglang_dcp.flashmla_kv_around(
            lambda *a: pytest.fail("the stock path ran"), backend, q.view(T, 1, H, 576),
            cache.view(torch.float8_e4m3fn), 512, 0.1, layer, meta, own)
        assert out.shape == (T, 1, H, 512) and lse.shape == (T, H) and lse.dtype == torch.float32
        parts.append((out[:, 0].float(), lse))
    assert bool(torch.isinf(parts[1][1][2]).all())  # rank 1 serves nothing of query 2
    lses = torch.stack([lse for _, lse in parts])
    lses = torch.where(torch.isfinite(lses), lses, -math.inf)  # SGLang: +inf -> weight 0
    w = torch.exp2(lses - lses.amax(0))
    merged = (w[..., None] * torch.stack([o for o, _ in parts])).sum(0) / w.sum(0)[..., None]
    want, _ = reference_flash_mla(q.view(T, 1, H, 576), cache, None, None, 512, None, None,
                                  0.1, sel.to(torch.int32).unsqueeze(1), True, "V32")
    assert torch.allclose(merged, want[:, 0].float(), atol=2e-2, rtol=2e-2)
    # a non-DCP layer (the draft model's, dcp 1) is SGLang's own call
    stock = sglang_dcp.flashmla_kv_around(lambda *a: "stock", backend, q, cache, 512, 0.1,
                                          types.SimpleNamespace(tp_q_head_num=H // P,
                                                                head_dim=576), meta, sel)
    assert stock == "stock"


def test_backend_heads_follow_the_dcp_layer():
    from ulacache.patches import sglang_dcp

    assert [sglang_dcp.flashmla_heads(h) for h in (16, 64, 65, 128, 256)] == \
        [64, 64, 128, 128, 256]
    pool = types.SimpleNamespace(ula_options=types.SimpleNamespace(mode="dcp"))

    def init(self):
        self.dcp_size, self.dcp_rank, self.num_dcp_q_heads = 8, 3, 128
        self.token_to_kv_pool, self.flashmla_kv_num_q_heads = pool, 64
    b = types.SimpleNamespace()
    sglang_dcp.backend_init_around(init, b)
    assert b.flashmla_kv_num_q_heads == 128
    pool.ula_options.mode = "tp"  # any other mode: SGLang's sizes
    b = types.SimpleNamespace()
    sglang_dcp.backend_init_around(init, b)
    assert b.flashmla_kv_num_q_heads == 64


# ---------------------------------------------------------------------------------------------
# overrides, server arguments, sizing
# ---------------------------------------------------------------------------------------------
def _cfg(**kw):
    base = dict(kv_backend="ulacache", ulacache_config=json.dumps({"mode": "dcp"}), dcp_size=2,
                enable_hisparse=True, enable_hierarchical_cache=False,
                disaggregation_mode="null", speculative_eagle_topk=None,
                dsa_prefill_backend=None, dsa_decode_backend=None,
                dcp_replicate_q_proj=None, dcp_comm_backend="a2a")
    return types.SimpleNamespace(**{**base, **kw})


def test_dcp_override_lifts_only_the_hisparse_refusal():
    from sglang.srt.arg_groups.model_overrides import deepseek_v2 as ov

    from ulacache.errors import ConfigError
    from ulacache.patches.sglang_dcp import dsa_dcp_overrides_around

    original = ov._dsa_dcp_overrides
    with pytest.raises(ValueError, match="HiSparse"):  # stock SGLang refuses it
        original(_cfg())
    got = dsa_dcp_overrides_around(original, _cfg())
    assert got == {"dsa_prefill_backend": "flashmla_kv", "dsa_decode_backend": "flashmla_kv",
                   "dcp_replicate_q_proj": True}
    assert dsa_dcp_overrides_around(original, _cfg(dsa_decode_backend="flashmla_kv")) == \
        {"dsa_prefill_backend": "flashmla_kv", "dcp_replicate_q_proj": True}
    with pytest.raises(ConfigError, match="--dsa-decode-backend trtllm"):
        dsa_dcp_overrides_around(original, _cfg(dsa_decode_backend="trtllm"))
    with pytest.raises(ConfigError, match="HiCache"):
        dsa_dcp_overrides_around(original, _cfg(enable_hierarchical_cache=True))
    with pytest.raises(ValueError, match="HiSparse"):  # other backends: SGLang's verdict
        dsa_dcp_overrides_around(original, _cfg(kv_backend="hisparse"))
    assert dsa_dcp_overrides_around(original, _cfg(dcp_size=1)) == {}


@pytest.fixture
def clean_env(monkeypatch):
    from ulacache.patches import server_args as ula_args

    monkeypatch.delenv(ula_args.ENV_KV_BACKEND, raising=False)
    monkeypatch.setenv("SGLANG_DSA_TOPK_BROADCAST", "1")
    return monkeypatch


def _args(**kw):
    from ulacache.patches.server_args import UlaServerArgs

    return UlaServerArgs(model_path="dummy", device="cpu", kv_backend="ulacache",
                         ulacache_config={"mode": "dcp"}, **kw)


def test_server_args_accept_dcp_mode_with_its_group(clean_env):
    for tp, adp in ((2, 1), (8, 1), (8, 2)):
        args = _args(tp_size=tp, attn_dp_size=adp, dcp_size=tp // adp)
        assert args.dcp_size == tp // adp


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"tp_size": 4, "dcp_size": 2}, "--dcp-size 2 with an attention-TP size of 4"),
    ({"tp_size": 4, "dcp_size": 1}, "--dcp-size 1"),
    ({"tp_size": 1, "dcp_size": 1}, "--tp 1"),
    ({"tp_size": 2, "dcp_size": 2, "kv_cache_dtype": "bfloat16"}, "--kv-cache-dtype bfloat16"),
])
def test_server_args_refuse_dcp_mode_without_its_group(clean_env, kw, fragment):
    from ulacache.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _args(**kw)
    msg = str(info.value)
    assert fragment in msg and "mode 'dcp'" in msg and "Legal:" in msg, msg


def test_dcp_size_is_refused_outside_dcp_mode(clean_env):
    from ulacache.errors import ConfigError
    from ulacache.patches.server_args import UlaServerArgs

    for mode in ("dp", "tp"):
        with pytest.raises(ConfigError, match="--dcp-size 2"):
            UlaServerArgs(model_path="dummy", device="cpu", kv_backend="ulacache",
                          ulacache_config={"mode": mode}, tp_size=2, dcp_size=2)


def test_sizing_hook_charges_the_stripe_without_a_buffer(monkeypatch):
    """DeepSeek-V3.2 fp8 at P = 4 in mode "dcp": stock SGLang counts a DCP pool's tokens per
    rank and so charges index-K x 4 per token; the hook takes that back (ulacache's ``N``
    counts the group's tokens, as in mode "tp"), charges ceil(latent / 4), the rows beside
    the own ones without a buffer, and the stripe's DP tables; the logical capacity is not
    widened twice."""
    import sglang.srt.mem_cache.kv_cache_configurator as kvcm
    import sglang.srt.runtime_context as rc

    from ulacache.config import SGLangOptions
    from ulacache.patches import launch
    from ulacache.patches import sglang_sizing as sz
    from ulacache.sizing import coordinator_output_bytes, table_bytes_per_slot

    monkeypatch.setattr(kvcm, "calculate_mla_kv_cache_dim", lambda **kw: 656)
    monkeypatch.setattr(rc, "get_schedule", lambda: types.SimpleNamespace(max_running_requests=8))
    monkeypatch.setattr(launch, "tp_group", lambda: types.SimpleNamespace(world_size=4))
    monkeypatch.setattr(launch, "draft_tokens", lambda: 0)
    monkeypatch.setattr(sz, "dcp_size", lambda: 4)
    opts = SGLangOptions(mode="dcp")
    monkeypatch.setattr(launch, "sglang_options", lambda: opts)
    monkeypatch.setattr(sz, "sglang_options", lambda: opts)
    hf = types.SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
    kvc = types.SimpleNamespace(
        is_draft_worker=False, use_mla_backend=True, kv_cache_dtype=torch.float8_e4m3fn,
        pool_page_size=64,
        layer_info=types.SimpleNamespace(start_layer=0, end_layer=61, num_effective_layers=61),
        model_config=types.SimpleNamespace(hf_config=hf, hf_text_config=hf))
    latent, index_k = 656 * 61, 132 * 61 * 5

    def stock(self, kvc):  # SGLang under DCP: index-K x dcp_size per (per-rank) token
        self._cell_size, self._fixed_overhead_bytes = latent + 4 * index_k, 0
        self._compute_dsa_indexer_cell_size = lambda kvc, num_layers: 132 * num_layers * 5

    cfg = types.SimpleNamespace()
    sz.pool_configurator_init_around(stock, cfg, kvc)
    per, fixed = table_bytes_per_slot(61, ratio=5, page_size=64, tp_size=4, dcp=True)
    out = coordinator_output_bytes(61, 8 + 1, 2048, 0)
    assert cfg._cell_size == 10004 + index_k + per
    assert cfg._fixed_overhead_bytes == 128 * 61 * 656 + fixed + out  # sink, scratch, padding
    lp = launch.plan_launch(kvc)
    assert (lp.tp_size, lp.buffer_slots, lp.stage_tokens) == (4, 0, 0)
    kvconf = types.SimpleNamespace(is_draft_worker=False, use_mla_backend=True)
    assert sz.logical_token_capacity_around(lambda self, **kw: 1000 * 4, kvconf,
                                            max_total_num_tokens=1000) == 1000 * 5
