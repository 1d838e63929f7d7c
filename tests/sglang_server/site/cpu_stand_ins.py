"""Test-only CPU stand-ins for the GPU-only code points a DSA model
(DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM) reaches in SGLang 0.5.23 when it
is served on a CPU-only machine (the real HTTP server, scheduler and pools: SGLang's stock
DSATokenToKVPool, or ulacache's pool through the plugin). Loaded only by the test harness
(tests/sglang_server/site/sitecustomize.py), never by the package. Unit-tested against
independent references and SGLang's own Triton kernels in tests/test_cpu_stand_ins.py.

Each stand-in is a small pure-torch function with the math of the GPU code it
replaces; the comment above each names the SGLang file:line (0.5.23, paths under
site-packages/sglang/) it replaces. Where SGLang already has a torch route it is
used through its switch instead (tests/sglang_server/harness.py sets them):
SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 (fp8 MQA logits, prefill and decode), --dsa-topk-backend
torch with
SGLANG_DSA_FUSE_TOPK=0 (top-k), SGLANG_OPT_USE_TOPK_V2=0.

Patching is done by a post-import hook (install()), so the stand-ins are in place
before any `from X import f` elsewhere binds the original.
"""
from __future__ import annotations

import importlib.abc
import itertools
import math
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

_LOG = os.environ.get("ULA_CPU_STAND_INS_LOG", "0") == "1"
_PATCHES: Dict[str, List[Callable]] = {}
_CALLS: Dict[str, int] = {}


def _log(msg: str) -> None:
    if _LOG:
        print(f"[cpu_stand_ins pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _count(name: str) -> None:
    n = _CALLS.get(name, 0)
    _CALLS[name] = n + 1
    if n == 0:
        _log(f"first call: {name}")


def _on_import(modname: str):
    def deco(fn):
        _PATCHES.setdefault(modname, []).append(fn)
        return fn

    return deco


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module in _PATCHES so its patch functions run
    right after the module body executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        orig_exec = loader.exec_module

        def exec_module(module, _orig=orig_exec, _name=fullname):
            _orig(module)
            for fn in _PATCHES[_name]:
                fn(module)
                _log(f"patched {_name}: {fn.__name__}")

        loader.exec_module = exec_module
        return spec


def install() -> None:
    if any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PostImportFinder())
    # Modules already imported (unlikely at sitecustomize time) are patched now.
    for name, fns in _PATCHES.items():
        mod = sys.modules.get(name)
        if mod is not None:
            for fn in fns:
                fn(mod)


# ---------------------------------------------------------------------------
# 1. torch.cuda.get_device_capability() without a GPU.
# Replaces the unguarded calls in srt/arg_groups/model_hook.py:341,
# srt/arg_groups/overrides.py:512 (_dsa_kv_cache_dtype_default), :631
# (_dsa_split_backend_resolution) and srt/layers/attention/dsa_backend.py:675
# (DeepseekSparseAttnBackend.__init__), which raise "no NVIDIA driver" on CPU.
# Returns (9, 0) -- the H200 this harness's GPU runs use -- so the DSA defaults and
# the FlashMLA head padding (64 heads, dsa_backend.py:2824) match an SM90 run. Only
# for callers in those modules and only when CUDA is unavailable; everyone else
# gets the original function.
# ---------------------------------------------------------------------------
STANDIN_DEVICE_CAPABILITY = (9, 0)
_CAPABILITY_CALLERS = (
    "sglang.srt.arg_groups.model_hook",
    "sglang.srt.arg_groups.overrides",
    "sglang.srt.layers.attention.dsa_backend",
)


@_on_import("torch")
def _patch_torch_capability(torch_mod):
    cuda = torch_mod.cuda
    orig = cuda.get_device_capability

    def get_device_capability(device=None):
        if not cuda.is_available():
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in _CAPABILITY_CALLERS:
                _count("get_device_capability")
                return STANDIN_DEVICE_CAPABILITY
        return orig(device) if device is not None else orig()

    get_device_capability.__wrapped__ = orig
    cuda.get_device_capability = get_device_capability


