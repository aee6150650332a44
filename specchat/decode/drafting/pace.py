"""The pace: which draft source each cycle takes, by the tokens per millisecond each has earned in this chat.

A cycle can take one of three arms (`Arm`):

- PLAIN: a plain step, nothing drafted;
- LOOKUP: continuations found in text already seen, alone, as many nodes as pay at this machine's
  verify cost (what `pld` does): no head forward, so a cycle costs the verify forward and little more;
- HEAD: the draft head's tree, joined by those continuations where there are any (hybrid drafting).

Each arm's record is its recent tokens and milliseconds, a cycle's whole wall time (drafting,
verification, bookkeeping), decayed so that recent text counts most. Whether a lookup continuation
was found splits the records in two: a head cycle with a chain to merge is another bet than one
without, and the lookup arm exists only where there is a chain; a plain step costs the same either
way (its cost is the machine's), so the plain arm has one record. The next cycle takes the arm with
the best rate among those it can take, and each other arm is tried again after EXPLORE steps, twice
as many after each try that finds it still slower (up to LONGEST_WAIT), at once after a try whose
cycle beat the best; every arm is tried afresh at the start of each reply (its text may draft
otherwise), and a lookup continuation accepted at least PROMISING often is never passed over for
a plain step. The text changing kind (prose turning into code that quotes the prompt) shows as the
found/not found split and in the decayed records.

Every arm is exact, so output is unchanged: only the pace follows the measurements. Nothing here
imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
    EXPLORE, LONGEST_WAIT = 4, 32  # steps before another arm is tried again, doubling up to the longest
    PROMISING = 0.6  # a lookup continuation accepted at least this often is never passed over for a plain step

    def __init__(self, plain_ms: float, arms: tuple[Arm, ...] = (Arm.PLAIN, Arm.LOOKUP, Arm.HEAD)):
        """`plain_ms`: a plain step's cost until plain steps are timed (the verify-cost curve's one token);
        `arms`: those this drafter can take (PLAIN and at least one other)."""
        self.arms = arms
        self.plain_ms = plain_ms
        self.records: dict[tuple[Arm, bool], ArmRecord] = {}
        self.forget()
        self.records[(Arm.PLAIN, False)] = ArmRecord(1.0, plain_ms, wait=self.EXPLORE)

    def _record(self, arm: Arm, found: bool) -> ArmRecord:
        return self.records[(arm, found and arm is not Arm.PLAIN)]

    def candidates(self, found: bool, lookup_accept: float = 0.0) -> list[Arm]:
        """The arms the next cycle can take: LOOKUP only where a continuation was `found`, PLAIN not
        where it is likely accepted (`lookup_accept`: the best continuation's acceptance estimate)."""
        arms = [arm for arm in self.arms if arm is not Arm.LOOKUP or found]
        if lookup_accept >= self.PROMISING and len(arms) > 1:
            arms.remove(Arm.PLAIN)
        return arms

    def choose(self, found: bool, lookup_accept: float = 0.0) -> Arm:
        """The next cycle's arm: one never run yet (the most ambitious first), one whose wait is up
        (the longest overdue), else the fastest."""
        arms = self.candidates(found, lookup_accept)
        records = {arm: self._record(arm, found) for arm in arms}
        untried = [arm for arm in reversed(arms) if records[arm].rate is None]
        if untried:
            return untried[0]
        best = max(arms, key=lambda arm: records[arm].rate)
        due = [arm for arm in arms if arm is not best and records[arm].since >= records[arm].wait]
        return max(due, key=lambda arm: records[arm].since - records[arm].wait) if due else best

    def best_rate(self, found: bool, besides: Arm | None = None) -> float | None:
        """The best measured rate among the arms open with or without a continuation, `besides` left out."""
        rates = [self._record(arm, found).rate for arm in self.candidates(found) if arm is not besides]
        rates = [rate for rate in rates if rate is not None]
        return max(rates) if rates else None

    def learn(self, arm: Arm, found: bool, tokens: int, milliseconds: float) -> None:
        """A step's tokens and wall time, taken by `arm` where a continuation was (or was not) `found`."""
        record = self._record(arm, found)
        rival = self.best_rate(found, besides=arm)
        record.tokens = record.tokens * self.DECAY + tokens
        record.milliseconds = record.milliseconds * self.DECAY + milliseconds
        for other in self.records.values():
            other.since += 1
        record.since = 0
        if rival is None or record.rate >= rival:
            record.wait = self.EXPLORE
        elif tokens / milliseconds >= rival:  # this step beat the best: try again at once
            record.wait = 0
        else:
            record.wait = min(2 * max(record.wait, self.EXPLORE // 2), self.LONGEST_WAIT)

    def check_soon(self) -> None:
        """A new reply: every arm is tried again (its text may draft otherwise)."""
        for record in self.records.values():
            record.since = record.wait

    def forget(self) -> None:
        """What follows is unrelated: the drafting arms' records go (a plain step's cost stays: it is the machine's)."""
        for arm in self.arms:
            for found in (False, True):
                if arm is not Arm.PLAIN:
                    self.records[(arm, found)] = ArmRecord(wait=self.EXPLORE)
