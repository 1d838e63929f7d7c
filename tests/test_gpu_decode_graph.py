"""The decode-step path (translate, plan, promote, gather) captured in a CUDA graph and replayed
with new inputs gives exactly what the eager CPU reference gives (GPU only)."""

from __future__ import annotations

import pytest
import torch

from ulacache.cache import UlaCache
from ulacache.config import UlaCacheConfig

from .helpers import row_bytes_for

pytestmark = pytest.mark.gpu
RB = 656


def _pair(policy: str):
    cfg = UlaCacheConfig(layout="fp8", n_layers=2, layers_per_group=2, gpu_slots=512,
                         cpu_slots=4096, page_size=64, max_requests=8, n_buckets=4,
                         policy=policy)
    return UlaCache(cfg, "cuda"), UlaCache(cfg, "cpu")


def _both(caches, fn):
    return [fn(c) for c in caches]


@pytest.mark.parametrize("policy", ["pblru", "lru"])
def test_captured_access_replays_like_eager(policy):
    caches = _pair(policy)
    bs, k = 4, 96
    for r in range(bs):
        _both(caches, lambda c, r=r: c.admit(r, 1200))
        for _ in range(4):  # 1024-token prompts in rounds of 256
            _both(caches, lambda c: c.space.begin_round())
            addrs = _both(caches, lambda c, r=r: c.extend(r, 256))
            for c, a in zip(caches, addrs):
                for layer in range(2):
                    c.space.write(layer, a, row_bytes_for(a.cpu(), layer, 0, RB).to(c.device))
    gen = torch.Generator().manual_seed(0)
    static = torch.full((bs, k), -1, dtype=torch.int64, device="cuda")
    out = torch.empty(bs, k, dtype=torch.int32, device="cuda")
    gpu, cpu = caches

    def pick():
        rows = []
        for r in range(bs):
            n = gpu.requests[r].n_tokens
            pos = torch.randperm(n, generator=gen)[:k]
            pos[torch.rand(k, generator=gen) < 0.1] = -1  # padding
            rows.append(cpu.addresses(r, pos))
        return torch.stack(rows)

    # warm up (eager, identical on both), then capture one step
    for _ in range(3):
        _both(caches, lambda c: c.space.begin_round())
        sel = pick()
        a = gpu.space.access(0, sel.cuda())
        b = cpu.space.access(0, sel)
        assert torch.equal(a.cpu(), b)
    torch.cuda.synchronize()
    _both(caches, lambda c: c.space.begin_round())
    sel = pick()
    static.copy_(sel)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            gpu.space.access(0, static, out=out)
    torch.cuda.current_stream().wait_stream(s)
    # capture does not run the work: replay it as this round's step, then keep replaying
    for step in range(12):
        if step:
            _both(caches, lambda c: c.space.begin_round())
            for r in range(bs):
                addrs = _both(caches, lambda c, r=r: c.extend(r, 1))
                for c, a in zip(caches, addrs):
                    for layer in range(2):
                        c.space.write(layer, a,
                                      row_bytes_for(a.cpu(), layer, step, RB).to(c.device))
            sel = pick()
            static.copy_(sel)
        graph.replay()
        ref = cpu.space.access(0, sel)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), ref)
        g_gpu, g_cpu = gpu.space.groups[0], cpu.space.groups[0]
        assert torch.equal(g_gpu.loc.cpu(), g_cpu.loc)
        for layer in range(2):
            rows = out.long().clamp(min=0)
            assert torch.equal(gpu.space.gpu_rows(layer)[rows].cpu(),
                               cpu.space.gpu_rows(layer)[rows.cpu()])
        gpu.check_integrity()