# ---------------------------------------------------------------------------
# 2. Hadamard transform (index Q/K rotation, dsa_indexer.py:252 rotate_activation).
# Replaces kernels/ops/quantization/hadamard.py:68 hadamard_transform (JIT CUDA
# fast-hadamard-transform; _hadamard_transform_impl raises for non-CUDA tensors).
# Math: out = (x @ H_n) * scale with H_n the Sylvester Hadamard matrix
# (scipy.linalg.hadamard order; symmetric), n = last dim (power of 2 here), computed
# in fp32 and returned in x.dtype, as the kernel does.
# ---------------------------------------------------------------------------
_HADAMARD_CACHE: Dict[Tuple[int, str], object] = {}  # (n, device) -> fp32 [n, n]


def sylvester_hadamard(n: int, device=None):
    import torch

    assert n > 0 and (n & (n - 1)) == 0, f"hadamard size must be a power of 2, got {n}"
    key = (n, str(device))
    h = _HADAMARD_CACHE.get(key)
    if h is None:
        h = torch.ones(1, 1, dtype=torch.float32)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = h.to(device)
        _HADAMARD_CACHE[key] = h
    return h


def hadamard_transform_torch(x, scale: float = 1.0):
    _count("hadamard_transform")
    shape = x.shape
    n = shape[-1]
    h = sylvester_hadamard(n, x.device)
    out = (x.reshape(-1, n).float() @ h) * scale
    return out.to(x.dtype).reshape(shape)


@_on_import("sglang.kernels.ops.quantization.hadamard")
def _patch_hadamard(mod):
    mod.hadamard_transform = hadamard_transform_torch


