"""Decode driver: the reference DSA-MLA model with ulacache managing all latent KV, checked
step by step against a fully resident run of the same model.

:class:`UlaCacheStore` adapts :class:`~ulacache.cache.UlaCache` to the model's
:class:`~ulacache.oracle.refmodel.LatentStore` protocol the way the SGLang seams use it:

- a step (``begin_step``) is one scheduling round (PB-LRU advances);
- the first write of a new position allocates its logical address and GPU slot (``extend``),
  spilling PB-LRU victims to the CPU tier when the GPU pool is full;
- the group's first layer turns top-k positions into addresses and runs the sparse access
  (promotions and swaps); the other layers of the group reuse that plan and only read their own
  rows from the GPU pool at the returned physical rows;
- a prefill chunk whose selections outgrow one round is served in rounds of query spans
  (:mod:`ulacache.prefill`), so a request may be many times longer than the GPU pool.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from ulacache.cache import UlaCache
from ulacache.config import PrefetchConfig, UlaCacheConfig
from ulacache.errors import ShapeError
from ulacache.prefetch import PrefetchEngine
from ulacache.prefill import PrefillStage, round_spans

from .refmodel import (
    AttnShard,
    DecodeOutput,
    DSAMLAModel,
    IndexShard,
    ModelGeometry,
    ResidentStore,
)

logger = logging.getLogger(__name__)


def _read(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table``'s rows at ``rows`` (any shape), zeros where ``rows`` is ``-1``."""
    got = table[rows.clamp(min=0).long()]
    return torch.where((rows >= 0).unsqueeze(-1), got, torch.zeros_like(got))


