"""What both striped modes share: one address space striped over the ``P`` ranks of a
tensor-parallel group, address ``t`` on rank ``t mod P`` at local position ``t // P`` (design
§2), each rank's share the DP core over its ``ceil(n / P)`` positions.

The modes differ in how a rank attends its peers' rows: :class:`ulacache.tp.TPAddressSpace`
copies them into a local buffer; :class:`ulacache.stripe.StripeAddressSpace` never reads them
(SGLang's decode context parallelism merges the ranks' partial outputs). Both build on
:class:`StripedSpace`: address splitting, the ranks' shared verdicts, reads from the owners,
liveness of a rank's share, and the calls that only touch a rank's own stripe.
"""

from __future__ import annotations

import math

import torch

from .address import local_position, owner_rank
from .errors import AddressError, CapacityExhausted, ConfigError, ShapeError, UlaCacheError
from .group import COUNTERS, add_counts
from .health import CounterMonitor

_ERRORS = (ShapeError, AddressError, CapacityExhausted, UlaCacheError)  # verdict order


def owned_counts(seq_lens: list[int], P: int) -> list[int]:
    """Tokens of sequences of these lengths each of ``P`` ranks owns: position ``p`` lives on
    rank ``p % P`` (SGLang's paged allocator keeps ``loc % 64 == pos % 64`` and ``P | 64``, so
    owners follow positions)."""
    return [sum(max(0, (n - r + P - 1) // P) for n in seq_lens) for r in range(P)]


STEP_SHARE_SIGMAS = 6
"""Standard deviations above a rank's balanced share of a step that its own pool holds."""


def step_share_bound(selections: int, P: int) -> int:
    """Own GPU rows a rank needs for one decode step of ``selections`` selected rows (every
    request's top-k and new token) striped over ``P`` ranks: the balanced share ``ceil(n / P)``
    plus :data:`STEP_SHARE_SIGMAS` standard deviations of a rank's share, at most ``n``.

    A selected position lands on rank ``p mod P``; with the positions' residues independent
    and uniform a rank's share of a step is binomial, ``n / P`` on average with variance
    ``n (1 / P)(1 - 1 / P)`` (runs of consecutive positions, the usual shape of a selection,
    spread more evenly than that). At GLM-5's 64 requests x 2,049 on 8 ranks the share is
    16,392 +- 120: a pool of exactly the balanced share overflows on most steps (the overflow
    is served as padding: keys silently missing from attention); six deviations (+719 rows,
    4.4%) make an overflow a ~1e-9 event per rank and step."""
    if selections <= 0:
        return 0
    sd = math.sqrt(selections * (1 / P) * (1 - 1 / P))
    return min(selections, -(-selections // P) + math.ceil(STEP_SHARE_SIGMAS * sd))


def agree_verdict(peers, device: torch.device, check) -> None:
    """Run a host-side ``check`` on every rank of ``peers`` and raise the same error type on
    every rank if any rank failed, so that no rank mutates (or blocks in a collective) while
    another has stopped. Collective. The verdict: the most basic failure (bad shape, then bad
    address, then no capacity) of the lowest rank that found it."""
    err: Exception | None = None
    try:
        check()
    except _ERRORS as e:
        err = e
    code = 0 if err is None else 1 + next(i for i, t in enumerate(_ERRORS)
                                          if isinstance(err, t))
    codes = peers.all_gather(torch.tensor([code], dtype=torch.int64,
                                          device=device)).reshape(-1).tolist()
    failed = [(c, r) for r, c in enumerate(codes) if c]
    if not failed:
        return
    kind, first = min(failed)
    if first == peers.rank:
        raise type(err)(f"rank {peers.rank}: {err}") from err
    mine = f"; this rank found: {err}" if err is not None else ""
    raise _ERRORS[kind - 1](f"rank {first} refused this call ({_ERRORS[kind - 1].__name__});"
                            f" no rank changed anything{mine}")


class StripedSpace:
    """The shared part of a rank's share of a striped address space ``[0, n_logical)``.

    A subclass sets, before using these methods: ``config``, ``peers``, ``P``, ``rank``,
    ``device``, ``n_logical``, ``n_local`` and ``local`` (the DP core over this rank's
    positions), ``groups`` and ``layer_to_group`` (``local``'s).
    """

    # -- lookup ---------------------------------------------------------------------------
    @property
    def validate(self) -> bool:
        return self.config.validate

    @property
    def stream(self):
        return self.local.stream

    def set_stream(self, stream) -> None:
        """Issue every core mutation on ``stream`` (the engine's forward stream)."""
        self.local.set_stream(stream)

    @property
    def health(self) -> CounterMonitor:
        """The DP counters' monitor of this rank's share."""
        return self.local.health

    @property
    def round_serial(self) -> int:
        return self.local.round_serial

    def _group_of(self, layer: int) -> int:
        self.local.group_of(layer)  # type and range checks with the DP wording
        return self.layer_to_group[layer]

    def _split(self, addrs: torch.Tensor, name: str):
        """(flat global addresses, in range, this rank's, its local positions or -1)."""
        flat = self.local.checked_addresses(addrs, name).reshape(-1).to(torch.int64)
        inrange = (flat >= 0) & (flat < self.n_logical)
        mine = inrange & (owner_rank(flat, self.P) == self.rank)
        return flat, inrange, mine, torch.where(mine, local_position(flat, self.P), -1)

    def _check_range(self, flat: torch.Tensor, inrange: torch.Tensor, what: str) -> None:
        if bool(((flat != -1) & ~inrange).any()):
            raise AddressError(f"{what}: addrs out of range [0, {self.n_logical}) (or negative "
                               "other than the -1 padding)")

    def _count_out_of_range(self, groups, flat: torch.Tensor, inrange: torch.Tensor) -> None:
        """Validate off: global addresses out of range are masked here (their local position is
        -1, which the share's groups skip as padding), so count them as ``invalid`` here."""
        bad = {"invalid": ((flat != -1) & ~inrange).sum()}
        for g in groups:
            add_counts(g.counters, COUNTERS, bad)

    def _agree(self, check) -> None:
        agree_verdict(self.peers, self.device, check)

    def verdict(self, check) -> None:
        """Run a host-side ``check`` on every rank and raise the same error type on every rank
        if any rank's failed (:func:`agree_verdict`). Collective."""
        self._agree(check)

    def _check_step_share(self, requests: int, steps: int, top_k: int) -> None:
        """Raise :class:`ConfigError` unless this rank's own pool holds its share of one
        decode step's selections with the margin :func:`step_share_bound` gives (a step whose
        selections fall more unevenly still would overflow: counted as ``access_overflow``,
        served as padding)."""
        worst = requests * steps * (top_k + 1)
        need = step_share_bound(worst, self.P)
        if self.config.gpu_slots < need:
            raise ConfigError(
                f"each rank's GPU pool ({self.config.gpu_slots} rows) must hold its share of "
                f"one step's selections, ({requests} requests x {steps} tokens) x (top-k "
                f"{top_k} + 1) = {worst} over {self.P} ranks: {need} rows (the balanced "
                f"{-(-worst // self.P)} and a margin for uneven steps); give the KV cache "
                "more memory, lower cpu_ratio or --max-running-requests")

    def agree(self, ok: bool) -> bool:
        """Collective (host-side): whether ``ok`` holds on every rank, e.g. that the engine's
        logical allocation succeeded everywhere, so that every rank takes the same branch and
        the lockstep schedulers stay in step (:meth:`ulacache.ipc.Peers.agree`)."""
        return self.peers.agree(ok)

    # -- data from the owners (tests and tools) ---------------------------------------------
    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor:
        """``uint8 [n, row_bytes]`` rows of live addresses from their owners, wherever they
        live (GPU or CPU tier); zeros for ``-1``. Collective (tests and tools: ``P x n`` rows
        all-gathered)."""
        gi = self._group_of(layer)
        flat, inrange, mine, lpos = self._split(addrs, "read: addrs")
        g = self.local.groups[gi]

        def check():
            self._check_range(flat, inrange, "read")
            g.check_read(lpos)  # this rank's addresses live
        # an owner that cannot serve an address must not leave its peers in the all-gather
        self._agree(check)
        with self.stream.scope():
            own = g.read(layer, lpos)
        own = torch.where(mine.unsqueeze(1), own, torch.zeros((), dtype=torch.uint8))
        everyone = self.peers.all_gather(own.contiguous())
        owner = torch.where(inrange, owner_rank(flat, self.P), 0)
        got = everyone[owner, torch.arange(flat.numel(), device=self.device)]
        return torch.where(inrange.unsqueeze(1), got, torch.zeros((), dtype=torch.uint8))

    # -- a rank's own stripe only ------------------------------------------------------------
    def prefetch(self, group: int, addrs: torch.Tensor, budget: torch.Tensor) -> None:
        """This rank's share of a prefetch (not collective): its own rows among the predicted
        global ``addrs`` are promoted into its own pool
        (:meth:`ulacache.space.AddressSpace.prefetch`; ``budget`` is this rank's). Peers'
        rows are their owners' (the buffered mode's gates serve them at the plan)."""
        _, _, _, lpos = self._split(addrs, "prefetch: addrs")
        self.local.prefetch(group, lpos, budget)

    def use_prefetch_tables(self) -> None:
        """The share's separate prefetch scratch (:meth:`AddressSpace.use_prefetch_tables`)."""
        self.local.use_prefetch_tables()

    def local_live(self, live: torch.Tensor) -> torch.Tensor:
        """``bool [n_local]``: this rank's share of a global live mask."""
        live = live.to(self.device)
        out = torch.zeros(self.n_local, dtype=torch.bool, device=self.device)
        addr = torch.arange(self.rank, self.n_logical, self.P, device=self.device)
        out[local_position(addr, self.P)] = live[addr]
        return out

    def check_placed(self, live: torch.Tensor) -> None:
        """Every live address of this rank's share has a row in every group."""
        self.local.check_placed(self.local_live(live))