# ---------------------------------------------------------------------------
# 3. act_quant: per-128-group fp8 (e4m3fn) quantization of index Q and K.
# Replaces kernels/ops/quantization/act_quant_triton.py:88 act_quant (Triton
# _act_quant_kernel :10). Math per row and group of `block_size` columns:
#   amax = max(|x|) clamped to >= 1e-4
#   scale = 2**ceil(log2(amax / 448)) if scale_fmt is not None (ue8m0) else amax / 448
#   y = clamp(x / scale, -448, 448) -> float8_e4m3fn (round to nearest even)
# Returns (y with x's shape, s of shape x.shape[:-1] + (N // block_size,), fp32).
# ---------------------------------------------------------------------------
def act_quant_torch(x, block_size: int = 128, scale_fmt: Optional[str] = None):
    import torch

    _count("act_quant")
    assert x.is_contiguous(), "Input tensor must be contiguous"
    n = x.size(-1)
    assert n % block_size == 0
    groups = n // block_size
    xf = x.reshape(-1, groups, block_size).to(torch.float32)
    amax = xf.abs().amax(dim=-1).clamp_min(1e-4)
    fp8_max_inv = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    if scale_fmt is not None:
        scale = torch.exp2(torch.ceil(torch.log2(amax * fp8_max_inv)))
    else:
        scale = amax * fp8_max_inv
    y = (xf / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return y.reshape(x.shape), scale.reshape(*x.shape[:-1], groups)


@_on_import("sglang.kernels.ops.quantization.act_quant_triton")
def _patch_act_quant(mod):
    mod.act_quant = act_quant_torch


# ---------------------------------------------------------------------------
# 4. Index-K cache write/read (the DSA pool's index_k_with_scale_buffer).
# Layout of one layer's buffer (srt/mem_cache/index_key_cache.py:40 _buffer_shape,
# kernel view :49 _kernel_view): uint8 [num_pages, page_size * 132]; per 64-token page the
# 64 x 128 fp8 key bytes (token-major) come first, then 64 x 4 bytes = one fp32
# scale per token. Token slot `loc` lives in page loc // 64 at offset loc % 64.
#
# 4a. Replaces kernels/ops/kvcache/dsa_index_k_cache.py:136 _set_k_and_s_triton
#     (Triton _set_k_and_s_triton_kernel :216), reached from
#     DSATokenToKVPool.set_index_k_scale_buffer (memory_pool.py:5574)
#     -> IndexKeyCache.store_quantized (index_key_cache.py:125) -> SetKAndS.execute.
# 4b. Replaces dsa_index_k_cache.py:274 _get_k_and_s_triton (Triton kernel :340),
#     reached from DSATokenToKVPool.get_index_k_scale_buffer (memory_pool.py:5562)
#     -> IndexKeyCache.get_k_and_scale (index_key_cache.py:107) -> GetKAndS.execute.
#     Gathers, for each request b, tokens 0..seq_lens[b]-1 through its page-table
#     row page_indices[b] (64-token pages), concatenated over requests:
#     k_out uint8 [sum(seq_lens), 128], s_out uint8 [sum(seq_lens), 4].
# (The aiter preshuffle layout, ROCm only, is not stood in for.)
# ---------------------------------------------------------------------------
def set_k_and_s_torch(buf, loc, index_k, index_k_scale, page_size: int):
    import torch

    _count("set_k_and_s")
    num_pages, per_page = buf.shape
    (t,) = loc.shape
    t2, head_dim = index_k.shape
    scale = index_k_scale.reshape(t2, -1)
    assert scale.shape[1] == 1, \
        f"one fp32 scale per token expected, got {tuple(index_k_scale.shape)}"
    assert per_page == page_size * (128 + 4) and head_dim == 128 and t == t2
    assert page_size == 64
    assert buf.dtype == torch.uint8 and buf.is_contiguous()
    assert index_k.dtype == torch.float8_e4m3fn and index_k_scale.dtype == torch.float32
    if t == 0:
        return
    loc = loc.to(torch.int64)
    page = loc // page_size
    off = loc % page_size
    flat = buf.view(-1)
    k_base = page * per_page + off * head_dim
    s_base = page * per_page + page_size * head_dim + off * 4
    flat[k_base[:, None] + torch.arange(head_dim, device=buf.device)] = index_k.view(torch.uint8)
    flat[s_base[:, None] + torch.arange(4, device=buf.device)] = (
        scale.contiguous().view(torch.uint8).reshape(t, 4)
    )


def get_k_and_s_torch(buf, page_indices, seq_lens, seq_len_sum: int, max_seq_len: int,
                      page_size: int, index_head_dim: int):
    import torch

    _count("get_k_and_s")
    k_out = torch.empty((seq_len_sum, index_head_dim), dtype=torch.uint8, device=buf.device)
    s_out = torch.empty((seq_len_sum, 4), dtype=torch.uint8, device=buf.device)
    _, per_page = buf.shape
    flat = buf.view(-1)
    ar_k = torch.arange(index_head_dim, device=buf.device)
    ar_s = torch.arange(4, device=buf.device)
    offset = 0
    for b, length in enumerate(seq_lens.tolist()):
        length = int(length)
        if length <= 0:
            continue
        tok = torch.arange(length, device=buf.device)
        page = page_indices[b, tok // page_size].to(torch.int64)
        in_page = tok % page_size
        base = page * per_page
        k_out[offset:offset + length] = flat[(base + in_page * index_head_dim)[:, None] + ar_k]
        s_out[offset:offset + length] = flat[
            (base + page_size * index_head_dim + in_page * 4)[:, None] + ar_s
        ]
        offset += length
    return k_out, s_out


@_on_import("sglang.kernels.ops.kvcache.dsa_index_k_cache")
def _patch_index_k_cache(mod):
    assert not mod._use_aiter_preshuffle
    mod._set_k_and_s_triton = set_k_and_s_torch
    mod._get_k_and_s_triton = get_k_and_s_torch


# ---------------------------------------------------------------------------
# 5. Top-k -> KV-slot translation (page_size=1 page table).
# 5a. Replaces kernels/ops/attention/dsa/transform_index.py:265
#     transform_index_page_table_decode (Triton kernels :139, :161):
#     result[i, j] = page_table[i, topk[i, j]] if topk[i, j] >= 0 else -1.
# 5b. Replaces transform_index.py:317 transform_index_page_table_prefill (Triton
#     :208): for request r and its query rows cu[r]..cu[r+1]-1,
#     result[t, j] = page_table[r or t, topk[t, j]] if topk[t, j] >= 0 else -1
#     (row t when page_table_is_expanded); rows past sum(extend_lens) are -1.
# page_table here is metadata.page_table_1 = req_to_token[req_pool_indices, :max_kv]
# (dsa_backend.py:1117), i.e. logical position -> KV-pool slot (token index).
# ---------------------------------------------------------------------------
def _gather_slots(page_table_rows, topk):
    import torch

    mask = topk >= 0
    slots = torch.gather(page_table_rows, 1, topk.clamp_min(0).to(torch.int64))
    return torch.where(mask, slots.to(torch.int32), torch.full_like(slots, -1, dtype=torch.int32))


def transform_index_page_table_decode_torch(page_table, topk_indices, result=None,
                                            page_size: int = 1):
    import torch

    _count("transform_index_page_table_decode")
    assert page_size == 1
    assert page_table.shape[0] == topk_indices.shape[0]
    if result is None:
        result = torch.empty_like(topk_indices, dtype=torch.int32)
    result.copy_(_gather_slots(page_table, topk_indices))
    return result


def transform_index_page_table_prefill_torch(page_table, topk_indices, extend_lens_cpu,
                                             page_size: int = 1, output_num_tokens=None,
                                             page_table_is_expanded: bool = False,
                                             cu_seqlens_q=None):
    from sglang.kernels.ops.attention.dsa import transform_index as ti

    _count("transform_index_page_table_prefill")
    assert page_size == 1
    assert topk_indices.ndim == 2 and topk_indices.shape[1] > 0
    real_num_tokens = sum(extend_lens_cpu)
    result = ti._allocate_prefill_result(topk_indices, real_num_tokens, output_num_tokens)
    if real_num_tokens == 0:
        return result
    if cu_seqlens_q is None:
        cu = [0, *itertools.accumulate(extend_lens_cpu)]
    else:
        cu = [int(v) for v in cu_seqlens_q.tolist()]
    for r in range(len(cu) - 1):
        s, e = cu[r], cu[r + 1]
        if e <= s:
            continue
        rows = page_table[s:e] if page_table_is_expanded else \
            page_table[r: r + 1].expand(e - s, -1)
        result[s:e] = _gather_slots(rows, topk_indices[s:e])
    return result


@_on_import("sglang.kernels.ops.attention.dsa.transform_index")
def _patch_transform_index(mod):
    mod.transform_index_page_table_decode = transform_index_page_table_decode_torch
    mod.transform_index_page_table_prefill = transform_index_page_table_prefill_torch


# ---------------------------------------------------------------------------
# 6. Sparse MLA attention over the latent pool rows: flash_mla_sparse_fwd.
# The sgl-flash-mla wheel is CUDA-only and absent here; site/flash_mla/ is a
# stand-in package whose flash_mla_sparse_fwd is flash_mla_sparse_fwd_torch below.
# It replaces the kernel called by kernels/ops/attention/flash_mla_interface.py:144,
# which DeepseekSparseAttnBackend._forward_flashmla_sparse (dsa_backend.py:2805)
# calls for forward_extend (:2464) and forward_decode (:2642) with
#   q   [s_q, h_q(padded to 64), d_qk = kv_lora_rank + rope]  (absorbed q),
#   kv  = pool.get_key_buffer(layer) [pool rows, 1, d_qk] (bf16 latent+rope rows),
#   indices [s_q, 1, topk] KV-pool slots (-1 = none), d_v = kv_lora_rank.
# Math (FlashMLA sparse prefill reference): per query row and head,
#   invalid = idx < 0 | idx >= s_kv | j >= topk_length[row]
#   p = softmax_j(sm_scale * q . kv[idx_j])   over valid j (attn_sink joins the
#   normaliser if given), out = sum_j p_j * kv[idx_j][:d_v]; rows with no valid
#   index give out = 0. fp32 math, out in q.dtype. Returns (out, max_logits, lse);
#   lse/max_logits are base 2 when return_log2_lse (the legacy kernel), lse=+inf
#   for empty rows.
# ---------------------------------------------------------------------------
def flash_mla_sparse_fwd_torch(q, kv, indices, sm_scale, d_v=512, attn_sink=None,
                               topk_length=None, *, use_legacy=True, return_log2_lse=None):
    import torch

    _count("flash_mla_sparse_fwd")
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, d_kv = kv.shape
    assert h_kv == 1 and d_kv == d_qk and indices.shape[:2] == (s_q, h_kv)
    idx = indices[:, 0, :].to(torch.int64)
    topk = idx.shape[-1]
    invalid = (idx < 0) | (idx >= s_kv)
    if topk_length is not None:
        invalid |= torch.arange(topk, device=q.device)[None, :] >= \
            topk_length.to(torch.int64)[:, None]
    safe = idx.masked_fill(invalid, 0)
    kv_sel = kv[:, 0, :].index_select(0, safe.reshape(-1)).reshape(s_q, topk, d_qk).float()
    logits = torch.einsum("qhd,qkd->qhk", q.float(), kv_sel) * sm_scale
    logits = logits.masked_fill(invalid[:, None, :], float("-inf"))
    max_logits = logits.amax(dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    lse_o = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.float()[None, :h_q])
    lse_o = lse_o.masked_fill(lse_o == float("-inf"), float("inf"))
    p = torch.exp(logits - lse_o.unsqueeze(-1))
    out = torch.einsum("qhk,qkd->qhd", p, kv_sel[..., :d_v]).to(q.dtype)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    if return_log2_lse:
        lse = lse * math.log2(math.e)
        max_logits = max_logits * math.log2(math.e)
    return out, max_logits, lse


# ---------------------------------------------------------------------------
# 7. DeepseekScalingRotaryEmbedding.forward_native (YaRN RoPE used by the MLA
# and the indexer on CPU). Replaces srt/layers/rotary_embedding/rope_variant.py:471.
# Two shape bugs worked around there, same math otherwise:
#  (a) neox style: `cos.repeat(1, 1, 2)` on the 2-D [T, rd/2] cache slice makes
#      [1, T, rd], which after unsqueeze(-2) broadcasts q/k to [1, T, T|H, rd];
#      it must be cos.repeat(1, 2) -> [T, rd] (then [T, 1, rd]).
#  (b) 2-D inputs (the indexer's key is [T, rope_dim], dsa_indexer.py:943) against
#      the [T, 1, rd] cos broadcast to [T, T, rd] in both styles; a 2-D input is
#      treated as one head ([T, 1, D]) and squeezed back.
# ---------------------------------------------------------------------------
def deepseek_scaling_rope_forward_native(self, positions, query, key, offsets=None):
    import torch
    from sglang.srt.layers.rotary_embedding import rope_variant as rv

    _count("DeepseekScalingRotaryEmbedding.forward_native")
    dtype = query.dtype
    pos = torch.add(positions, offsets) if offsets is not None else positions
    cos_sin = self.cos_sin_cache[pos]
    cos, sin = cos_sin.chunk(2, dim=-1)
    if self.is_neox_style:
        cos = cos.repeat(1, 2).unsqueeze(-2)
        sin = sin.repeat(1, 2).unsqueeze(-2)
    else:
        cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
        sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)
    rotate_fn = rv.rotate_neox if self.is_neox_style else rv.rotate_gptj
    rd = self.rotary_dim

    def apply(x):
        two_d = x.dim() == 2
        if two_d:
            x = x.unsqueeze(1)
        x_rot = x[..., :rd]
        x_rot = x_rot * cos + rotate_fn(x_rot) * sin
        if rd < self.head_size:
            x_rot = torch.cat((x_rot, x[..., rd:]), dim=-1)
        if two_d:
            x_rot = x_rot.squeeze(1)
        return x_rot.to(dtype)

    return apply(query), apply(key)


@_on_import("sglang.srt.layers.rotary_embedding.rope_variant")
def _patch_rope(mod):
    mod.DeepseekScalingRotaryEmbedding.forward_native = deepseek_scaling_rope_forward_native


# ---------------------------------------------------------------------------
# 8. The DSA indexer on CPU: Indexer.forward_native.
# Replaces srt/layers/attention/dsa/dsa_indexer.py:1888 Indexer.forward_native
# (raises "no native path"; forward_cuda :1910 ends in
# `raise NotImplementedError("DSA indexer only supports CUDA, HIP, and NPU")`
# :2245 on CPU). This is forward_cuda's plain eager branch (no fusion, no dual
# stream, no graph split op), reusing SGLang's own pieces:
#   - short context (max kv len <= index_topk, _should_skip_logits_computation
#     :846): _forward_cuda_k_only :1711 (store K, top-k of dummy logits = all);
#   - else _get_q_k_bf16 :881 (wq_b / wk / k_norm / RoPE / Hadamard),
#     act_quant(query), _store_index_k_cache :1806 (act_quant(key) +
#     pool.set_index_k_scale_buffer), _get_logits_head_gate :585;
#   - decode: _get_topk_paged :1219 (reads the index-K buffer directly:
#     pool.get_index_k_with_scale_buffer via _get_index_k_read_buffer :1165, page
#     table metadata.get_page_table_64() = real_page_table, fp8 paged MQA logits via
#     SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1);
#   - extend: _get_topk_ragged_cpu below = _get_topk_ragged :1479's unchunked
#     branch (its `assert device_index is not None` :1534 and the CUDA memory
#     budget query cannot run on CPU): pool.get_index_k_scale_buffer(layer,
#     seq_lens, metadata.get_logical_page_table(), ...) then fp8 MQA logits
#     (torch route) and metadata.topk_transform.
# Also sets self.sm_count (dsa_indexer.py:334 only sets it on CUDA, via
# resolve_num_sms -> torch.cuda.get_device_properties, dsa/utils.py:359), read by
# _get_topk_paged's chunking (:1348); 132 = H200 SMs.
# ---------------------------------------------------------------------------
STANDIN_NUM_SMS = 132


def _get_topk_ragged_cpu(self, forward_batch, layer_id, q_fp8, weights, metadata):
    import torch
    from sglang.srt.layers.attention.dsa import dsa_indexer as m
    from sglang.srt.layers.attention.dsa.utils import resolve_fp8_mqa_logits_fn

    _count("Indexer._get_topk_ragged_cpu")
    assert forward_batch.forward_mode.is_extend_without_speculative()
    pool = m.get_token_to_kv_pool()
    assert pool.index_page_size == 64, "only support page size 64"
    assert len(weights.shape) == 3
    weights = weights.squeeze(-1)
    block_tables = metadata.get_logical_page_table()
    batch_size = len(block_tables)
    token_nums = q_fp8.shape[0]
    topk_result = torch.full((token_nums, self.index_topk), -1, device=q_fp8.device,
                             dtype=torch.int32)
    if batch_size == 0:
        return topk_result
    ks, ke = metadata.get_indexer_kvcache_range()
    seq_lens_cpu = metadata.get_indexer_seq_len_cpu()
    seq_len_sum = int(torch.sum(seq_lens_cpu).item())
    max_seq_len = int(torch.max(seq_lens_cpu).item())
    k_fp8, k_scale = pool.get_index_k_scale_buffer(
        layer_id, metadata.get_indexer_seq_len(), block_tables, seq_len_sum, max_seq_len
    )
    k_fp8 = k_fp8.view(torch.float8_e4m3fn)
    k_scale = k_scale.view(torch.float32).squeeze(-1)
    q_offset = ks.shape[0]
    assert q_offset != 0
    q_padded, w_padded, _ = self._pad_heads_for_deep_gemm(q_fp8[:q_offset], weights[:q_offset])
    logits = resolve_fp8_mqa_logits_fn()(q_padded, (k_fp8, k_scale), w_padded, ks, ke,
                                         clean_logits=False)
    seq_lens_expanded = metadata.get_seqlens_expanded()
    assert logits.shape[0] == len(seq_lens_expanded) and logits.shape[1] == k_fp8.shape[0]
    self._mask_init_and_local_tokens(logits, seq_lens_expanded, ks)
    topk_result[:q_offset] = metadata.topk_transform(logits, self.index_topk, ks=ks)
    return topk_result


def indexer_forward_native(self, x, q_lora, positions, forward_batch, layer_id,
                           return_indices: bool = True, use_cuda_graph: bool = True):
    import torch
    from sglang.kernels.ops.quantization.act_quant_triton import act_quant
    from sglang.srt.layers.attention.dsa import dsa_indexer as m

    _count("Indexer.forward_native")
    assert not isinstance(x, tuple), "fused RMSNorm+quant inputs are GPU-only"
    assert not self.use_dsa_indexer_fusion and not self.use_aiter_fused_fp8_writer
    if not hasattr(self, "sm_count"):
        self.sm_count = STANDIN_NUM_SMS
        self.half_device_sm_count = STANDIN_NUM_SMS // 2
    metadata = m.get_attn_backend().get_indexer_metadata(layer_id, forward_batch)
    if metadata is None:
        return None

    if self._should_skip_logits_computation(forward_batch) and not self.dsa_enable_prefill_cp:
        _count("Indexer.k_only")
        topk_result = self._forward_cuda_k_only(
            x, positions, forward_batch, layer_id, act_quant, metadata, return_indices
        )
        topk_result = m._broadcast_indexer_topk_from_rank0(topk_result)
        return m.maybe_capture_indexer_topk(layer_id, topk_result)

    query, key, _ = self._get_q_k_bf16(q_lora, x, positions, False, forward_batch=forward_batch)
    q_fp8, q_scale = act_quant(query, self.block_size, self.scale_fmt)
    self._store_index_k_cache(forward_batch=forward_batch, layer_id=layer_id, key=key,
                              act_quant=act_quant)
    weights = self._get_logits_head_gate(x, q_scale)

    if forward_batch.seq_lens.numel() == 0:
        topk_result = torch.full((x.shape[0], self.index_topk), -1, dtype=torch.int,
                                 device=x.device)
    elif (
        forward_batch.forward_mode.is_decode_or_idle()
        or forward_batch.forward_mode.is_target_verify()
        or forward_batch.forward_mode.is_draft_extend_v2()
    ):
        _count("Indexer._get_topk_paged")
        topk_result = self._get_topk_paged(forward_batch, layer_id, q_fp8, weights, metadata)
    else:
        topk_result = _get_topk_ragged_cpu(self, forward_batch, layer_id, q_fp8, weights, metadata)
    topk_result = m._broadcast_indexer_topk_from_rank0(topk_result)
    return m.maybe_capture_indexer_topk(layer_id, topk_result)


@_on_import("sglang.srt.layers.attention.dsa.dsa_indexer")
def _patch_indexer(mod):
    mod.Indexer.forward_native = indexer_forward_native


# ---------------------------------------------------------------------------
# 9. (Harness option, not a GPU stand-in) "contextful" dummy weights.
# SGLang's --load-format dummy (srt/model_loader/weight_utils.py:1740
# initialize_dummy_weights, called from model_loader/loader.py:1517) fills every
# float tensor with U(-1e-3, 1e-3) from the same seed, norm weights included. The
# residual stream is then the token embedding and the next token depends on the
# last token only: the KV cache (latent rows, index-K, top-k) has no visible
# effect on the output, so a token-identity check between two KV pools would pass
# even with a broken pool. With ULA_CPU_DUMMY_INIT=contextful (the harness's default)
# the loader gets this init instead: norm weights 1, biases 0, matrices
# N(0, gain^2/fan_in) (embedding N(0, 0.25^2); gain 4 for q_b_proj, else 1),
# other 1-D tensors U(-1e-3, 1e-3), seeded per parameter name (crc32), so the
# output depends on the attended context. post_load_weights (w_kc / w_vc split)
# still runs on the result.
# ---------------------------------------------------------------------------
_DEFAULT_GAINS = "embed_tokens=0.25,q_b_proj=4"


def _gain(name: str) -> float:
    # Multiplies the init std of matching parameters. Default: embedding std 0.25
    # (so attention is not swamped by the residual) and 4x q_b_proj (sharper
    # softmax); with these the first token after a 300-token prefill already
    # depends on the KV pool's contents. Override: ULA_CPU_DUMMY_GAINS="sub=g,...".
    for item in filter(None, os.environ.get("ULA_CPU_DUMMY_GAINS", _DEFAULT_GAINS).split(",")):
        sub, g = item.split("=")
        if sub in name:
            return float(g)
    return 1.0


def contextful_dummy_weights(model, low: float = -1e-3, high: float = 1e-3, seed: int = 1234):
    import zlib

    import torch

    _count("contextful_dummy_weights")
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        if name.endswith(("weight_scale_inv", "weight_scale_2")):
            param.fill_(1.0)
            continue
        g = torch.Generator(device="cpu")
        g.manual_seed(seed + zlib.crc32(name.encode()))
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight":
            param.fill_(1.0)
        elif leaf.endswith("bias"):
            param.zero_()
        elif param.dim() >= 2:
            std = 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5
            std *= _gain(name)
            tmp = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            param.copy_(tmp.to(param.dtype))
        else:
            tmp = torch.empty(param.shape, dtype=torch.float32).uniform_(low, high, generator=g)
            param.copy_(tmp.to(param.dtype))


@_on_import("sglang.srt.model_loader.loader")
def _patch_dummy_init(mod):
    if os.environ.get("ULA_CPU_DUMMY_INIT", "stock") == "contextful":
        mod.initialize_dummy_weights = contextful_dummy_weights


# ---------------------------------------------------------------------------
# 10. (Harness option, not a GPU stand-in) width-independent top-k tie-break.
# With --dsa-topk-backend torch, DSATopKBackend.topk_func
# (srt/layers/attention/dsa/dsa_topk_backend.py:58) calls _topk_unfused (:272)
# with torch.topk. The indexer's logits (sum_h relu(q_h.k) w_h) contain many
# exact ties (e.g. 0.0 when every head's score is negative), and torch.topk's
# choice among tied values depends on the row width, i.e. on how many masked
# (-inf) columns the batch's widest request adds. The same request then selects
# different tokens alone vs batched. With ULA_CPU_STABLE_TOPK=1 (run.py's
# default) the torch backend uses a stable descending sort instead: the k
# largest, ties -> lowest position, independent of padding. Same masking and
# -1 filling (_topk_unfused is unchanged).
# ---------------------------------------------------------------------------
def stable_topk(x, k, dim=-1):
    import torch

    vals, idx = torch.sort(x, dim=dim, descending=True, stable=True)
    return vals.narrow(dim, 0, k), idx.narrow(dim, 0, k)


@_on_import("sglang.srt.layers.attention.dsa.dsa_topk_backend")
def _patch_stable_topk(mod):
    if os.environ.get("ULA_CPU_STABLE_TOPK", "0") != "1":
        return
    orig = mod.DSATopKBackend.topk_func

    def topk_func(self, score, lengths, topk, row_starts=None):
        if self.is_torch():
            _count("stable_topk")
            return mod._topk_unfused(score, lengths, topk, row_starts=row_starts,
                                     topk_op=stable_topk, topk_op_kwargs={"dim": -1})
        return orig(self, score, lengths, topk, row_starts=row_starts)

    mod.DSATopKBackend.topk_func = topk_func


# ---------------------------------------------------------------------------
# 11. TP groups on CPU: no PyNccl communicator.
# srt/distributed/parallel_state.py:2181-2185 (init_model_parallel_group) reads the
# platform's ``supports_pynccl`` only for out-of-tree platforms; the in-tree CPU platform
# (capabilities.supports_pynccl = False, platforms/interface.py:73) then gets
# use_pynccl=True and GroupCoordinator.__init__ (:464) builds a PyNcclCommunicator, which
# raises "Expected a cuda device, but got: cpu" for --tp-size > 1. With use_pynccl=False a
# CPU group all-reduces through torch.distributed over its gloo device group
# (GroupCoordinator.all_reduce, :695-699), SGLang's own CPU fallback when its shared-memory
# all-reduce (Intel AMX / arm64 builds of sgl_kernel) is unavailable.
# ---------------------------------------------------------------------------
@_on_import("sglang.srt.distributed.parallel_state")
def _patch_cpu_groups(mod):
    orig = mod.init_model_parallel_group

    def init_model_parallel_group(*args, use_pynccl=None, **kwargs):
        import torch

        if use_pynccl is None and not torch.cuda.is_available():
            _count("init_model_parallel_group(use_pynccl=False)")
            use_pynccl = False
        return orig(*args, use_pynccl=use_pynccl, **kwargs)

    init_model_parallel_group.__wrapped__ = orig
    mod.init_model_parallel_group = init_model_parallel_group
