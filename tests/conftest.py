"""Test-wide settings: one torch thread (small tensor ops on 2 shared cores run faster and
deterministically single-threaded), and GPU tests skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
