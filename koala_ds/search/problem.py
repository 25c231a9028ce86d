"""A search problem: one configuration (profile, p, m, v, backward, memory limit) and the
machinery to evaluate candidates on the simulator. A candidate is one *order* per rank: the
rank's sequence of actions, held as BTT choices (docs/search.md, "The encoding"); the decoder
turns an order into the simulator's *codes* (one integer per action).

`backward` is split (I + W), full (B) or auto: the search then explores both kinds, one
`PlacementProblem` per (placement, kind), and answers with the faster schedule (`backward_kinds`
says which kinds auto searches)."""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..core.ir import KoalaError, Placement, Schedule, size_error
from ..sim import CostProfile, Simulator, lower_bound
from ..sim.simulator import Stall
from ..sim.profile import MAX_PROFILE_NUMBER, ProfileError
from .bound import jackson_bound
from .encoding import B_K, F_K, I_K, W_K, OrderDecoder, encode

log = logging.getLogger(__name__)

INFEASIBLE = float("inf")


class SearchError(KoalaError):
    """Bad input to the search (configuration, memory limit, budgets).

    `parameters` names the arguments (of `SearchProblem`, `search`, ...) the message asks to
    change, the one at fault first (`parameter`); the message writes each in backquotes, as
    `memory_limit`, and `worded` spells them a front end's way (the CLI: as its flags)."""

    def __init__(self, message: str, *parameters: str):
        super().__init__(message)
        self.parameters = parameters

    def __reduce__(self):
        return type(self), (str(self), *self.parameters)

    @property
    def parameter(self) -> str | None:
        """The parameter at fault (None: not one of the search's parameters)."""
        return self.parameters[0] if self.parameters else None

    def worded(self, names: Mapping[str, str]) -> str:
        """The message with each parameter written as `names` spells it (as is when absent)."""
        text = str(self)
        for name in self.parameters:
            if name in names:
                text = text.replace(f"`{name}`", names[name])
        return text


def mb_up(mb: float) -> str:
    """`mb` rounded up to 0.01 MB: a limit that large passes where `mb` is needed."""
    return f"{math.ceil(mb * 100 - 1e-6) / 100:.12g}"


class MemoryTooSmall(SearchError):
    """A rank's memory limit is below what any schedule needs there (`need_mb`, one activation of
    each of its stages): the message, and the figures for a front end that words the limit
    otherwise (koala search with a per-layer profile: the whole memory of a rank)."""

    def __init__(self, message: str, rank: int, need_mb: float, limit_mb: float):
        super().__init__(message, "memory_limit")
        self.rank, self.need_mb, self.limit_mb = rank, need_mb, limit_mb

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.need_mb, self.limit_mb)


def relative_gap(value: float, bound: float) -> float:
    """value / bound - 1, with float noise at the bound shown as 0 (never "-0.00%")."""
    if bound <= 0:
        return 0.0
    g = value / bound - 1
    return 0.0 if abs(g) < 1e-9 else g


def one_f_one_b_peak(profile: CostProfile, p: int, m: int, v: int = 1) -> float:
    """Peak activation memory (MB, the worst rank) of 1F1B for this model on p ranks.

    With v > 1 the model is the same (p * v virtual stages) but 1F1B has one stage per rank:
    rank r holds the v consecutive virtual stages r*v .. r*v+v-1 as one stage, and rank r keeps
    min(p - r, m) microbatches in flight, as 1F1B does."""
    S = p * v
    if profile.num_stages != S:
        raise _stages_error(profile, p, v)
    peak = 0.0
    for r in range(p):
        act = sum(profile.stages[s].activation_mb for s in range(r * v, (r + 1) * v))
        peak = max(peak, min(p - r, m) * act)
    return peak


#: Values of `--backward` (and of `SearchProblem.backward`).
BACKWARD_CHOICES = ("auto", "split", "full")


def _stages_error(profile: CostProfile, p: int, v: int) -> SearchError:
    return SearchError(f"{profile.source} has {profile.num_stages} stages but p * v = {p} * {v} = {p * v}; "
                       f"change `p` / `v` to match the profile (one profile entry per virtual stage)", "p", "v")


