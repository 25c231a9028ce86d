"""Lowering: a schedule with its communication made explicit, per rank.

A `Schedule` lists each rank's compute actions; the messages between ranks are implied by the
dependencies between virtual stages. `lower` makes them explicit, as
torch.distributed.pipelining's lowering does: per rank, one stream of steps in the order
the rank issues them, each a compute action (F, B, I, W), a SEND or a RECV of one `Message`
to or from a peer rank.

The rule (both engines interpret the same stream):

- a SEND follows the compute action that produces its tensor, immediately; sends are
  non-blocking (isend), waited before the optimizer step;
- a RECV *posts* a non-blocking receive (irecv); the compute action that consumes the message
  waits for it. On every channel (ordered pair of ranks) the receiver posts its receives in the
  sender's send order, so the k-th receive posted matches the k-th send: what a backend that
  matches messages by order alone (NCCL) needs, whatever order the receiver consumes them in
  (pp=2 with two chunks per rank carries activations and gradients of different stages on one
  channel, in orders the two ends need differently);
- the receives of the next `lookahead` compute actions are posted before the current one (and,
  to keep the channel order, every earlier message of their channels), so a message can arrive
  while the rank computes. With `lookahead=0` each RECV comes right before its consumer, and a
  blocking receive at the RECV (an engine that must first learn a message's shape) is safe too;
  with `lookahead=None` every receive of the step is posted before its first compute.

Which lookahead the engines use: `recv_lookahead` (on gloo, every receive at the step's start:
gloo sends a message's data only once its receive is posted, and when the receive comes after the
send, the sender's transport thread must send it while the sender's main thread computes, which
on a busy CPU took up to the length of the sender's next actions).

A schedule that is deadlock-free with non-blocking sends and blocking receives (`validate`)
lowers to streams that are deadlock-free under this rule; `check_lowered` executes the streams
and proves it for one schedule. Pure data, no torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from ..core.ir import Action, Op, Schedule, ScheduleError

ACT = "act"  # the input activation of `stage`
GRAD = "grad"  # the gradient of the output of `stage`
SEND = "SEND"
RECV = "RECV"
COMPUTE = "COMPUTE"

#: The receives of this many upcoming compute actions are posted early (see the module docstring).
RECV_LOOKAHEAD = 2
#: Overrides the engines' lookahead: a number of compute actions, or "all".
ENV_RECV_LOOKAHEAD = "KOALA_RECV_LOOKAHEAD"


class LookaheadSettingError(ScheduleError, ValueError):
    """KOALA_RECV_LOOKAHEAD is neither a whole number >= 0 nor "all"."""


def recv_lookahead(gloo: bool, env: dict | None = None) -> int | None:
    """The lookahead of an engine's training steps: KOALA_RECV_LOOKAHEAD where set (a number of
    compute actions, or "all": None); else, on gloo, None (every receive of the step at its
    start; benchmarks/results/recv_lookahead.txt: DeepSpeed example, dim 1024, p = 2, v = 2,
    2-core CPU, 7 alternating rounds of fresh runs against lookahead 2: of the waits for a
    message, those that ended more than 2 ms after its sender's compute fell from 12.5-13.7% to
    7.3-7.7%, the mean lateness from 0.8-1.3 to 0.3-0.4 ms, the step by 11-12%); else
    RECV_LOOKAHEAD (NCCL: a receive posted early holds its buffer, so on a GPU posting all at
    once costs memory)."""
    raw = (os.environ if env is None else env).get(ENV_RECV_LOOKAHEAD, "").strip()
    if not raw:
        return None if gloo else RECV_LOOKAHEAD
    if raw.lower() == "all":
        return None
    if not raw.isdigit():
        raise LookaheadSettingError(f"{ENV_RECV_LOOKAHEAD}={raw!r}: the receive lookahead must be a whole number of "
                                    f"compute actions >= 0, or 'all' (unset: all on gloo, {RECV_LOOKAHEAD} otherwise)")
    return int(raw)


class Message(NamedTuple):
    """One point-to-point message: the `kind` of tensor for virtual `stage` and `microbatch`.

    ACT carries the input of `stage` (the output of the stage before it), GRAD the gradient of
    the output of `stage` (the input gradient of the stage after it). A named tuple: hashed and
    compared in C, as a dict key of the engines' p2p layers."""

    kind: str
    stage: int
    microbatch: int

    def describe(self) -> str:
        what = "input activation" if self.kind == ACT else "output gradient"
        return f"the {what} of stage {self.stage} microbatch {self.microbatch}"

    def __str__(self) -> str:
        return f"{self.kind} {self.stage}/{self.microbatch}"


class Step(NamedTuple):
    """One step of a rank's lowered stream: COMPUTE `action`, or SEND / RECV `message` to / from `peer`."""

    kind: str
    action: Action | None = None
    message: Message | None = None
    peer: int = -1

    def __str__(self) -> str:
        if self.kind == COMPUTE:
            return str(self.action)
        arrow = "->" if self.kind == SEND else "<-"
        return f"{self.kind} {self.message} {arrow} {self.peer}"


