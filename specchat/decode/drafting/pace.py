"""The pace: which draft source each cycle takes, by the tokens per millisecond each has earned in this chat.

A cycle can take one of three arms (`Arm`):

- PLAIN: a plain step, nothing drafted;
- LOOKUP: continuations found in text already seen, alone, as many nodes as pay at this machine's
  verify cost (what `pld` does): no head forward, so a cycle costs the verify forward and little more;
- HEAD: the draft head's tree, joined by those continuations where there are any (hybrid drafting);
  for `sps`, MODEL: the small draft model's chain, joined by them alike.

Each arm's record is its recent tokens and milliseconds, a cycle's whole wall time (drafting,
verification, bookkeeping), decayed so that recent text counts most. What lookup found splits the
records in three (`Found`): nothing, a continuation, or one likely accepted (PROMISING or more): a
head cycle with a chain to merge is another bet than one without, a copy under way (a rewritten
function) is another than a stray match, and the lookup arm exists only where there is a chain; a
plain step costs the same in each (its cost is the machine's), so the plain arm has one record. The
next cycle takes the arm with the best rate among those it can take, and each other arm is tried
again after EXPLORE steps of its context (a context that comes back now and then would otherwise
retry a slower arm nearly every time), twice as many after each try that finds it still slower (up
to LONGEST_WAIT), after EXPLORE again when the try's own cycle beat the best; every arm is tried
afresh at the start of each reply (its text may draft otherwise), its waits starting over and its
record carrying CARRY of its weight into the reply, and a likely continuation is never passed over
for a plain step. The text changing kind (prose turning into code that quotes the prompt) shows as
the split and in the decayed records. The records describe this machine, model and head, not the
text, so they outlast a conversation (`specchat bench` answers each question on its own and keeps
them, as a chat does across /clear), though weighed less in each new reply.

Every arm is exact, so output is unchanged: only the pace follows the measurements. The two paced
drafters (a head's, a draft model's) share what they do at a prompt, a rewind and a new
conversation (`LookupAndPace`). Nothing here imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from specchat.decode.drafting.lookup import LookupSource


class Found(enum.IntEnum):
    """What lookup found for a cycle (the context each arm's record is kept for)."""

    NOTHING = 0
    CONTINUATION = 1
    LIKELY = 2  # a continuation whose first token is accepted PROMISING often or more

    @classmethod
    def of(cls, found: bool, lookup_accept: float) -> Found:
        """`lookup_accept`: the best continuation's first-token acceptance estimate."""
        return cls.NOTHING if not found else cls.LIKELY if lookup_accept >= Pace.PROMISING else cls.CONTINUATION


class Arm(str, enum.Enum):
    """What drafted a cycle (also how `specchat.stats` counts cycles; MODEL: a small draft model's chain)."""

    PLAIN = "plain"
    LOOKUP = "lookup"
    HEAD = "head"
    MODEL = "model"


@dataclass
class ArmRecord:
    """One arm's decayed tokens and milliseconds, and when it is next tried."""

    tokens: float = 0.0
    milliseconds: float = 0.0
    wait: int = 0  # steps between tries while it is not the best
    since: int = 0  # steps since it last ran

    @property
    def rate(self) -> float | None:
        """Tokens per millisecond, None before it ran."""
        return self.tokens / self.milliseconds if self.milliseconds > 0 else None


class Pace:
    """Chooses each cycle's arm (see the module docstring)."""

    DECAY = 0.9  # per step of each arm: recent text counts most
    CARRY = 0.3  # of its weight, what a record carries into a new reply (its rate stays)
    EXPLORE, LONGEST_WAIT = 4, 32  # steps before another arm is tried again, doubling up to the longest
    PROMISING = 0.6  # a lookup continuation accepted at least this often is never passed over for a plain step
    # (`Found.LIKELY`)

    def __init__(self, plain_ms: float, arms: tuple[Arm, ...] = (Arm.PLAIN, Arm.LOOKUP, Arm.HEAD)):
        """`plain_ms`: a plain step's cost until plain steps are timed (the verify-cost curve's one token);
        `arms`: those this drafter can take (PLAIN and at least one other)."""
        self.arms = arms
        self.plain_ms = plain_ms
        self.records: dict[tuple[Arm, Found], ArmRecord] = {}
        self.forget()
        self.records[(Arm.PLAIN, Found.NOTHING)] = ArmRecord(1.0, plain_ms, wait=self.EXPLORE)

    def _record(self, arm: Arm, found: Found) -> ArmRecord:
        return self.records[(arm, Found.NOTHING if arm is Arm.PLAIN else Found(found))]

    def candidates(self, found: Found) -> list[Arm]:
        """The arms the next cycle can take: LOOKUP only where a continuation was found, PLAIN not
        where it is likely accepted."""
        arms = [arm for arm in self.arms if arm is not Arm.LOOKUP or found]
        if found is Found.LIKELY and len(arms) > 1:
            arms.remove(Arm.PLAIN)
        return arms

    def choose(self, found: Found) -> Arm:
        """The next cycle's arm: one never run yet (the most ambitious first), one whose wait is up
        (the longest overdue), else the fastest."""
        arms = self.candidates(found)
        records = {arm: self._record(arm, found) for arm in arms}
        untried = [arm for arm in reversed(arms) if records[arm].rate is None]
        if untried:
            return untried[0]
        best = max(arms, key=lambda arm: records[arm].rate)
        due = [arm for arm in arms if arm is not best and records[arm].since >= records[arm].wait]
        return max(due, key=lambda arm: records[arm].since - records[arm].wait) if due else best

    def best_rate(self, found: Found, besides: Arm | None = None) -> float | None:
        """The best measured rate among the arms open with or without a continuation, `besides` left out."""
        rates = [self._record(arm, found).rate for arm in self.candidates(found) if arm is not besides]
        rates = [rate for rate in rates if rate is not None]
        return max(rates) if rates else None

    def learn(self, arm: Arm, found: Found, tokens: int, milliseconds: float) -> None:
        """A step's tokens and wall time, taken by `arm` where lookup `found` what it found."""
        record = self._record(arm, found)
        rival = self.best_rate(found, besides=arm)
        record.tokens = record.tokens * self.DECAY + tokens
        record.milliseconds = record.milliseconds * self.DECAY + milliseconds
        context = Found(found)
        for (other_arm, other_context), other in self.records.items():  # a wait counts its own context's steps
            if other_arm is Arm.PLAIN or other_context is context:  # (plain steps' record is every context's)
                other.since += 1
        record.since = 0
        if rival is None or record.rate >= rival:
            record.wait = self.EXPLORE
        elif tokens / milliseconds >= rival:  # this step beat the best: try again soon (not at once: one
            record.wait = self.EXPLORE  # cycle's rate is a lucky acceptance as often as a change of text)
        else:
            record.wait = min(2 * max(record.wait, self.EXPLORE // 2), self.LONGEST_WAIT)

    def check_soon(self) -> None:
        """A new reply: every arm is tried again, and again after waits that start short, and what it
        earns counts more than before (its text may draft otherwise, and its context costs otherwise:
        a record kept whole from a long prompt outweighed a short one's few tries for its whole reply)."""
        for record in self.records.values():
            record.tokens *= self.CARRY
            record.milliseconds *= self.CARRY
            record.wait = record.since = self.EXPLORE

    def forget(self) -> None:
        """What follows is unrelated: the drafting arms' records go (a plain step's cost stays: it is the machine's)."""
        for arm in self.arms:
            for found in Found:
                if arm is not Arm.PLAIN:
                    self.records[(arm, found)] = ArmRecord(wait=self.EXPLORE)


class LookupAndPace:
    """What a drafter that also looks text up and paces its arms (the head's and the draft model's
    proposers) does at a rewind, a new conversation, a prediction and a prompt: the lookup source
    follows the text, and a prompt starts a reply whose arms the pace tries afresh. The acceptance
    rates and the pace outlast a conversation: they describe the machine and the models, not the text."""

    lookup: LookupSource | None
    pace: Pace | None

    def rewind_lookup(self, length: int) -> None:
        if self.lookup is not None:
            self.lookup.rewind(length)

    def forget(self) -> None:
        if self.lookup is not None:
            self.lookup.forget()

    def predict(self, tokens: list[int]) -> None:
        if self.lookup is not None:  # the drafter's own model drafts from the context, not from text it is shown
            self.lookup.predict(tokens)

    def prompted(self, tokens: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.prompted(tokens)
        if self.pace is not None:
            self.pace.check_soon()