def backward_kinds(profile: CostProfile, backward: str = "auto") -> tuple[str, ...]:
    """The backward kinds a search explores for `backward`.

    auto: split, and full too unless every stage's B >= I + W (always so without the profile's
    `backward`). Then full cannot win: replacing each B by its I and, right after it, its W
    gives a split schedule no slower (every duration is no longer, the input gradient leaves
    no later, and the peak memory is the same: nothing is allocated between the I and the W),
    so the best split schedule is at least as fast as the best full one."""
    if backward not in BACKWARD_CHOICES:
        raise SearchError(f"`backward` must be one of {', '.join(BACKWARD_CHOICES)}, got {backward!r}", "backward")
    if backward != "auto":
        return (backward,)
    if all(c.backward >= c.split_backward for c in profile.stages):
        return ("split",)
    return ("split", "full")


#: Values of `--placement` (and of `SearchProblem.placement`).
PLACEMENT_CHOICES = ("default", "linear", "interleaved", "vshape", "bidirectional", "any")


def default_placements(p: int, v: int) -> list[Placement]:
    """The single-copy placements valid for v: linear for v = 1; V-shape and interleaved for
    v >= 2 (for v > 2 the V-shape is the zig-zag)."""
    if v == 1:
        return [Placement.named("linear", p, 1)]
    out = [Placement.named("vshape", p, v), Placement.named("interleaved", p, v)]
    seen, uniq = set(), []
    for pl in out:
        if pl.stage_ranks not in seen:
            seen.add(pl.stage_ranks)
            uniq.append(pl)
    return uniq


def placements_for(p: int, v: int, placement: str = "default") -> list[Placement]:
    """The placements a search explores for `placement` (one of PLACEMENT_CHOICES).

    default: the single-copy placements valid for v (`default_placements`); linear,
    interleaved, vshape: that one (linear needs v = 1; interleaved and vshape need v >= 2, with
    one chunk they are the linear placement); bidirectional: Chimera's two pipelines, which keep
    TWO copies of the weights (the profile's memory figures leave weights out, so the model does
    not charge for them, and the DeepSpeed and Megatron adapters cannot run it); any: the
    default ones and the bidirectional one."""
    if placement not in PLACEMENT_CHOICES:
        raise SearchError(f"`placement` must be one of {', '.join(PLACEMENT_CHOICES)}, got {placement!r}",
                          "placement")
    if placement == "default":
        return default_placements(p, v)
    if placement == "any":
        return default_placements(p, v) + [Placement.named("bidirectional", p, v)]
    if placement == "linear" and v != 1:
        raise SearchError(f"`placement` linear needs `v` = 1 (got {v}); use `placement` interleaved or vshape",
                          "placement", "v")
    if placement in ("interleaved", "vshape") and v == 1:
        raise SearchError(f"`placement` {placement} needs `v` >= 2 (with one chunk per rank it is the linear "
                          f"placement); use `placement` linear or raise `v`", "placement", "v")
    return [Placement.named(placement, p, v)]


def weight_copies(placement: Placement) -> int:
    """How many copies of the weights a placement keeps (2 for bidirectional schedules)."""
    return placement.pipelines


@dataclass
class Evaluation:
    """What the try-test of one candidate found."""

    makespan: float            # inf when it deadlocks or does not fit
    peak: float                # the worst rank's peak memory (MB)
    fits: bool
    orders: list[list[int]]    # the repaired orders (BTT choices)
    codes: list[list[int]]     # the same orders as the simulator's codes


def _runnable(order: list[int], i0: int, avail: list[float], dep: list[int], S: int, m: int
              ) -> tuple[int, int | None]:
    """(preference, position > i0) in a stuck rank's order of a step that could run now: the
    first of its kind on its stage after i0 (so microbatch order is kept), its input there, and
    its local predecessor (the forward of a backward, the I of a W) not among the steps skipped.
    A backward is preferred (0: it passes a gradient on and frees memory), then a forward (1),
    then a W (2); position None when there is none."""
    seen: set[tuple[int, int]] = set()            # (preference, stage) met since i0
    skipped: set[tuple[int, int, int]] = set()    # (preference, stage, microbatch) met since i0
    found: dict[int, int] = {}
    for j in range(i0, len(order)):
        c = order[j]
        rest, mb = divmod(c, m)
        kind, s = divmod(rest, S)
        pref = 0 if kind in (B_K, I_K) else (1 if kind == F_K else 2)
        if j > i0 and (pref, s) not in seen and pref not in found:
            d = dep[c]
            local = (1, s, mb) if pref == 0 else ((0, s, mb) if pref == 2 else None)
            if (d < 0 or avail[d] >= 0.0) and (local is None or local not in skipped):
                found[pref] = j
                if pref == 0:
                    break
        seen.add((pref, s))
        skipped.add((pref, s, mb))
    if not found:
        return 3, None
    pref = min(found)
    return pref, found[pref]


