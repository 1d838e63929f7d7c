"""The fused round start (one launch for every PB-LRU policy of an arena) and the fused release
(three launches per group) against their torch references, table by table.

CPU tensors run the Triton kernels under the interpreter (conftest.py); the GPU variants are
marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

from ulacache.config import UlaCacheConfig
from ulacache.errors import AddressError
from ulacache.kernels import fused_access, fused_policy, fused_release
from ulacache.pblru import PBLRUArena
from ulacache.space import AddressSpace

from .fused_helpers import DeviceOps, TwinDriver, make_twins, state

pytestmark = pytest.mark.skipif(not fused_access.available(), reason="needs Triton")


def _drive_arenas(ref: PBLRUArena, fused: PBLRUArena, rounds: int, seed: int) -> None:
    """The same random touches, assignments and releases on both arenas (torch methods),
    then a round start: torch on ``ref``, one fused launch on ``fused``; every table equal
    after each round, scratch columns included (the fused advance moves whole rows)."""
    gen = torch.Generator().manual_seed(seed)
    G = ref.policies[0].n_slots
    for r in range(rounds):
        for a, b in zip(ref.policies, fused.policies):
            # sizes swing from a few slots to half the pool: epochs start on some rounds only
            n = int(torch.randint(0, max(2, G // 2), (1,), generator=gen))
            slots = torch.randperm(G, generator=gen)[:n]
            # -1 padding and re-touches this round: masked moves land in the scratch columns,
            # which a round start moves with the rest of each row
            again = torch.cat([slots[: n // 4], torch.tensor([-1, -1])])
            for p in (a, b):
                (p.assign if r % 2 else p.touch)(torch.cat([slots, torch.tensor([-1])]))
                p.touch(again)
            if r % 3 == 2:
                gone = torch.randperm(G, generator=gen)[: G // 5]
                a.release(gone)
                b.release(gone)
        ref.advance()
        before = fused_access.launch_count()
        fused_policy.advance(fused)
        assert fused_access.launch_count() - before == fused_policy.LAUNCHES_PER_ADVANCE == 1
        for i, (x, y) in enumerate(zip(ref.tables, fused.tables)):
            assert torch.equal(x.cpu(), y.cpu()), f"round {r}: table {i} differs"
        for b in fused.policies:
            b.check_integrity()


@pytest.mark.parametrize("n,G,n_buckets,fill,hyper", [
    (3, 1000, 4, None, 64),  # turnover-paced epochs
    (2, 5000, 2, 0, 2),  # one epoch per round, the smallest ring, deep hyper levels
    (4, 300, 64, 3, 1),  # many buckets over a small pool
    (1, 63 * 16 * 3 + 5, 8, 50, 2),  # a partial last superblock
])
def test_fused_advance_equals_torch(n, G, n_buckets, fill, hyper):
    make = lambda: PBLRUArena(n, G, n_buckets, bucket_fill=fill, hyper=hyper)  # noqa: E731
    ref, fused = make(), make()
    _drive_arenas(ref, fused, rounds=10, seed=G + n_buckets)
    epochs = [int(p.epoch_t) for p in fused.policies]
    assert max(epochs) > 0, "no round started a new epoch: the test would miss that branch"


def test_fused_advance_is_one_launch_and_nothing_else():
    arena = PBLRUArena(61, 2000, 8)
    fused_policy.advance(arena)  # compile / interpret once outside the count
    before = fused_access.launch_count()
    with DeviceOps() as mode:
        fused_policy.advance(arena)
    assert fused_access.launch_count() - before == 1
    assert mode.ops == [], f"device ops outside the launch: {mode.ops}"


def test_fused_advance_refuses_mixed_bucket_fill():
    arena = PBLRUArena(2, 100, 4)
    arena.policies[1].bucket_fill = 7
    with pytest.raises(ValueError, match="bucket_fill"):
        fused_policy.advance(arena)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_release_equals_torch(seed):
    """Placements, accesses and releases (hostile: padding, out of range, duplicates, dead
    addresses; many blocks) on twin groups: every table equal after each operation."""
    ref, fused = make_twins(2, 1500, 128, 1500, 16, 4, hyper=2)
    d = TwinDriver(ref, fused, seed)
    for r in range(6):
        d.place(300, hostile=r % 2 == 1)
        d.advance()
        d.access(4, 40, hostile=False)
        d.advance()
        d.release(200 + 60 * r, hostile=seed % 2 == 0 or r % 2 == 1)
    ref.check_integrity()
    fused.check_integrity()


def test_fused_release_is_three_launches_and_nothing_else():
    _, fused = make_twins(2, 2000, 256, 2000, 16, 4)
    fused.place(torch.arange(1500))
    fused.policy.advance()
    fused.release(torch.arange(0, 40))  # first call allocates the scratch
    gone = torch.arange(100, 1400, 3)
    before = fused_access.launch_count()
    with DeviceOps() as mode:
        fused.release(gone)
    assert fused_access.launch_count() - before == fused_release.LAUNCHES_PER_RELEASE == 3
    assert mode.ops == [], f"device ops outside the fused launches: {mode.ops}"


def test_fused_release_checks_leave_state_unchanged():
    """Validate on: a bad release raises before any launch; nothing changes."""
    _, fused = make_twins(2, 400, 64, 400, 16, 4, validate=True)
    fused.place(torch.arange(50))
    before = {k: v.clone() for k, v in state(fused).items()}
    for bad in ([3, 3], [5, 400], [-2]):
        with pytest.raises(AddressError):
            fused.release(torch.tensor(bad))
        after = state(fused)
        for k, v in before.items():
            assert torch.equal(v, after[k]), f"{bad}: {k} changed"
    fused.release(torch.tensor([1, 2, -1]))
    assert int(fused.loc[1]) == -1 and int(fused.loc[2]) == -1
    fused.check_integrity()


def _space(path: str) -> AddressSpace:
    cfg = UlaCacheConfig(layout="tiny", row_bytes=16, n_layers=6, layers_per_group=2,
                         gpu_slots=200, cpu_slots=600, page_size=1, max_requests=8,
                         n_buckets=4, validate=False, access_path=path)
    return AddressSpace(cfg, "cpu", n_logical=800)


def test_address_space_round_start_is_one_launch_and_equal():
    """A fused address space starts a round for all its groups in one launch, and over a
    serving-like sequence (place, access, release, round starts) keeps every group's state
    equal to the torch address space's."""
    ref, fused = _space("torch"), _space("fused")
    assert fused.policy_arena is not None and len(fused.policy_arena) == len(fused.groups) == 3
    gen = torch.Generator().manual_seed(7)
    live: list[int] = []
    for step in range(8):
        for s in (ref, fused):
            before = fused_access.launch_count()
            s.begin_round()
            if s is fused:
                assert fused_access.launch_count() - before == 1
        new = torch.arange(step * 60, step * 60 + 60)
        for s in (ref, fused):
            s.place(new)
        live += new.tolist()
        pick = torch.tensor(live)[torch.randint(0, len(live), (3, 50), generator=gen)]
        for s in (ref, fused):
            for g in s.groups:
                g.access(pick)
        if step % 3 == 2:
            gone = torch.tensor(live[:70])
            live = live[70:]
            for s in (ref, fused):
                s.begin_round()
                s.release(gone)
        for gr, gf in zip(ref.groups, fused.groups):
            a, b = state(gr), state(gf)
            for k in a:
                assert torch.equal(a[k], b[k]), f"step {step}: {k} differs"
    for s in (ref, fused):
        s.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_advance_equals_torch_on_gpu():
    make = lambda: PBLRUArena(61, 300_000, 64, "cuda")  # noqa: E731
    _drive_arenas(make(), make(), rounds=6, seed=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_release_equals_torch_on_gpu():
    ref, fused = make_twins(2, 20_000, 4096, 20_000, 64, 16, device="cuda")
    d = TwinDriver(ref, fused, 5)
    for r in range(4):
        d.place(3000, hostile=r % 2 == 1)
        d.advance()
        d.access(16, 256, hostile=False)
        d.release(2000, hostile=True)
