"""The fused kernels compile for the H200 (sm_90) and B300 (sm_100) without a GPU, with no
register spills (CI: under Triton 3.6 and again under SGLang's Triton 3.8, whose ptxas differs).

Triton's interpreter (how CI runs the kernels) accepts programs the compiler rejects, so the
kernels are also compiled ahead of time, in a subprocess with the interpreter off, through
Triton's own ``ptxas``: a type error, an unsupported atomic or a spilling tile fails here, not
first on the lent GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_every_fused_kernel_compiles_for_sm90_and_sm100_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, "-m", "ulacache.kernels.fused_compile",
                          "--arch", "90", "100"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    names = {line.split()[1] for line in lines}
    assert {line.split()[0] for line in lines} == {"sm_90", "sm_100"}
    assert names == {"_k1_claim", "_k2_first_touch", "_k3_victims_move",
                     "_k4_assign_translate", "_translate", "claim_in_range",
                     "_g1_claim_hashed", "_g2_first_hits", "_g3_claim_slots", "_g4_assign_rows",
                     "_advance_kernel",
                     "_r2_drop", "_r3_push", "_reclaim", "_replay_moves"}
    # K1..K4 for access and for place (its K1 reclaims shadows), K3 / K4 of an access without
    # shadows, the standalone reclaim, translate, K1 striped (TP; and DCP, without the owner's
    # verdict), the claim kernel (R1), G1 (the claim hash), G2..G4, the round start, R2, R3;
    # K3 (with and without shadows, and place), G3 and the round start again (other widths)
    # for the second geometry; the prefetch's K1..K4 (and its K3 for the second geometry); a
    # shared group's deferred K3 and its replay (first geometry: two layers)
    assert len(lines) == 2 * 34, res.stdout
    if "no cuobjdump" not in res.stdout:
        assert all("STACK 0" in line for line in lines), res.stdout