@dataclass
class PlacementProblem:
    """One placement of the configuration: simulator, decoder, lower bound."""

    placement: Placement
    sim: Simulator
    decoder: OrderDecoder
    lower_bound: float
    lower_bound_binding: str   # which bound gives `lower_bound` (shown by `koala compare` and `koala search`)

    def evaluate(self, orders: Sequence[Sequence[int]]) -> Evaluation:
        """Try-test `orders` (one per rank): decode and repair them, then simulate."""
        rep, codes, peaks = [], [], []
        for r in range(self.placement.p):
            order, c, pk = self.decoder.decode_rank(r, orders[r])
            rep.append(order)
            codes.append(c)
            peaks.append(pk)
        fits = all(pk <= lim for pk, lim in zip(peaks, self.decoder.limits))
        if not fits:
            return Evaluation(INFEASIBLE, max(peaks), False, rep, codes)
        res = self.sim.try_times(codes, record=False)
        if isinstance(res, Stall):  # deadlock: move a step that can run to where its rank is stuck
            res = self.unblock(rep, codes, peaks, res)
            if res is None:
                return Evaluation(INFEASIBLE, max(peaks), True, rep, codes)
        return Evaluation(max(res[0]), max(peaks), True, rep, codes)

    def unblock(self, orders: list[list[int]], codes: list[list[int]], peaks: list[float], stall: Stall
                ) -> tuple[list[float], list[list[float]]] | None:
        """Repair deadlocked orders in place: where every rank waits (`stall`), move a step of a
        stuck rank that can run (its input is there; a backward before a forward, a W last) to
        the place its rank is stuck at, re-decode that rank, and repeat. The orders' timing
        (`Simulator.try_times`) when they then run within the memory limit; None when no such
        step is left or after 3p moves."""
        sim, m, S = self.sim, self.sim.m, self.sim.num_stages
        inputs = sim.inputs
        for _ in range(3 * self.placement.p):
            pos, avail = stall
            found = [(cls, r, j) for r in range(self.placement.p) if pos[r] < len(codes[r])
                     for cls, j in [_runnable(codes[r], pos[r], avail, inputs, S, m)] if j is not None]
            if not found:
                return None
            _, r, j = min(found)  # a backward first (see _runnable), then the lowest rank
            order = list(orders[r])  # the decoder caches what it returned: never edit in place
            order.insert(pos[r], order.pop(j))
            new, c, pk = self.decoder.decode_rank(r, order)
            orders[r], codes[r], peaks[r] = list(new), list(c), pk
            if pk > self.decoder.limits[r]:
                return None
            res = sim.try_times(codes, record=False)
            if not isinstance(res, Stall):
                return res
            stall = res
        return None

    def schedule(self, codes: Sequence[Sequence[int]], name: str) -> Schedule:
        """The schedule of each rank's codes."""
        ranks = tuple(tuple(self.sim.decode(c) for c in rank_codes) for rank_codes in codes)
        v = self.placement.v
        return Schedule(self.placement.p, self.sim.m, v, self.placement, ranks, self.sim.backward, name)

    @property
    def backward(self) -> str:
        """This part's backward kind: split or full."""
        return self.sim.backward

    def admits(self, schedule: Schedule) -> bool:
        """Whether `schedule` can seed this part: its placement, and full backward or a split part."""
        return schedule.placement == self.placement and (schedule.backward == "full" or self.backward == "split")

    def orders_of(self, schedule: Schedule) -> list[list[int]]:
        """The orders of a schedule as this part's BTT choices (microbatch exceptions dropped: the
        decoder then takes microbatches in order; a B is I + W in a split part)."""
        enc = encode(schedule)
        C = self.placement.chunks_per_rank
        out = []
        for rank_choices in enc.ranks:
            order = []
            for choice in rank_choices.choices:
                kind, c = divmod(choice, C)
                if self.sim.backward == "split" and kind == B_K:
                    order += [I_K * C + c, W_K * C + c]
                else:
                    order.append(choice)
            out.append(order)
        return out


