"""End-to-end equality: the reference DSA-MLA model decoding through ulacache (GPU pool under
half of the live history, so promotions and spills happen every step) gives bit-identical
attention outputs, logits, top-k and chosen tokens to a fully resident run."""

from __future__ import annotations

import pytest

from ulacache.config import UlaCacheConfig
from ulacache.oracle.driver import run_equality
from ulacache.oracle.refmodel import ModelGeometry


@pytest.mark.parametrize("layers_per_indexer", [1, 2], ids=["per-layer", "shared"])
@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_decode_through_ulacache_equals_resident(layout, layers_per_indexer):
    geom = ModelGeometry.tiny(layout=layout, layers_per_indexer=layers_per_indexer)
    cfg = UlaCacheConfig(layout="tiny", row_bytes=geom.row_bytes, n_layers=geom.n_layers,
                         layers_per_group=layers_per_indexer, gpu_slots=160, cpu_slots=640,
                         page_size=64, max_requests=8, n_buckets=4)
    prompts = [150, 90, 40, 120]
    report = run_equality(geom, cfg, prompts, n_steps=64)
    assert report.identical, report.mismatches[:5]
    assert report.steps == 64 and report.requests == 4
    assert report.live_history == sum(prompts) + 4 * 64
    assert cfg.gpu_slots < report.live_history / 2  # pool under half of the live history
    busy = [p + s > 0 for p, s in zip(report.promotions_per_step, report.spills_per_step)]
    assert all(busy), "every step must move rows between tiers"
    assert sum(report.promotions_per_step) > 0 and sum(report.spills_per_step) > 0