class UlaCacheStore:
    """A :class:`~ulacache.oracle.refmodel.LatentStore` whose rows live in a :class:`UlaCache`."""

    def __init__(self, cache: UlaCache, stage_rows: int | None = None,
                 prefetch: PrefetchConfig | None = None, draft_hint=None):
        self.cache = cache
        # (group, int64 [n, k] addresses selected) -> int64 [n, k] addresses a draft token
        # would select: the reference model does not speculate, so the draft source is fed
        # this stand-in (any addresses: a prediction is a hint)
        self.draft_hint = draft_hint
        # decode steps prefetch what the sources predict (ulacache.prefetch); a hint only
        cfg = cache.config
        self.prefetch = None if prefetch is None or not prefetch.enabled else PrefetchEngine(
            cache.space, prefetch, cfg.n_groups,
            cfg.row_layout.row_bytes * cfg.layers_per_group, cache.space.device)
        # with a stage, every prefill layer reads its selections from it (the SGLang seam's
        # DP prefill); without, a prefill that outgrows the pool is served in rounds
        self.stage = None if stage_rows is None else PrefillStage(cache.space, stage_rows)
        self.prefilling = False  # set by the driver around prefill calls
        self._prefetch_pending = False  # a step started, its prefetches not issued yet
        # group -> (round, int32 [n, k] rows, None) planned this step, or
        # (None, int64 [n, k] addresses, spans) served in rounds by every layer of the group
        self._plan: dict[int, tuple] = {}
        self.steps = 0
        self.prefill_rounds = 0  # rounds that sub-batched selections started (all layers)

    def begin_step(self) -> None:
        if self.prefetch is not None:
            self.prefetch.begin_step()  # before the round start: every prefetch has landed
        self.cache.space.begin_round()
        # prefetches start once the step's new tokens have their slots (at its first read):
        # a placement's victims would otherwise be the rows just prefetched (admitted cold)
        self._prefetch_pending = self.prefetch is not None
        self._plan.clear()
        self.steps += 1

    def write(self, layer: int, req: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of ``req`` at ``positions`` (int64 ``[n]``): new positions must append."""
        c = self.cache
        if req not in c.requests:
            c.admit(req, 0)  # the reservation grows with extend while capacity is free
        have = c.requests[req].n_tokens
        pos = positions.to(torch.int64)
        new = int((pos >= have).sum())
        if new:
            expect = torch.arange(have, have + new)
            if not torch.equal(pos[pos >= have].sort().values, expect):
                raise ShapeError(f"request {req}: new positions must append at {have}")
            c.extend(req, new)
        c.space.write(layer, c.addresses(req, pos), rows)

    def read_selected(self, layer: int, reqs: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        """``uint8 [n, k, row_bytes]`` rows at top-k positions (zeros at ``-1`` padding).

        When the step's selections fit one round (decode; a prefill chunk whose selections the
        pool holds) the group's anchor plans once and every layer of the group reads that plan.
        Otherwise (a prefill whose selections outgrow the pool) every layer of the group serves
        its queries in rounds (:func:`ulacache.prefill.round_spans`): a fresh round and an
        access per span of queries, reading only that span's rows. With a stage, every prefill
        layer gathers its selections into it instead (:class:`ulacache.prefill.PrefillStage`)
        and changes nothing in the pool."""
        space = self.cache.space
        if self.stage is not None and self.prefilling:
            return _read(self.stage.storage[0], self.stage.stage(layer,
                                                                 self._addresses(reqs, topk)))
        gi = space.layer_to_group[layer]
        group = space.groups[gi]
        entry = self._plan.get(gi)
        if layer == group.layers[0] or entry is None or \
                (entry[2] is None and entry[0] != space.round_serial):
            addrs = self._addresses(reqs, topk)
            # a decode step fits one round (the engine's check_step_capacity); a prefill may not
            spans = round_spans(space, addrs) if self.prefilling else [(0, len(addrs))]
            if len(spans) == 1:  # once per group per step
                engine = None if self.prefilling else self.prefetch
                if engine is not None and self._prefetch_pending:
                    self._prefetch_pending = False
                    engine.round_started()
                if engine is None:
                    entry = (space.round_serial, space.plan(gi, addrs), None)
                else:  # waits for this group's prefetch only; shared_groups: anchor's bytes
                    entry = (space.round_serial, engine.plan(gi, addrs), None)
                    if self.draft_hint is not None:
                        engine.draft_selected(gi, self.draft_hint(gi, addrs))
            else:
                entry = (None, addrs, spans)
            self._plan[gi] = entry
        if entry[2] is not None:
            return self._read_in_rounds(layer, gi, entry[1], entry[2])
        rows = entry[1]
        if rows.shape != topk.shape:
            raise ShapeError(f"layer {layer} reads {tuple(topk.shape)}, its group's plan is "
                             f"{tuple(rows.shape)}")
        if self.prefetch is not None and not self.prefilling:
            self.prefetch.before_load(layer)  # shared_groups: this layer's bytes only
        space.load(layer)  # TP: this layer's bytes of peers' rows into the buffer
        return _read(space.attn_rows(layer), rows)

    def _addresses(self, reqs: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        """``int64 [n, k]`` logical addresses of the top-k positions (``-1`` stays)."""
        addrs = torch.full_like(topk, -1, dtype=torch.int64)
        for r in reqs.unique().tolist():
            m = reqs == r
            addrs[m] = self.cache.addresses(r, topk[m].reshape(-1)).view(-1, topk.shape[1])
        return addrs

    def _read_in_rounds(self, layer: int, gi: int, addrs: torch.Tensor,
                        spans: list[tuple[int, int]]) -> torch.Tensor:
        """This layer's rows of ``addrs`` served span by span, each span in a fresh round (its
        access loads every layer of the group: TP's plan contract)."""
        space = self.cache.space
        out = torch.empty(*addrs.shape, space.attn_rows(layer).shape[1], dtype=torch.uint8)
        for a, b in spans:
            space.begin_round()
            out[a:b] = _read(space.attn_rows(layer), space.access(gi, addrs[a:b]))
        self.prefill_rounds += len(spans)
        return out

    def free(self, req: int) -> None:
        if self.prefetch is not None:
            self.prefetch.fence()  # a release must not race a prefetch of the same rows
        self.cache.free(req)


@dataclass
class EqualityReport:
    """Outcome of :func:`run_equality`; ``mismatches`` lists (step, what) that differed."""

    steps: int = 0
    requests: int = 0
    live_history: int = 0
    gpu_slots: int = 0
    promotions_per_step: list[int] = field(default_factory=list)
    spills_per_step: list[int] = field(default_factory=list)
    # per step, summed over groups: any counter of the cache's stats (TP: peer_fetches,
    # buffer_hits, buffer_evictions, ...)
    moved_per_step: dict[str, list[int]] = field(default_factory=dict)
    # index-key rows the ulacache run's model holds, and the resident run's (TP with
    # shard_indexer: about 1/P of them)
    index_keys_held: int = 0
    index_keys_full: int = 0
    mismatches: list[tuple[int, str]] = field(default_factory=list)
    hit_rate: float = 0.0
    # the prefill phase: rounds its sub-batched selections took (0: every chunk fit one
    # round) and its counters summed over groups (promotions, spills, ...; bytes = rows x
    # row_bytes x layers of the group)
    prefill_rounds: int = 0
    prefill_moved: dict[str, int] = field(default_factory=dict)
    # with a prefill stage: rows it gathered (all layers) and how many came from the CPU tier
    prefill_staged_rows: int = 0
    prefill_staged_from_cpu: int = 0
    # DCP (tp_attention "dcp"): the worst relative deviation of logits and attention outputs
    # from an unsharded resident run (the merge's reassociation; within MERGE_TOLERANCE)
    max_deviation: float = 0.0

    @property
    def identical(self) -> bool:
        return not self.mismatches