@dataclass
class SearchProblem:
    """The configuration to search, built and checked once."""

    profile: CostProfile
    p: int
    m: int
    v: int = 1
    backward: str = "auto"              # one of BACKWARD_CHOICES
    memory_limit: float | None = None   # MB per rank; None: the profile's, else 1F1B's peak
    placements: list[Placement] | None = None   # explicit list; overrides `placement`
    placement: str = "default"                  # one of PLACEMENT_CHOICES
    memory_limit_source: str = field(default="", init=False)
    limits: tuple[float | None, ...] = field(default=(), init=False)
    kinds: tuple[str, ...] = field(default=(), init=False)     # backward kinds searched (`backward_kinds`)
    parts: list[PlacementProblem] = field(default_factory=list, init=False)  # placement-major, then kind
    unfit: list[tuple[Placement, int, float]] = field(default_factory=list, init=False)  # left out: (placement,
    # its rank furthest short, what that rank needs in MB): below the limit whatever the schedule

    def __post_init__(self) -> None:
        for name in ("p", "m", "v"):
            if getattr(self, name) < 1:
                raise SearchError(f"`{name}` must be >= 1, got {getattr(self, name)}", name)
        self.kinds = backward_kinds(self.profile, self.backward)
        too_big = size_error(self.p, self.m, self.v, "split" if "split" in self.kinds else "full",
                             {"p": "`p`", "m": "`m`", "v": "`v`"})
        if too_big:  # before anything of its size is built (1e9 microbatches took 119 GiB)
            raise SearchError(too_big, "m", "p", "v")
        if self.profile.num_stages != self.p * self.v:
            raise _stages_error(self.profile, self.p, self.v)
        if self.memory_limit is not None:
            if not 0 < self.memory_limit <= MAX_PROFILE_NUMBER:
                raise SearchError(f"`memory_limit` must be a positive number of MB up to {MAX_PROFILE_NUMBER:g}, "
                                  f"got {self.memory_limit:g}", "memory_limit")
            limit: float | tuple | None = float(self.memory_limit)
            self.memory_limit_source = "`memory_limit`"  # the CLI words it --memory-limit
        elif self.profile.memory_limit_mb is not None:
            limit = self.profile.memory_limit_mb
            self.memory_limit_source = "the profile"
        else:
            limit = one_f_one_b_peak(self.profile, self.p, self.m, self.v)
            self.memory_limit_source = "1F1B's peak"
        try:
            profile = dataclasses.replace(self.profile, memory_limit_mb=limit)
            self.limits = profile.memory_limits(self.p)
        except ProfileError as exc:
            raise SearchError(str(exc), "profile") from None
        self.search_profile = profile
        if self.placements is None:
            self.placements = placements_for(self.p, self.v, self.placement)
        else:
            self.placements = self._checked_placements(self.placements)
        self._check_memory()
        for pl in self.placements:
            self.parts += [self._part(pl, kind) for kind in self.kinds]

    def _checked_placements(self, placements) -> list[Placement]:
        """`placements` given: a non-empty list of Placements of this problem's p and v."""
        placements = list(placements)
        if not placements:
            raise SearchError("`placements` is empty: give one placement or more, or None (then `placement` "
                              "decides)", "placements")
        for pl in placements:
            if not isinstance(pl, Placement):
                raise SearchError(f"`placements` holds {pl!r}, not a koala_ds.core.ir.Placement", "placements")
            if (pl.p, pl.v) != (self.p, self.v):
                raise SearchError(f"`placements`: {pl.describe()} is a placement of p={pl.p}, v={pl.v}; this "
                                  f"problem's p={self.p}, v={self.v}", "placements")
        return placements

    def _check_memory(self) -> None:
        """Keep the placements whose memory need fits the limit; reject a limit below what any
        schedule of every placement needs. For every microbatch, a rank holds the activations
        of all its stages (of that microbatch's pipeline) at once: the backward of its earliest
        stage waits for the backward of its later ones, which wait for their forwards. One
        microbatch at a time needs no more, so this is exact. When none fits, the placement
        nearest to fitting is named, with its rank furthest short (what a larger limit must cover)."""
        short = {}  # placement -> (shortfall, rank, need, limit) of its rank furthest short
        for pl in self.placements or []:
            costs = self.profile.stage_costs(pl.num_stages, pl.pipelines)
            for r in range(self.p):
                lim = self.limits[r]
                if lim is None:
                    continue
                need = max(sum(costs[s].activation_mb for s in pl.stages_of(r) if pl.pipeline_of(s) == k)
                           for k in range(pl.pipelines))
                if need > lim * (1 + 1e-9) + 1e-9 and need - lim > short.get(pl, (0.0,))[0]:
                    short[pl] = (need - lim, r, need, lim)
        fitting = [pl for pl in self.placements or [] if pl not in short]
        if short and not fitting:
            pl = min(short, key=lambda x: short[x][0])
            _, r, need, lim = short[pl]
            raise MemoryTooSmall(f"memory limit {lim:g} MB on rank {r} is below what any schedule needs there "
                                 f"({need:g} MB: one activation of each of its stages, placement {pl.describe()}); "
                                 f"raise `memory_limit` to at least {mb_up(need)} MB", r, need, lim)
        self.unfit = [(pl, short[pl][1], short[pl][2]) for pl in self.placements or [] if pl in short]
        self.placements = fitting

    def _part(self, placement: Placement, kind: str) -> PlacementProblem:
        sim = Simulator(self.search_profile, placement, self.m, kind)
        dec = OrderDecoder(sim.lowered, self.limits)
        lb = lower_bound(self.search_profile, self.p, self.m, self.v, placement, kind,
                         memory_limit=list(self.limits))
        # a second provable bound (docs/search.md, "A tighter bound"); the larger one holds
        jb = jackson_bound(self.search_profile, placement, self.m, kind, self.limits)
        if jb.value > lb.value:
            return PlacementProblem(placement, sim, dec, jb.value, "release/tail one-machine")
        return PlacementProblem(placement, sim, dec, lb.value, lb.binding)

    def allows(self, placement: Placement) -> bool:
        """Whether `placement` is one of the placements this problem searches."""
        return placement in (self.placements or [])  # placements equal by their ranks and pipelines

    @property
    def allows_two_copies(self) -> bool:
        """Whether a placement with two copies of the weights (bidirectional) is searched."""
        return any(weight_copies(pl) > 1 for pl in self.placements or [])

    def part_for(self, placement: Placement, backward: str | None = None) -> PlacementProblem:
        """The part of `placement` with backward kind `backward` (None or a kind not searched: its
        first part). A placement not searched gets its parts (every kind) added."""
        same = [part for part in self.parts if part.placement == placement]
        if not same:
            same = [self._part(placement, kind) for kind in self.kinds]
            self.parts += same
        return next((part for part in same if part.backward == backward), same[0])

    @property
    def searched_parts(self) -> list[PlacementProblem]:
        """The parts of the placements searched (`part_for` may add others after them)."""
        return self.parts[:len(self.placements or []) * len(self.kinds)]

    def part_of(self, placement: Placement, backward: str | None = None) -> PlacementProblem:
        """`part_for` without adding to the problem: a placement not searched gets a part of its
        own, which the search, its bound and its seeds never see."""
        if any(part.placement == placement for part in self.parts):
            return self.part_for(placement, backward)  # found, not added
        return self._part(placement, backward if backward in self.kinds else self.kinds[0])

    @property
    def lower_bound(self) -> float:
        """The bound over every placement and backward kind searched (the smallest of their bounds:
        the answer may be any of them); not over parts `part_for` added."""
        return min(part.lower_bound for part in self.searched_parts)

    def lower_bound_of(self, backward: str) -> float:
        """The bound over the searched parts of one backward kind."""
        return min(part.lower_bound for part in self.searched_parts if part.backward == backward)

    @property
    def memory_limit_mb(self) -> float | None:
        lims = [x for x in self.limits if x is not None]
        return max(lims) if lims else None
