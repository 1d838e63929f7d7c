"""Look-ahead prefetch: predicted rows move CPU -> GPU on a side stream, off the critical path.

Without it every CPU-resident row a step selects is copied between that layer's indexer and
its attention. The engine here promotes rows a *prediction* names before the access that
needs them (OasisKV, arXiv 2608.08097, §3; UlaCache, arXiv 2610.29820, §6.3: a prefetch
stream ordered by events):

- **Mechanism** (:meth:`ulacache.space.AddressSpace.prefetch`, the group's four fused launches
  in prefetch mode): per prediction, resident -> nothing; missing -> promoted in rank order
  while the group's per-step budget lasts, into the next victim in PB-LRU order (never a row
  pinned this round), admitted at the lowest recency, so a wrong guess is the next victim.
  The access still resolves every selection: outputs never depend on prefetching.
- **Ordering** (:class:`PrefetchEngine`): prefetches run on their own stream, one event per
  group. The prefetch stream first waits for the caller's stream (the prediction and all core
  work before it are ready); a group's access waits only for *its own* group's event
  (layer-local), never for other groups' prefetches. Prefetches start after the step's
  new tokens are placed (a placement would evict the cold prefetched rows). A step start
  waits for every
  outstanding prefetch (the round start advances every group's policy) and refills the
  budgets: device work only, no host sync, the same launches every step (capturable).
- **Policy** (:class:`PredictionSource`): who predicts what. ``previous_layer``: group
  ``g``'s selection of this step predicts group ``g + 1``'s (known one layer early).
  ``draft``: the selection a draft token's query made predicts the same group's next step
  (speculative decoding's verify batch); the engine takes it through :meth:`draft_selected`.
  Each group gets one prefetch call per step with every source's prediction (a call's
  victims are distinct; a second call could evict the first one's cold rows).

Scratch: prefetches dedup with their own claim table and fused scratch
(:meth:`AddressSpace.use_prefetch_tables`: 8 B per logical address), since they run while
accesses of other groups use the shared ones.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from .config import PrefetchConfig
from .errors import ConfigError, ShapeError

logger = logging.getLogger(__name__)

__all__ = ["SOURCES", "PredictionSource", "PreviousLayer", "DraftTokens", "SharedGroups",
           "PrefetchEngine", "rank_order"]


def rank_order(addrs: torch.Tensor) -> torch.Tensor:
    """``int [bs, k]`` selections as one prediction list, most likely first: rank 0 of every
    request, then rank 1, ... (a cap then shares the budget across requests instead of
    spending it on the first request's tail). ``[bs * k]``, ``-1`` padding kept."""
    return addrs.t().reshape(-1)


class PredictionSource(ABC):
    """One prediction source: from what a step has revealed so far, predictions for a group's
    next access as ``int [n]`` addresses in rank order (``-1`` padding). Pure: it reads and
    changes no core state. The engine asks every source for a group once, just before it
    issues that group's one prefetch of the step (:meth:`PrefetchEngine.ready_groups`)."""

    name: str
    defers_layers = False
    """Whether this source moves a shared group's non-anchor layers' bytes off the access (the
    engine's :meth:`PrefetchEngine.plan` then runs a deferred access and its replays)."""
    after_previous_group = False
    """Whether this source's prediction for group ``g`` needs group ``g - 1``'s selection of
    this step (then the engine issues group ``g``'s prefetch once that selection is known)."""

    def __init__(self, n_groups: int):
        self.n_groups = n_groups

    def selected(self, group: int, addrs: torch.Tensor) -> None:
        """``group``'s selection of this step (``int [bs, k]``) is known."""
        return None

    def drafted(self, group: int, addrs: torch.Tensor) -> None:
        """A draft token's selection at ``group`` (``int [bs, k]``) is known."""
        return None

    @abstractmethod
    def predict(self, group: int) -> torch.Tensor | None:
        """This source's prediction for ``group``'s access of this step, or ``None``."""

    def new_step(self) -> None:
        """A step starts (selections of the last one become history)."""
        return None


class PreviousLayer(PredictionSource):
    """Group ``g``'s selection of this step predicts group ``g + 1``'s: it is known while
    group ``g`` attends, one layer before it is needed."""

    name = "previous_layer"
    after_previous_group = True

    def __init__(self, n_groups: int):
        super().__init__(n_groups)
        self.last: dict[int, torch.Tensor] = {}

    def selected(self, group: int, addrs: torch.Tensor) -> None:
        if group + 1 < self.n_groups:  # held only until the next group's prediction is made
            self.last[group] = addrs

    def predict(self, group: int) -> torch.Tensor | None:
        prev = self.last.pop(group - 1, None)  # nothing outlives the step (rehearse checks)
        return None if prev is None else rank_order(prev)

    def new_step(self) -> None:
        self.last.clear()


class DraftTokens(PredictionSource):
    """The selection a draft token's query made at group ``g`` (OasisKV's look-ahead: the draft
    token's query at the next position) predicts group ``g``'s next step; an accepted draft's
    selection is the next step's exactly.

    The last draft of each group lives in a fixed buffer (``int64 [rows, k]``, ``-1`` padded),
    written by :meth:`drafted` and read by :meth:`predict`, so a CUDA graph that captured
    either call replays it on the same memory. :meth:`predict` for a step must come before
    that step's :meth:`drafted` of the same group (the engine's order: a group's prefetch is
    issued before its access, a draft is known after it). ``shape``: ``(rows, k)`` to allocate
    the buffers up front (what a graph capture needs); else each is made at its first draft
    (and remade, outside a capture, for a larger one)."""

    name = "draft"

    def __init__(self, n_groups: int, shape: tuple[int, int] | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__(n_groups)
        self.buffers: list[torch.Tensor | None] = [
            None if shape is None else torch.full(shape, -1, dtype=torch.int64, device=device)
            for _ in range(n_groups)]

    def drafted(self, group: int, addrs: torch.Tensor) -> None:
        buf = self.buffers[group]
        n, k = addrs.shape
        if buf is None or n > buf.shape[0] or k != buf.shape[1]:
            buf = self.buffers[group] = torch.full((n, k), -1, dtype=torch.int64,
                                                   device=addrs.device)
        buf[n:].fill_(-1)
        buf[:n].copy_(addrs)

    def predict(self, group: int) -> torch.Tensor | None:
        buf = self.buffers[group]
        return None if buf is None else rank_order(buf)


class SharedGroups(PredictionSource):
    """Models that share top-k across layers (GLM-5.2-style: one indexer for a group of
    layers): the anchor layer's plan is exact for every layer of its group, so the access moves
    only the anchor's bytes and the other layers' bytes of the same moves go on the prefetch
    stream while the anchor attends (UlaCache, arXiv 2610.29820, §6.3); layer ``l`` waits only
    for its own replay (:meth:`PrefetchEngine.before_load`). It predicts nothing new: without
    shared groups (DeepSeek-V3.2, GLM-5) it has nothing to move, and the engine refuses it."""

    name = "shared_groups"
    defers_layers = True

    def predict(self, group: int) -> torch.Tensor | None:
        return None


SOURCES: dict[str, type[PredictionSource]] = {"previous_layer": PreviousLayer,
                                              "draft": DraftTokens,
                                              "shared_groups": SharedGroups}
"""Source names (``prefetch.sources``) -> classes; ``config.PrefetchSource`` lists the same."""


class PrefetchEngine:
    """Prefetches for one address space (:class:`ulacache.core.Core`), on a side stream.

    Parameters
    ----------
    core : the address space (DP or one TP rank; TP prefetches each rank's own rows).
    config : :class:`~ulacache.config.PrefetchConfig` (sources, cap, link budget).
    n_groups, group_row_bytes : selection groups, and bytes one promoted row moves (every
        layer of its group), for the link budget.
    device : the core's device.
    forward_only : issue every group's prefetch inside the forward, once the previous group's
        selection is known (group 0 gets none), never at the step start: what a CUDA graph of
        the forward captures whole (the SGLang seam). Default: sources that need nothing from
        this step (``draft``) prefetch at the step start.
    draft_shape : ``(rows, k)`` of the ``draft`` source's buffers, allocated up front (a
        capture needs them to exist); default: at the first draft.

    The engine's calls, in a step's order: :meth:`begin_step` before the round start,
    :meth:`round_started` after it and the step's placements; per group, :meth:`plan` (its
    access: :meth:`before_access`, the core's plan, :meth:`selected`), and per layer
    :meth:`before_load` before the layer reads its rows; :meth:`draft_selected` for a draft
    token's selection (used next step); :meth:`fence` before a release. ``stream_log`` (CPU,
    for tests) records ``(op, group)`` in issue order (``("wait_layer", layer)`` for a
    layer's join).

    ``shared_groups`` (DP only): each shared group's access moves its anchor layer's bytes;
    layer ``l >= 1``'s bytes of the same moves are replayed on the prefetch stream, each with
    its own event, which layer ``l``'s :meth:`before_load` waits for. On CPU (no streams) a
    layer's replay runs at that wait, the latest moment the protocol allows, so a reader that
    skipped its wait reads stale bytes (the tests' equality checks see it).
    """

    def __init__(self, core, config: PrefetchConfig, n_groups: int, group_row_bytes: int,
                 device: torch.device, forward_only: bool = False,
                 draft_shape: tuple[int, int] | None = None):
        if not config.enabled:
            raise ConfigError("PrefetchEngine needs at least one prefetch source")
        unknown = [s for s in config.sources if s not in SOURCES]
        if unknown:
            raise ConfigError(f"unknown prefetch source(s) {unknown}; legal: {sorted(SOURCES)}")
        self.core, self.config, self.n_groups, self.device = core, config, n_groups, device
        self.sources = [DraftTokens(n_groups, draft_shape, device) if name == "draft" else
                        SOURCES[name](n_groups) for name in config.sources]
        # forward_only: every prefetch is issued inside the forward (a CUDA graph captures it)
        self.forward_only = forward_only
        self._waits_for_previous = forward_only or any(s.after_previous_group
                                                       for s in self.sources)
        self.cap = config.rows_per_group(group_row_bytes, n_groups)
        if self.cap == 0:
            logger.warning("prefetch: the link budget (%s GB/s x %s ms) is less than one row per "
                           "group per step: nothing will be prefetched", config.link_gbps,
                           config.step_ms)
        core.use_prefetch_tables()
        # budgets[g]: rows group g may still prefetch this step (0-dim views are the calls')
        self.budgets = torch.zeros(n_groups, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.events = [torch.cuda.Event() for _ in range(n_groups)] if cuda else None
        # shared_groups: layer -> (group, index in group); per shared group one event per
        # non-anchor layer; _replays[g] = the first layer index of g not yet joined
        self._layers = [len(g.layers) for g in core.groups]
        self._layer_of = {layer: (gi, li) for gi, g in enumerate(core.groups)
                          for li, layer in enumerate(g.layers)}
        self.deferring = any(s.defers_layers for s in self.sources)
        if self.deferring:
            if core.config.tp_size > 1:
                raise ConfigError("prefetch source 'shared_groups' needs DP mode: in TP mode "
                                  "peers read every layer of a promoted row right after the "
                                  "plan; legal in TP: previous_layer, draft")
            core.use_move_list()  # refuses a model with no shared group
        self.layer_events = [[torch.cuda.Event() for _ in range(n - 1)] for n in self._layers] \
            if cuda and self.deferring else None
        self._replays: dict[int, int] = {}
        # group -> its prefetch's predictions, issued and not yet waited for: the wait joins
        # the prefetch stream back (inside a capture too) and only then is the tensor let go
        # (the prefetch stream read it; no record_stream, which a capture does not honour)
        self._pending: dict[int, torch.Tensor] = {}
        self.stream_log: list[tuple[str, int]] | None = None if cuda else []

    # -- a step ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before the round start (which advances every group's policy): every prefetch issued
        so far has finished for the caller's stream (:meth:`fence`), budgets are refilled to
        the cap, and the sources' last-step selections become history."""
        self.fence()
        self.budgets.fill_(self.cap)
        for src in self.sources:
            src.new_step()

    def round_started(self) -> None:
        """After the round start *and the step's placements* (the new tokens' slots): groups
        whose predictions are complete already (no source waits for the previous group's
        selection; group 0 always) get their prefetch now. Not before placing: prefetched rows
        enter cold, so a placement's victims would be exactly them (measured on the bundled
        trace with an exact predictor: critical-path misses x0.41 and H2D x1.24 prefetching
        before placement, x0.18 and x1.00 after)."""
        if self.forward_only:
            return  # group g's prefetch is issued at group g - 1's selection; group 0 has none
        for g in range(self.n_groups):
            if g == 0 or not self._waits_for_previous:
                self._issue_predicted(g)

    def fence(self) -> None:
        """The caller's stream waits for every prefetch and replay issued and not yet waited
        for (before a round start, which advances every group's policy, and before a release).
        Only those: an event last recorded inside a CUDA-graph capture cannot be waited for
        outside it, and a captured prefetch is joined inside its graph by its group's access
        (a replay by its layer's load)."""
        self._log("fence", -1)
        self._join_replays()
        for g in sorted(self._pending):
            self._wait(g)

    def plan(self, group: int, addrs: torch.Tensor, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """A group's access of this step with prefetch on: :meth:`before_access`, the core's
        plan, :meth:`selected`; returns the plan's rows (``int32 [bs, k]``). With
        ``shared_groups``, a shared group's access moves only its anchor layer's bytes and the
        other layers' are replayed on the prefetch stream (a call larger than the core's call
        capacity, a prefill's, moves every layer at once, as without)."""
        self.before_access(group)
        if self.deferring and self._layers[group] > 1 and \
                addrs.numel() <= self.core.config.call_capacity:
            self._join_replays()  # one move list: every earlier replay has read it
            rows = self.core.access_deferred(group, addrs, out)
            self._replay(group)
        else:
            rows = self.core.plan(group, addrs, out)
        self.selected(group, addrs)
        return rows

    def before_load(self, layer: int) -> None:
        """Layer-local wait before ``layer`` (a core layer id) reads its rows: its own bytes of
        its group's deferred access, if any are outstanding, and nothing else."""
        if layer not in self._layer_of:
            raise ShapeError(f"before_load: layer {layer} is in no selection group")
        g, li = self._layer_of[layer]
        first = self._replays.get(g)
        if first is not None and li >= first:
            self._log("wait_layer", layer)
            self._join_layers(g, li)

    def _replay(self, group: int) -> None:
        """Issue the non-anchor layers' bytes of ``group``'s deferred access on the prefetch
        stream, after the access (CPU: at each layer's wait)."""
        self._log("replay", group)
        self._replays[group] = 1
        if self.stream is None:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for li in range(1, self._layers[group]):
                self.core.replay_layer(group, li)
                self.layer_events[group][li - 1].record(self.stream)

    def _join_layers(self, group: int, last: int) -> None:
        """The caller's stream has layers ``[first, last]`` of ``group``'s replay."""
        first = self._replays[group]
        if self.stream is None:
            for li in range(first, last + 1):
                self.core.replay_layer(group, li)
        else:
            torch.cuda.current_stream(self.device).wait_event(self.layer_events[group][last - 1])
        if last + 1 < self._layers[group]:
            self._replays[group] = last + 1
        else:
            del self._replays[group]

    def _join_replays(self) -> None:
        for g in sorted(self._replays):
            self._join_layers(g, self._layers[g] - 1)

    def before_access(self, group: int) -> None:
        """Layer-local wait: the caller's stream (the access's) waits for ``group``'s
        prefetch of this step, if one was issued, and for nothing else."""
        if group in self._pending:
            self._log("wait", group)
            self._wait(group)

    def _wait(self, group: int) -> None:
        if self.events is not None:
            torch.cuda.current_stream(self.device).wait_event(self.events[group])
        del self._pending[group]

    def selected(self, group: int, addrs: torch.Tensor) -> None:
        """``group``'s selection of this step (``int [bs, k]`` addresses) is known; if a
        source waited for it, group ``group + 1``'s prefetch is issued now."""
        addrs = self._check(addrs)
        for src in self.sources:
            src.selected(group, addrs)
        if self._waits_for_previous and group + 1 < self.n_groups:
            self._issue_predicted(group + 1)

    def draft_selected(self, group: int, addrs: torch.Tensor) -> None:
        """A draft token's selection at ``group`` (``int [bs, k]``) is known: the ``draft``
        source predicts the group's next step from it."""
        addrs = self._check(addrs)
        for src in self.sources:
            src.drafted(group, addrs)

    def _issue_predicted(self, group: int) -> None:
        """One prefetch call for ``group`` with every source's prediction, in source order
        (``prefetch.sources``): one call per group per step, so its victims never include
        rows an earlier prefetch of the step admitted."""
        preds = [p for p in (src.predict(group) for src in self.sources) if p is not None]
        if preds:
            self.issue(group, preds[0] if len(preds) == 1 else torch.cat(preds))

    def issue(self, group: int, predicted: torch.Tensor) -> None:
        """Prefetch ``predicted`` (``int [n]``, rank order) into ``group`` on the prefetch
        stream, after everything already issued on the caller's stream; record the group's
        event."""
        if not 0 <= group < self.n_groups:
            raise ShapeError(f"prefetch: group {group} not in [0, {self.n_groups})")
        if group in self._pending:  # one call per group per step: the first is joined first
            self._wait(group)
        self._log("prefetch", group)
        self._pending[group] = predicted
        if self.stream is None:
            self.core.prefetch(group, predicted, self.budgets[group])
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.core.prefetch(group, predicted, self.budgets[group])
            self.events[group].record(self.stream)

    # -- helpers ---------------------------------------------------------------------------
    def _check(self, addrs: torch.Tensor) -> torch.Tensor:
        if not isinstance(addrs, torch.Tensor) or addrs.dim() != 2:
            raise ShapeError("prefetch: selections must be an int tensor [bs, k]")
        return addrs

    def _log(self, op: str, group: int) -> None:
        if self.stream_log is not None:
            self.stream_log.append((op, group))