MERGE_TOLERANCE = 1e-3
"""Largest ``|a - b| / (1 + |a|)`` a DCP run's logits and attention outputs may differ from
the unsharded resident run's by (partial outputs merged by log-sum-exp reassociate the softmax
sum; float32 noise grows through the layers to ~1e-4 on the tiny geometry); a merge that
skips the rescale moves them by ~1."""


def _compare(step: int, a: DecodeOutput, b: DecodeOutput, out: list[tuple[int, str]]) -> None:
    for name in ("logits", "attn_out", "topk"):
        if not torch.equal(getattr(a, name), getattr(b, name)):
            out.append((step, name))
    if not torch.equal(a.logits.argmax(-1), b.logits.argmax(-1)):
        out.append((step, "chosen tokens"))


def _deviation(step: int, a: torch.Tensor, b: torch.Tensor, name: str,
               report: EqualityReport) -> None:
    """Record how far a DCP run's ``a`` is from the unsharded run's ``b`` (relative); beyond
    :data:`MERGE_TOLERANCE` it is a mismatch."""
    dev = float(((a - b).abs() / (1 + b.abs())).max()) if a.shape == b.shape else math.inf
    report.max_deviation = max(report.max_deviation, dev)
    if not dev <= MERGE_TOLERANCE:
        report.mismatches.append((step, f"{name} vs the unsharded run"))


def _group_sums(stats: dict[str, int]) -> dict[str, int]:
    """Counters of :meth:`UlaCache.stats` summed over groups, by counter name."""
    out: dict[str, int] = {}
    for k, v in stats.items():
        if k.startswith("group"):
            name = k.split("_", 1)[1]
            out[name] = out.get(name, 0) + v
    return out


