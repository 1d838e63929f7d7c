"""Test-wide settings: one torch thread (small tensor ops on 2 shared cores run faster and
deterministically single-threaded), reproducible Hypothesis runs, GPU tests skipped where
CUDA is absent, and Triton's interpreter without its repeated namespace patching
(tests/interpreter_speedup.py).

Hypothesis profiles: ``ci`` (default) derandomizes, so every run checks the same examples and a
failure reproduces; ``explore`` (``HYPOTHESIS_PROFILE=explore``) draws fresh examples, 5x as
many, to look for new failures locally.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)
# Without CUDA, Triton kernels run on CPU tensors only under its interpreter, chosen before
# anything imports Triton (the fused-path tests run through it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if importlib.util.find_spec("triton") is not None and os.environ["TRITON_INTERPRET"] == "1" \
            and not os.environ.get("ULACACHE_PLAIN_INTERPRETER"):  # =1: Triton unmodified
        from tests.interpreter_speedup import install

        install()  # each nested device function's namespace patched once per launch

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The fused-kernel test files: marked ``kernels`` so CI's second stage reruns them under
# Triton 3.8 in the same pytest run as the SGLang tests (``-m "sglang or kernels"``).
KERNEL_FILES = frozenset({"test_fused_access.py", "test_fused_policy.py", "test_fused_tp.py",
                          "test_fused_compile.py", "test_hostile_calls.py",
                          "test_prefetch_shared.py"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in KERNEL_FILES:
            item.add_marker(pytest.mark.kernels)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """Under ``--dist loadgroup`` (CI's second stage) xdist groups tests by a suffix it writes
    into their node ids; from pytest 9.2 on, node ids are structured and the suffix is silently
    lost (pytest-dev/pytest-xdist#1386): every rehearsal batch then ran once per test, on both
    workers (minutes of CI). Refuse in one line rather than run ungrouped."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    major, minor = (int(x) for x in pytest.__version__.split(".")[:2])
    if (major, minor) >= (9, 2):
        raise pytest.UsageError(
            f"--dist loadgroup does not group under pytest {pytest.__version__} "
            "(pytest-dev/pytest-xdist#1386): pip install 'pytest<9.2' (the [test] extra pins it)")
