"""The mutation check (tests/mutants.py) stays meaningful: every mutant's original line is in
its file exactly once, so a refactor that moves a line makes this fail instead of leaving a
mutant that silently tests nothing."""

from __future__ import annotations

import pytest

from . import mutants

ALL = (mutants.MUTANTS + mutants.TP_MUTANTS + mutants.FUSED_MUTANTS + mutants.FUSED_TP_MUTANTS
       + mutants.FUSED_ROUND_MUTANTS + mutants.HOSTILE_MUTANTS + mutants.PIECES_MUTANTS
       + mutants.DISTINCT_MUTANTS + mutants.INTERFACE_MUTANTS + mutants.SHADOW_MUTANTS
       + mutants.FUSED_SHADOW_MUTANTS + mutants.PREFILL_MUTANTS
       + mutants.SGLANG_STAGE_MUTANTS + mutants.PREFETCH_MUTANTS + mutants.BUFMAP_MUTANTS
       + mutants.STRIPE_MUTANTS + mutants.SGLANG_DCP_MUTANTS + mutants.SGLANG_STRIPE_MUTANTS
       + mutants.SGLANG_CLASSES_MUTANTS)


@pytest.mark.parametrize("path,old,new,what", ALL, ids=[m[3] for m in ALL])
def test_mutant_original_is_present_once(path, old, new, what):
    assert old != new
    assert (mutants.ROOT / path).read_text().count(old) == 1, f"stale mutant: {what}"