@dataclass(frozen=True)
class Lowered:
    """Per rank, the steps in issue order (see the module docstring)."""

    schedule: Schedule
    forward_only: bool
    lookahead: int
    ranks: tuple[tuple[Step, ...], ...]

    def channel(self, src: int, dst: int) -> tuple[list[Message], list[Message]]:
        """(the order in which `src` sends to `dst`, the order in which `dst` posts receives from `src`)."""
        sent = [st.message for st in self.ranks[src] if st.kind == SEND and st.peer == dst]
        posted = [st.message for st in self.ranks[dst] if st.kind == RECV and st.peer == src]
        return sent, posted

    def channels(self) -> list[tuple[int, int]]:
        """Every ordered (src, dst) pair of ranks that carries a message."""
        return sorted({(r, st.peer) for r, steps in enumerate(self.ranks) for st in steps if st.kind == SEND})

    def text(self, rank: int) -> str:
        return " ".join(str(st) for st in self.ranks[rank])


def sent_message(schedule: Schedule, rank: int, a: Action) -> tuple[int, Message] | None:
    """(destination rank, message) that action `a` of `rank` sends to another rank, if any."""
    pl = schedule.placement
    if a.op is Op.F:
        nxt = pl.next_stage(a.stage)
        if nxt is not None and pl.stage_ranks[nxt] != rank:
            return pl.stage_ranks[nxt], Message(ACT, nxt, a.microbatch)
    elif a.op is not Op.W:
        prev = pl.prev_stage(a.stage)
        if prev is not None and pl.stage_ranks[prev] != rank:
            return pl.stage_ranks[prev], Message(GRAD, prev, a.microbatch)
    return None


def received_message(schedule: Schedule, rank: int, a: Action) -> tuple[int, Message] | None:
    """(source rank, message) that action `a` of `rank` consumes from another rank, if any."""
    pl = schedule.placement
    if a.op is Op.F:
        prev = pl.prev_stage(a.stage)
        if prev is not None and pl.stage_ranks[prev] != rank:
            return pl.stage_ranks[prev], Message(ACT, a.stage, a.microbatch)
    elif a.op is not Op.W:
        nxt = pl.next_stage(a.stage)
        if nxt is not None and pl.stage_ranks[nxt] != rank:
            return pl.stage_ranks[nxt], Message(GRAD, a.stage, a.microbatch)
    return None


def _actions(schedule: Schedule, forward_only: bool) -> list[list[Action]]:
    return [[a for a in actions if a.op is Op.F or not forward_only] for actions in schedule.ranks]


def lower(schedule: Schedule, forward_only: bool = False, lookahead: int | None = RECV_LOOKAHEAD) -> Lowered:
    """The lowered streams of `schedule` (forward actions only with `forward_only`; `lookahead`
    None: every receive before the first compute).

    Raises ScheduleError when a rank consumes a message no rank sends, or a message is sent
    that its receiver never consumes (schedules that `validate` refuses)."""
    if lookahead is not None and lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    actions = _actions(schedule, forward_only)
    if lookahead is None:
        lookahead = max(map(len, actions), default=0)
    channels: dict[tuple[int, int], list[Message]] = {}  # (src, dst) -> messages in send order
    for src, row in enumerate(actions):
        for a in row:
            sent = sent_message(schedule, src, a)
            if sent is not None:
                channels.setdefault((src, sent[0]), []).append(sent[1])
    index = {msg: i for msgs in channels.values() for i, msg in enumerate(msgs)}
    ranks = tuple(_lower_rank(schedule, rank, actions[rank], channels, index, lookahead)
                  for rank in range(schedule.p))
    return Lowered(schedule, forward_only, lookahead, ranks)


def _lower_rank(schedule: Schedule, rank: int, actions: list[Action], channels: dict, index: dict,
                lookahead: int) -> tuple[Step, ...]:
    needs = [received_message(schedule, rank, a) for a in actions]
    posted: dict[int, int] = {}  # source rank -> number of its messages posted
    out: list[Step] = []
    for i, a in enumerate(actions):
        for need in needs[i:i + 1 + lookahead]:
            if need is None:
                continue
            src, msg = need
            k = index.get(msg)
            if k is None or channels[(src, rank)][k] != msg:
                raise ScheduleError(f"schedule {schedule.name!r}: rank {rank} runs {a} which needs {msg.describe()} "
                                    f"from rank {src}, which no action of rank {src} sends")
            sequence = channels[(src, rank)]
            for j in range(posted.get(src, 0), k + 1):
                out.append(Step(RECV, message=sequence[j], peer=src))
            posted[src] = max(posted.get(src, 0), k + 1)
        out.append(Step(COMPUTE, action=a))
        sent = sent_message(schedule, rank, a)
        if sent is not None:
            out.append(Step(SEND, message=sent[1], peer=sent[0]))
    for (src, dst), sequence in channels.items():
        if dst == rank and posted.get(src, 0) != len(sequence):
            msg = sequence[posted.get(src, 0)]
            raise ScheduleError(f"schedule {schedule.name!r}: rank {src} sends {msg.describe()} to rank {rank}, "
                                f"which never uses it")
    return tuple(out)


