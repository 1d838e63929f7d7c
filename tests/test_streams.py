"""Stream order (design invariants 3 and 8): every mutation of core state is issued on the core
stream, so a release or a placement issued from the scheduler's stream cannot overtake a forward
already launched on the core (forward) stream that still reads those rows.

CPU: a stream-order recorder logs the active core stream at every write to core state.
GPU: a reader held back on the forward stream still sees the old rows after the scheduler's
stream released them and wrote new rows into the freed slots; a control without the core stream
shows the same scenario does race.
"""

from __future__ import annotations

import pytest
import torch

from ulacache.config import UlaCacheConfig
from ulacache.space import AddressSpace

from .helpers import WriteLog, fill, row_bytes_for

RB = 16


class StreamOrderRecorder(WriteLog):
    """Logs ``(op, active core stream)`` for every op that writes into one of ``storages``."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages = storages

    @property
    def writes(self) -> list[tuple[str, object]]:
        return [(op, stream) for op, ptr, stream in self.events if ptr in self.storages]


def core_storages(space: AddressSpace) -> set[int]:
    """Storage pointers of every tensor of core state (mapping, owners, pools, policy)."""
    out = set()
    for g in space.groups:
        for t in (g.loc, g.gpu_owner, g.shadow, g.claim_table, g.counters, g.pools.gpu,
                  g.pools.cpu, g.pools.cpu_free, g.pools.cpu_top, *vars(g.policy).values()):
            if isinstance(t, torch.Tensor) and t.numel():
                out.add(t.untyped_storage().data_ptr())
    return out


def make_space(**kw) -> AddressSpace:
    base = dict(layout="tiny", n_layers=2, layers_per_group=1, gpu_slots=16, cpu_slots=64,
                page_size=1, n_buckets=4, validate=False)
    base.update(kw)
    return AddressSpace(UlaCacheConfig(**base), n_logical=128)


def test_every_core_mutation_runs_on_the_core_stream():
    space = make_space()
    producer = object()  # on CPU any token stands for the stream
    space.set_stream(producer)
    rec = StreamOrderRecorder(core_storages(space))
    with rec:
        for r in range(4):
            space.begin_round()
            new = torch.arange(10 * r, 10 * r + 10)
            space.place(new)
            fill(space, new, version=r)
            space.access(0, torch.arange(0, 10 * r + 10, 3).view(1, -1))
            space.release(torch.arange(10 * r, 10 * r + 2))
        space.check_integrity()
    assert len(rec.writes) > 100
    off = [op for op, s in rec.writes if s is not producer]
    assert not off, f"core state mutated off the core stream: {off[:5]}"
    # the recorder sees a bypass: a write to core state outside the address space's calls
    rec = StreamOrderRecorder(core_storages(space))
    with rec:
        space.groups[0].counters.add_(0)
    assert rec.writes and rec.writes[0][1] is None


def _race(scoped: bool) -> bool:
    """True when a reader on the forward stream read the rows as they were when it was
    launched, although the scheduler's stream released them and wrote new ones meanwhile."""
    dev = torch.device("cuda")
    space = AddressSpace(UlaCacheConfig(layout="tiny", row_bytes=RB, n_layers=1, gpu_slots=64,
                                        cpu_slots=64, page_size=1, validate=False),
                         dev, n_logical=256)
    forward = torch.cuda.Stream()
    if scoped:
        space.set_stream(forward)
    old = torch.arange(64, device=dev)
    space.begin_round()
    space.place(old)
    space.write(0, old, row_bytes_for(old.cpu(), 0, 1, RB).to(dev))
    torch.cuda.synchronize()
    seen = torch.empty(64, RB, dtype=torch.uint8, device=dev)
    with torch.cuda.stream(forward):  # forward N+1, launched before the frees of batch N
        rows = space.access(0, old.view(1, -1)).view(-1).long()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of attention still to come
        seen.copy_(space.gpu_rows(0)[rows])
    # the scheduler's stream: request finished, its slots reused by the next prefill
    space.release(old)
    space.begin_round()
    new = torch.arange(100, 164, device=dev)
    space.place(new)
    space.write(0, new, row_bytes_for(new.cpu(), 0, 2, RB).to(dev))
    torch.cuda.synchronize()
    return torch.equal(seen.cpu(), row_bytes_for(old.cpu(), 0, 1, RB))


@pytest.mark.gpu
def test_gpu_release_waits_for_the_forward_that_reads():
    assert _race(scoped=True), "a release overtook the forward that reads the rows"


@pytest.mark.gpu
def test_gpu_without_core_stream_the_scenario_races():
    """Control: the same calls with no core stream do overwrite rows the reader has not read
    yet, so the test above would catch a mutation issued off the core stream."""
    assert not _race(scoped=False)
