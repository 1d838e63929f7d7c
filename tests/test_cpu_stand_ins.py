"""The CPU stand-ins the real-server harness loads (tests/sglang_server/site/cpu_stand_ins.py)
against the semantics of what they replace: SGLang's own Triton kernels run through Triton's
interpreter where they exist (index-K cache writes and reads, the top-k -> slot transforms,
act_quant's scales), independent references elsewhere (Hadamard, sparse MLA, fp8 rounding),
and SGLang's own RoPE where its shapes are right.

Marked ``sglang``: needs SGLang 0.5.23 (stage 2). The stand-ins are imported directly; they
patch nothing here (only sitecustomize.py installs them, in the harness's servers).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")
pytest.importorskip("triton")
pytestmark = pytest.mark.sglang

SITE = Path(__file__).resolve().parent / "sglang_server" / "site"
sys.path.insert(0, str(SITE))
import cpu_stand_ins as S  # noqa: E402

sys.path.remove(str(SITE))


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# -- pure references ---------------------------------------------------------------------------
def fwht(v: torch.Tensor) -> torch.Tensor:
    """Fast Walsh-Hadamard transform, natural (Sylvester) order."""
    v = v.clone()
    h, n = 1, v.shape[-1]
    while h < n:
        v = v.reshape(*v.shape[:-1], n // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(*v.shape[:-3], n)
        h *= 2
    return v


def test_hadamard_transform_is_the_walsh_hadamard_transform():
    x = torch.randn(5, 3, 128)
    s = 128 ** -0.5
    assert torch.allclose(S.hadamard_transform_torch(x, s).double(), fwht(x.double()) * s,
                          atol=1e-5)
    xb = x.to(torch.bfloat16)
    out = S.hadamard_transform_torch(xb, s)
    assert out.dtype == torch.bfloat16  # fp32 math, the input's dtype out (as the kernel)
    assert torch.equal(out, (fwht(xb.double()) * s).float().to(torch.bfloat16))
    assert torch.allclose(S.hadamard_transform_torch(S.hadamard_transform_torch(x, s), s), x,
                          atol=1e-5)  # H H / n = I


def sparse_reference(q, kv, idx, sm_scale, d_v, topk_length=None, sink=None):
    """Per row and head: softmax over the valid selected rows, weighted sum of their V."""
    s_q, h_q, _ = q.shape
    out = torch.zeros(s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((s_q, h_q), float("inf"), dtype=torch.float64)
    for i in range(s_q):
        sel = [int(j) for t, j in enumerate(idx[i, 0]) if 0 <= j < kv.shape[0]
               and (topk_length is None or t < int(topk_length[i]))]
        if not sel:
            continue
        K = kv[sel, 0].double()
        for h in range(h_q):
            lg = (K @ q[i, h].double()) * sm_scale
            m = torch.logsumexp(lg, 0)
            z = m if sink is None else torch.logaddexp(m, torch.tensor(float(sink[h]),
                                                                        dtype=torch.float64))
            out[i, h] = (torch.exp(lg - z)[:, None] * K[:, :d_v]).sum(0)
            lse[i, h] = m
    return out, lse


@pytest.mark.parametrize("variant", ["plain", "topk_length", "attn_sink"])
def test_sparse_mla_matches_a_per_row_reference(variant):
    s_q, h_q, d, d_v, s_kv, topk = 7, 64, 192, 128, 300, 64
    q = torch.randn(s_q, h_q, d).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, d).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32)
    idx[1, 0, 10:] = -1  # padding
    idx[2, 0, 5] = s_kv + 3  # out of range: invalid
    idx[3, 0, :] = -1  # no valid index: out = 0, lse = +inf
    kw = {"topk_length": torch.tensor([topk, topk, topk, topk, 17, 1, 40], dtype=torch.int32),
          "attn_sink": torch.randn(h_q)}.get(variant)
    kw = {} if kw is None else {variant: kw}
    out, _, lse2 = S.flash_mla_sparse_fwd_torch(q, kv, idx, 0.1, d_v, return_log2_lse=True, **kw)
    ref_out, ref_lse = sparse_reference(q, kv, idx, 0.1, d_v, kw.get("topk_length"),
                                        kw.get("attn_sink"))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    finite = ~torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse2), ~finite)
    assert torch.allclose(lse2.double()[finite], (ref_lse * math.log2(math.e))[finite],
                          atol=1e-3)
    assert bool((out[3] == 0).all())


def rne_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest finite float8_e4m3fn value, ties to even (the GPU's cvt.rn)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    fin = ~torch.isnan(vals)
    codes, vals = codes[fin], vals[fin]
    d = (v.reshape(-1, 1) - vals.reshape(1, -1)).abs()
    cand = d == d.min(dim=1, keepdim=True).values
    even = (codes.to(torch.int32) & 1) == 0
    pick = torch.where((cand & even).any(1, keepdim=True), cand & even, cand)
    return vals[pick.to(torch.int32).argmax(dim=1)].reshape(v.shape)


# -- against SGLang's own Triton kernels (interpreted) -----------------------------------------
@pytest.mark.parametrize("fmt", [None, "ue8m0"])
def test_act_quant_scales_are_the_triton_kernel_s_and_values_round_to_nearest_even(fmt):
    """Scales equal SGLang's Triton kernel; the fp8 bytes are checked against an exact
    round-to-nearest-even instead (the interpreter's own fp32 -> fp8 cast is not RNE)."""
    from sglang.kernels.ops.quantization import act_quant_triton as aq

    x = (torch.randn(37, 4, 128) * 3).to(torch.bfloat16).contiguous()
    _, s_triton = aq.act_quant(x, 128, fmt)
    y, s = S.act_quant_torch(x, 128, fmt)
    assert torch.equal(s_triton, s)
    assert torch.equal(y.float(), rne_e4m3((x.float() / s).clamp(-448, 448)))


def test_index_k_cache_writes_and_reads_equal_sglang_s_triton_kernels():
    from sglang.kernels.ops.kvcache import dsa_index_k_cache as ikc

    page, pages = 64, 9
    buf_t = torch.randint(0, 256, (pages, page * 132), dtype=torch.uint8)
    buf_s = buf_t.clone()
    loc = torch.randperm(pages * page)[:150].to(torch.int64)
    k = torch.randn(150, 128).to(torch.float8_e4m3fn)
    sc = torch.rand(150, 1, dtype=torch.float32)
    ikc._set_k_and_s_triton(buf_t, loc, k, sc, page)
    S.set_k_and_s_torch(buf_s, loc, k, sc, page)
    assert torch.equal(buf_t, buf_s)
    seq_lens = torch.tensor([130, 7, 64, 200], dtype=torch.int64)
    table = torch.stack([torch.randperm(pages)[:4] for _ in range(4)]).to(torch.int32)
    total, longest = int(seq_lens.sum()), int(seq_lens.max())
    k_t, s_t = ikc._get_k_and_s_triton(buf_t, table, seq_lens, total, longest, page, 128)
    k_s, s_s = S.get_k_and_s_torch(buf_t, table, seq_lens, total, longest, page, 128)
    assert torch.equal(k_t, k_s) and torch.equal(s_t, s_s)


@pytest.mark.parametrize("topk", [64, 2048])
def test_decode_top_k_to_slot_transform_equals_sglang_s_triton_kernel(topk):
    from sglang.kernels.ops.attention.dsa import transform_index as ti

    pt = torch.randint(0, 5000, (3, 2100), dtype=torch.int32)
    tk = torch.randint(-1, 2100, (3, topk), dtype=torch.int32)
    assert torch.equal(ti.transform_index_page_table_decode(pt, tk),
                       S.transform_index_page_table_decode_torch(pt, tk))


@pytest.mark.parametrize("expanded", [False, True])
def test_prefill_top_k_to_slot_transform_equals_sglang_s_triton_kernel(expanded):
    from sglang.kernels.ops.attention.dsa import transform_index as ti

    ext = [5, 1, 9]
    pt = torch.randint(0, 5000, (sum(ext) if expanded else 3, 300), dtype=torch.int32)
    tk = torch.randint(-1, 300, (sum(ext) + 2, 64), dtype=torch.int32)
    kw = dict(output_num_tokens=sum(ext) + 4, page_table_is_expanded=expanded)
    assert torch.equal(ti.transform_index_page_table_prefill(pt, tk, ext, **kw),
                       S.transform_index_page_table_prefill_torch(pt, tk, ext, **kw))


# -- against SGLang's own RoPE where its shapes are right --------------------------------------
_ROPE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import cpu_stand_ins as S
from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding
torch.manual_seed(0)
out = {}
for neox in (True, False):
    rope = DeepseekScalingRotaryEmbedding(64, 64, 4096, 10000, neox, 1.0, torch.bfloat16,
                                          beta_fast=32, beta_slow=1, mscale=1.0,
                                          mscale_all_dim=1.0, device="cpu")
    T = 9
    pos = torch.arange(T) * 37
    q = torch.randn(T, 4, 64).to(torch.bfloat16)
    k3 = torch.randn(T, 1, 64).to(torch.bfloat16)
    mq, mk3 = S.deepseek_scaling_rope_forward_native(rope, pos, q, k3)
    _, mk2 = S.deepseek_scaling_rope_forward_native(rope, pos, q, k3[:, 0].clone())
    oq, ok3 = DeepseekScalingRotaryEmbedding.forward_native(rope, pos, q, k3)
    if neox:  # SGLang's result carries a leading broadcast dimension there
        oq, ok3 = oq[0], ok3[0]
    _, bad = DeepseekScalingRotaryEmbedding.forward_native(rope, pos, q, k3[:, 0].clone())
    out[str(neox)] = {"q": torch.equal(mq, oq), "k": torch.equal(mk3, ok3),
                      "k2d": torch.equal(mk2, mk3[:, 0]) and tuple(mk2.shape) == (T, 64),
                      "sglang_2d_key_shape": list(bad.shape)}
print(json.dumps(out))
"""


def test_yarn_rope_equals_sglang_s_on_3d_inputs_and_fixes_2d_keys():
    """SGLang's forward_native broadcasts a 2-D key [T, D] against [T, 1, D] (and, neox style,
    ``cos.repeat(1, 1, 2)`` adds a leading dimension): the stand-in gives SGLang's values on
    3-D inputs and treats a 2-D key as one head. In a process with SGLang's CPU engine on, as
    the servers run (the rope class picks its kernels by platform)."""
    import json
    import os
    import subprocess

    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    p = subprocess.run([sys.executable, "-c", _ROPE, str(SITE)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for neox, r in res.items():
        assert r["q"] and r["k"] and r["k2d"], (neox, r)
        assert r["sglang_2d_key_shape"] != [9, 64], (neox, r)  # the SGLang bug worked around


def test_stable_top_k_breaks_ties_by_position_whatever_the_width():
    x = torch.tensor([[1.0, 0.0, 0.0, 2.0, 0.0, -float("inf"), -float("inf")]])
    _, idx = S.stable_topk(x, 3)
    assert idx.tolist() == [[3, 0, 1]]
    _, idx = S.stable_topk(x[:, :5], 3)
    assert idx.tolist() == [[3, 0, 1]]