def check_lowered(lowered: Lowered, blocking_recv: bool = False) -> None:
    """Execute the streams (unit steps, ranks interleaved) and raise ScheduleError unless every
    rank finishes with every compute action's inputs available when it runs, every receive
    matched by order to a send of the same message, and no message left over.

    `blocking_recv`: a RECV waits for its matching send (else it only posts and its consumer
    waits)."""
    state = _Run(lowered, blocking_recv)
    progress = True
    while progress:
        progress = False
        for rank in range(lowered.schedule.p):
            while state.ptr[rank] < len(lowered.ranks[rank]) and state.step(rank):
                progress = True
    stuck = [(r, lowered.ranks[r][state.ptr[r]]) for r in range(lowered.schedule.p)
             if state.ptr[r] < len(lowered.ranks[r])]
    if stuck:
        raise ScheduleError(f"lowered {lowered.schedule.name!r} deadlocks: " +
                            "; ".join(f"rank {r} waits at {st}" for r, st in stuck))
    left = {ch: len(sent) - state.recv_count.get(ch, 0) for ch, sent in state.sent.items()
            if len(sent) != state.recv_count.get(ch, 0)}
    if left:
        raise ScheduleError(f"lowered {lowered.schedule.name!r}: messages sent and never received {left}")


class _Run:
    """The state of `check_lowered`'s execution."""

    def __init__(self, lowered: Lowered, blocking_recv: bool) -> None:
        self.lowered, self.blocking = lowered, blocking_recv
        self.ptr = [0] * lowered.schedule.p
        self.sent: dict[tuple[int, int], list[Message]] = {}  # channel -> messages sent so far
        self.recv_count: dict[tuple[int, int], int] = {}  # channel -> receives posted so far
        self.posted: dict[tuple[int, Message], int] = {}  # (rank, message) -> its index on the channel
        self.done: set[tuple[int, Op, int, int]] = set()  # (rank, op, stage, mb) computed

    def step(self, rank: int) -> bool:
        st = self.lowered.ranks[rank][self.ptr[rank]]
        if st.kind == SEND:
            self.sent.setdefault((rank, st.peer), []).append(st.message)
        elif st.kind == RECV:
            ch = (st.peer, rank)
            k = self.recv_count.get(ch, 0)
            if self.blocking and len(self.sent.get(ch, ())) <= k:
                return False
            self.recv_count[ch] = k + 1
            self.posted[(rank, st.message)] = k
        elif not self._compute(rank, st.action):
            return False
        self.ptr[rank] += 1
        return True

    def _compute(self, rank: int, a: Action) -> bool:
        schedule = self.lowered.schedule
        need = received_message(schedule, rank, a)
        if need is not None:
            src, msg = need
            k = self.posted.get((rank, msg))
            if k is None:
                raise ScheduleError(f"lowered {schedule.name!r}: rank {rank} runs {a} before posting the receive "
                                    f"of {msg.describe()}")
            sent = self.sent.get((src, rank), [])
            if len(sent) <= k:
                return False
            if sent[k] != msg:
                raise ScheduleError(f"lowered {schedule.name!r}: receive {k} of rank {rank} from rank {src} expects "
                                    f"{msg.describe()} but rank {src} sent {sent[k].describe()}")
        for dep in self._local_deps(rank, a):
            if dep not in self.done:
                raise ScheduleError(f"lowered {schedule.name!r}: rank {rank} runs {a} before {dep[1]}{dep[2]}/{dep[3]}")
        self.done.add((rank, a.op, a.stage, a.microbatch))
        return True

    def _local_deps(self, rank: int, a: Action) -> list[tuple[int, Op, int, int]]:
        """The actions of this rank whose results `a` uses (its inputs from other ranks are messages)."""
        pl, s, mb = self.lowered.schedule.placement, a.stage, a.microbatch
        if a.op is Op.W:
            return [(rank, Op.I, s, mb)]
        if a.op is Op.F:
            prev = pl.prev_stage(s)
            return [] if prev is None or pl.stage_ranks[prev] != rank else [(rank, Op.F, prev, mb)]
        deps = [(rank, Op.F, s, mb)]
        nxt = pl.next_stage(s)
        if nxt is not None and pl.stage_ranks[nxt] == rank:
            op = Op.I if (rank, Op.I, nxt, mb) in self.done else Op.B
            deps.append((rank, op, nxt, mb))
        return deps
