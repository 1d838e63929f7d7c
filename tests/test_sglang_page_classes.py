"""ulacache's page-classed logical allocator (``patches/sglang_page_classes.py``) against a
reference model, over SGLang 0.5.23's paged-allocator interface and kernels (their CPU twins).

A Hypothesis state machine runs SGLang's calls (chunked prefill extends, decode batches,
speculative extends from an unaligned prefix, a retracted tail freed by ``free_segment``,
finishes by ``free`` and by ``free_segment``, free groups) over P = 2, 4, 8 classes with and
without ``need_sort``, and after every call checks the contract:

- every live request's token at position ``j`` has slot ``page(j // 64) * 64 + j % 64`` and the
  page at position ``k`` is of class ``k mod P`` (the striped index-K's rank ``k mod P``);
- no page is live twice or live and free; live, free and the padding page are every page;
- ``available_size`` is ``P x 64 x`` the emptiest class's free pages and a refused call
  (``None``) changes nothing.

Beside it: a rank's narrow decode view (``ceil(W / P)`` pages) over the allocator's tables
drops no page (it equals the full-width view); a class running dry refuses; bad class counts.
The wrapper's choice of this allocator and the top-k over its tables under SGLang's seams:
``tests/test_sglang_tp_stripe.py``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

pytest.importorskip("sglang")
pytestmark = pytest.mark.sglang

PAGE = 64


def _allocator(P: int, pages: int, need_sort: bool = False):
    from ulacache.patches.sglang_page_classes import PositionClassedPageAllocator

    return PositionClassedPageAllocator(pages * PAGE, PAGE, torch.int64, "cpu", None, need_sort,
                                        P)


class ClassedAllocatorMachine(RuleBasedStateMachine):
    """Requests as lists of token slots (the ``req_to_token`` rows SGLang keeps)."""

    @initialize(P=st.sampled_from([2, 4, 8]), pages=st.integers(8, 40),
                need_sort=st.booleans())
    def setup(self, P, pages, need_sort):
        self.P, self.pages = P, pages
        self.a = _allocator(P, pages, need_sort)
        self.reqs: dict[int, list[int]] = {}
        self.next_id = 0
        self.group_open = False

    # -- SGLang's calls -----------------------------------------------------------------------
    def _extend(self, rows: list[list[int]], adds: list[int]):
        before = self.a.get_all_free_pages().sort()[0].clone()
        prefix = torch.tensor([len(r) for r in rows])
        seq = prefix + torch.tensor(adds)
        last = torch.tensor([r[-1] if r else -1 for r in rows])
        out = self.a.alloc_extend(prefix, prefix, seq, seq, last, int(sum(adds)))
        if out is None:
            assert torch.equal(self.a.get_all_free_pages().sort()[0], before)
            return False
        out = out.tolist()
        assert len(out) == sum(adds)
        for r, n in zip(rows, adds):
            r.extend(out[:n])
            out = out[n:]
        return True

    @rule(n=st.integers(1, 300), chunk=st.integers(1, 200))
    def prefill(self, n, chunk):
        row: list[int] = []
        while len(row) < n:
            if not self._extend([row], [min(chunk, n - len(row))]):
                break
        if row:
            self.reqs[self.next_id] = row
            self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(steps=st.integers(1, 70), data=st.data())
    def decode(self, steps, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, unique=True))
        for _ in range(steps):
            rows = [self.reqs[i] for i in ids]
            seq = torch.tensor([len(r) + 1 for r in rows])
            last = torch.tensor([r[-1] for r in rows])
            before = self.a.get_all_free_pages().sort()[0].clone()
            out = self.a.alloc_decode(seq, seq, last)
            if out is None:
                assert torch.equal(self.a.get_all_free_pages().sort()[0], before)
                return
            for r, loc in zip(rows, out.tolist()):
                r.append(loc)

    @precondition(lambda self: self.reqs)
    @rule(draft=st.integers(1, 5), data=st.data())
    def verify_extend(self, draft, data):
        """A speculative verify: draft tokens appended from an unaligned prefix."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, unique=True))
        self._extend([self.reqs[i] for i in ids], [draft] * len(ids))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), how=st.sampled_from(["free", "segment", "tail"]),
          grouped=st.booleans())
    def finish(self, data, how, grouped):
        i = data.draw(st.sampled_from(sorted(self.reqs)))
        row = self.reqs[i]
        if grouped:
            self.a.free_group_begin()
        if how == "tail":  # retract the tail from a page-aligned position, keep the head
            keep = PAGE * data.draw(st.integers(0, (len(row) - 1) // PAGE))
            self.a.free_segment(torch.tensor(row[keep:]), start_pos=keep)
            del row[keep:]
            if not row:
                del self.reqs[i]
        else:
            t = torch.tensor(row)
            self.a.free(t) if how == "free" else self.a.free_segment(t, start_pos=0)
            del self.reqs[i]
        if grouped:
            self.a.free_group_end()

    # -- the contract -----------------------------------------------------------------------
    @invariant()
    def contract(self):
        P, a = self.P, self.a
        live: list[int] = []
        for row in self.reqs.values():
            pages = [row[j] // PAGE for j in range(0, len(row), PAGE)]
            for j, loc in enumerate(row):
                assert loc == pages[j // PAGE] * PAGE + j % PAGE, "slots not page-contiguous"
            for k, p in enumerate(pages):
                assert p % P == k % P, f"position page {k} from class {p % P}"
            live += pages
        free = a.get_all_free_pages().tolist()
        assert len(set(live)) == len(live), "a page live twice"
        assert not set(live) & set(free), "a page live and free"
        assert sorted(live + free) == list(range(1, self.pages + 1))
        a.check_classes()
        counts = [sum(1 for p in free if p % P == r) for r in range(P)]
        assert a.class_free_counts() == counts
        assert a.available_size() == P * PAGE * min(counts)


TestClassedAllocator = ClassedAllocatorMachine.TestCase
TestClassedAllocator.settings = settings(max_examples=60, stateful_step_count=25,
                                         deadline=None)


def test_a_class_running_dry_refuses_and_changes_nothing():
    a = _allocator(4, 8)  # two pages per class: positions 0..7 use each class twice
    z = torch.zeros(1, dtype=torch.int64)
    n = torch.tensor([8 * PAGE])
    first = a.alloc_extend(z, z, n, n, torch.tensor([-1]), 8 * PAGE)
    assert first is not None and a.available_size() == 0
    a.free(first[: 2 * PAGE])  # positions 0, 1: classes 0 and 1 back
    assert a.class_free_counts() == [1, 1, 0, 0] and a.available_size() == 0
    before = a.get_all_free_pages().clone()
    two = torch.tensor([2 * PAGE])
    assert a.alloc_extend(z, z, two, two, torch.tensor([-1]), 2 * PAGE) is not None
    one = torch.tensor([PAGE + 1])  # position 1 again: class 1 is empty now
    assert a.alloc_extend(z, z, one, one, torch.tensor([-1]), PAGE + 1) is None
    assert a.get_all_free_pages().numel() == before.numel() - 2
    with pytest.raises(NotImplementedError, match="request position"):
        a.alloc(PAGE)


def test_a_ranks_narrow_view_over_the_allocators_tables_drops_no_page():
    from ulacache.index_stripe import PageStripe

    gen = torch.Generator().manual_seed(0)
    for P in (2, 4, 8):
        a = _allocator(P, 600)
        rows = []
        for n in torch.randint(1, 3000, (12,), generator=gen).tolist():
            z = torch.zeros(1, dtype=torch.int64)
            s = torch.tensor([n])
            locs = a.alloc_extend(z, z, s, s, torch.tensor([-1]), n)
            rows.append(locs[::PAGE] // PAGE)
            if n % 3 == 0:  # churn: free some, so later draws come from freed pages
                a.free(locs)
                rows.pop()
        W = max(r.numel() for r in rows)
        real = torch.zeros(len(rows), W, dtype=torch.int64)
        for i, r in enumerate(rows):
            real[i, : r.numel()] = r
        lengths = torch.tensor([r.numel() * PAGE - 5 for r in rows])
        for rank in range(P):
            stripe = PageStripe(P, rank, PAGE)
            stripe.check_balanced(real, lengths)
            narrow, full = stripe.view(real, lengths), stripe.view(real, lengths, width=W)
            Wl = -(-W // P)
            assert narrow.table.shape[1] == Wl
            assert torch.equal(narrow.lengths, full.lengths)
            assert torch.equal(narrow.table, full.table[:, :Wl])
            assert (full.table[:, Wl:] == 0).all()  # nothing past the narrow width
            # the formula: the rank's local table is real[:, r::P] // P
            want = torch.where(torch.arange(rank, W, P)[None, :] < (lengths[:, None] + 63) // 64,
                               real[:, rank::P] // P, 0)
            assert torch.equal(narrow.table[:, : want.shape[1]].long(), want)


def test_bad_class_counts_are_refused():
    from ulacache.errors import ConfigError

    for bad in (1, 0, True, 2.0):
        with pytest.raises(ConfigError):
            _allocator(bad, 8)