def run_equality(geom: ModelGeometry, config: UlaCacheConfig, prompt_lens: list[int],
                 n_steps: int, seed: int = 0, peers=None,
                 prefill_chunk: int | None = None,
                 prefill_stage: int | None = None,
                 prefetch: PrefetchConfig | None = None, draft_hint=None,
                 index_page: int = 1) -> EqualityReport:
    """Prefill ``len(prompt_lens)`` requests, decode ``n_steps`` greedy steps as one batch, with
    ulacache and fully resident; compare attention outputs, logits, top-k and chosen tokens.

    ``prefill_chunk``: prefill each prompt in chunks of at most this many tokens (both runs,
    so both compute the same batches), as an engine's chunked prefill does; a chunk whose
    selections outgrow the GPU pool is served in rounds (:mod:`ulacache.prefill`), or with
    ``prefill_stage`` (rows), every prefill layer through a stage of that many rows.
    ``prefetch``: decode steps prefetch what its sources predict (outputs must not change;
    ``report.moved_per_step["prefetches"]`` counts the rows); ``draft_hint(group, addrs)``:
    what a draft token's query would select, fed to the ``draft`` source (the model does not
    speculate; see :class:`UlaCacheStore`). ``index_page``: TP with ``shard_indexer``, each
    rank keeps the index keys of the positions in its pages of this many tokens (page ``p`` of
    a request on rank ``p mod P``; 1: by token).

    Tokens are chosen by the resident run (greedy) and fed to both, so a divergence is reported
    at the step where it happens instead of cascading.

    TP mode (``config.tp_size > 1``): every rank of ``peers`` calls this with the same
    arguments; each runs the model over its rank of the striped cache (own rows in place,
    peers' rows through its buffer; the sharded indexer when ``config.shard_indexer``) and
    compares against its own fully resident run. With ``config.tp_attention`` ``"dcp"`` each
    rank attends only its own rows and the ranks merge partial outputs by log-sum-exp
    (:class:`~ulacache.oracle.refmodel.AttnShard`); the resident run merges the same way, so
    the comparison stays bitwise, and an unsharded resident run fed the same tokens bounds
    the merge's own effect: ``report.max_deviation`` (logits and attention outputs), a
    mismatch beyond :data:`MERGE_TOLERANCE`.
    """
    if config.row_layout.row_bytes != geom.row_bytes or config.n_layers != geom.n_layers:
        raise ShapeError("config rows/layers must match the model geometry")
    gen = torch.Generator().manual_seed(seed)
    ref_model, ula_model = DSAMLAModel(geom, seed), DSAMLAModel(geom, seed)
    ref_store = ResidentStore(geom.row_bytes)
    ula_store = UlaCacheStore(UlaCache(config, peers=peers,
                                       layer_groups=geom.selection_groups()), prefill_stage,
                                   prefetch, draft_hint)
    if config.tp_size > 1 and config.shard_indexer:
        # each rank keeps 1/P of the index keys, scores them, merges the candidates
        ula_model.index_shard = IndexShard(peers.rank, peers.size, peers.all_gather,
                                           page=index_page)
    plain = None
    if config.tp_size > 1 and config.tp_attention == "dcp":
        # each rank attends its own rows and the ranks merge partial outputs: the resident
        # run does the same (so ulacache's rows are compared bitwise), and a third, unsharded
        # resident run bounds what the merge changes (report.max_deviation)
        ula_model.attn_shard = ref_model.attn_shard = AttnShard(peers.rank, peers.size,
                                                                peers.all_gather)
        plain = (DSAMLAModel(geom, seed), ResidentStore(geom.row_bytes))
    report = EqualityReport(requests=len(prompt_lens), gpu_slots=config.gpu_slots)
    reqs = list(range(len(prompt_lens)))
    tokens = []
    cache = ula_store.cache
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ShapeError(f"prefill_chunk must be a positive token count, got {prefill_chunk}")
    before = _group_sums(cache.stats())
    for r, n in zip(reqs, prompt_lens):
        prompt = torch.randint(0, geom.vocab, (n,), generator=gen)
        for i, chunk in enumerate(prompt.split(prefill_chunk or max(1, n))):
            a = ref_model.prefill(r, chunk, ref_store)
            ula_store.prefilling = True
            try:
                b = ula_model.prefill(r, chunk, ula_store)
            finally:
                ula_store.prefilling = False
            if not torch.equal(a, b):
                report.mismatches.append((-1, f"prefill logits of request {r}, chunk {i}"))
            if plain is not None:
                _deviation(-1, a, plain[0].prefill(r, chunk, plain[1]),
                           f"prefill logits of request {r}, chunk {i}", report)
        tokens.append(int(a.argmax()))
    after = _group_sums(cache.stats())
    report.prefill_moved = {k: after[k] - before.get(k, 0) for k in after}
    report.prefill_rounds = ula_store.prefill_rounds
    if ula_store.stage is not None:
        report.prefill_staged_rows = ula_store.stage.staged_rows
        report.prefill_staged_from_cpu = ula_store.stage.staged_from_cpu
    for step in range(n_steps):
        before = _group_sums(cache.stats())
        tok = torch.tensor(tokens)
        a = ref_model.decode_step(reqs, tok, ref_store)
        b = ula_model.decode_step(reqs, tok, ula_store)
        _compare(step, a, b, report.mismatches)
        if plain is not None:
            c = plain[0].decode_step(reqs, tok, plain[1])
            _deviation(step, a.logits, c.logits, "logits", report)
            _deviation(step, a.attn_out, c.attn_out, "attn_out", report)
        after = _group_sums(cache.stats())
        report.promotions_per_step.append(after["promotions"] - before["promotions"])
        report.spills_per_step.append(after["spills"] - before["spills"])
        for name, v in after.items():
            report.moved_per_step.setdefault(name, [0] * n_steps)[step] += v - before[name]
        tokens = a.logits.argmax(-1).tolist()
        cache.check_integrity()
    report.steps = n_steps
    for model, field_name in ((ula_model, "index_keys_held"), (ref_model, "index_keys_full")):
        setattr(report, field_name, sum(len(model.index_keys(r, g)) for r in reqs
                                        for g in range(geom.n_groups)))
    report.live_history = sum(r.n_tokens for r in cache.requests.values())
    st = cache.stats()
    acc = sum(v for k, v in st.items() if k.endswith("_accesses"))
    report.hit_rate = sum(v for k, v in st.items() if k.endswith("_gpu_hits")) / max(1, acc)
    logger.info("equality run: %d requests, %d steps, live history %d rows vs %d GPU slots, "
                "%d promotions, %d spills, mismatches %d", report.requests, n_steps,
                report.live_history, config.gpu_slots, sum(report.promotions_per_step),
                sum(report.spills_per_step), len(report.mismatches))
    return report
