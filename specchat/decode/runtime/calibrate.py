"""What one target forward costs on this machine, by number of tokens: the verify-cost curve.

A forward over a handful of tokens costs about what one costs while reading the weights
dominates; past that, cost grows with the tokens, how fast depending on the runtime (bf16 with
AMX stays nearly flat to 32 tokens, a 5-bit model on AVX-512 costs 1.4x at 8). A larger tree
gets more tokens accepted, with diminishing returns, so the verified size is the one that
maximizes expected tokens per second under this machine's curve. The curve is measured once per
(machine, model, dtype, quantization and kernel version, threads) and cached.

A curve is only as good as the machine was quiet while it was measured: another process on the same
cores made one 5-40x too dear and non-monotonic (an AVX2 host's: 4 tokens 198 ms, 20 tokens 2,690),
and every later start planned trees on it. So a measurement during which other processes used more
than BUSY_SHARE of the CPU (/proc/stat against this process's own time), or whose shape no machine
has (`implausible`), is used for this session but not kept; a stored curve of such a shape is
measured again; and the engine's live verify forwards (`Curve.observe`) set the curve's level for
this session: the median of the latest ones' ratios to it (the machine's speed of the moment, the
context's length), one factor for every size. A stored curve that live times find too dear as a
whole (it was measured while the machine was busier than the busy check saw) is dropped from the
cache, to be measured again at the next start: what the cache holds is always a measurement.

A curve can be wrong in its shape while right on average: one stored on a Zen 3 took 40.6 ms for
one token and 52.5 for four where live forwards took 17 and 32 (0.42x and 0.62x: its median ratio
stayed inside the bounds of the whole-curve rescaling then, and every later start planned on it).
So each measured size is also held to the live forwards of its own size, each against the curve at
the level of its moment: a size they contradict by more than SIZE_AGREES takes their median, the
sizes either side kept monotonic around it (a size the curve makes too dear is probed, below).

A size measured too dear by less than SIZE_AGREES is never corrected at all: at a long context live
forwards cost as much more, so they agree with it. One stored on the Xeon's AVX2 path took 74 ms
for 16 tokens between 50.7 for 12 and 91.5 for 24 (measured again: 63.5), and the rate rule cut
every lookup chain of a rewrite at 11 tokens: rewrite10 decoded at τ 3.97, 2.13x plain, with it
and at τ 4.45, 2.27x, with the curve measured again (two runs, 2026-11-30). So a size measured
more than BUMP above the line between its neighbours is timed again (`bumps`): a forward's true
cost is the larger of reading the weights and the rows' arithmetic, a convex curve, and a run can
only be slowed, so a size above that line was most likely slowed; a kernel's real step (the
AVX-512 path's 6 tokens cost what 8 do) stays, after RETIMES more forwards.

Nothing live forwards find is kept but that a stored curve is too dear: each size heals at its own
moment and context, and a cloud VM's speed swings (the same one-token forward took 8.6 ms and 12.3
ms minutes apart on a 2-core Zen 4). Kept where each size was healed cheapest, and the whole curve
where rescaled cheaper, a curve drifts from any moment's costs: over one run of the drafts' benches
the Zen 4's stored curve came to say 6.35 ms for one token and 9.51 for two, where one took 8.6-12.7
live and a measurement gave 12.65 and 13.24, and small trees looked cheap: general10 decoded at τ
1.83, 1.40x plain, on it and at τ 2.06, 1.52x, on the curve measured again (one interleaved run
each, 2026-12-01); with only the sizes' healing unkept, the whole curve's rescaling of a session's
healed curve stored 5.06 ms for one token and 11.97 for three, four and six (measured: 12.1, 13.5,
14.4 and 17.0). Within a session alike: sizes healed each against its own moment's absolute costs
bent a bench's curve apart (11.7 ms for one to three tokens, 21.9 for four, 23.4 for six and eight),
hence the level, which a moment's speed moves for every size at once. A live forward counts for its
size's healing once SETTLES_AFTER more have come without moving the level (after a swing the level
moves at the third forward of the new speed: the two before it were judged against the level gone,
and are dropped), and the settled ones stay across the level's moves: cleared at every move, on the
Zen 4 VM (128 moves over 1,586 live forwards of a humaneval20 bench) a size only probes verify never
gathered the evidence that heals it, and most probes re-checked sizes already seen.

A size the curve makes too dear is never chosen, so no live forward would ever correct it: a curve
measured while another process started (3 tokens 68 ms where 2 took 27, the real cost 31) kept a
whole benchmark's trees to two nodes. So every PROBE_EVERY cycles the selection verifies the next
measured size above those live forwards have confirmed, where the drafts at hand reach it and it
would pay even at the cost of the size below it (`Curve.probe`): a wrong tail heals within a reply,
and a right curve costs a few probes of the sizes just past its best, once a chat.
"""

from __future__ import annotations

import collections
import logging
import json
import math
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specchat.decode.runtime import woq_kernel
from specchat.decode.runtime.cache import causal_mask
from specchat.decode.runtime.machine import (cache_dir, device_name, other_processes_share, replace_atomically,
                                             synchronize)
from specchat.decode.options import KERNEL_BITS

log = logging.getLogger(__name__)

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the small ones: where each token costs much (AVX2)
CONTEXT = 256  # tokens already cached while timing (a typical chat turn)
# Rounds kept (the fastest of them): few, since it is timed on a user's first start and live
# verify forwards correct it afterwards (`Curve.observe`); 3 rounds took 4 s on a 2-core Zen 3.
REPEATS = 3
# Expected tokens per cycle with a verified tree of n tokens, tau(n) = 1 + TAU_PER_DOUBLING * log2(n),
# and drafting's cost per cycle as a share of one plain forward: both measured with the bundled
# EAGLE-3 head under deagle on a 2-core AVX-512 CPU (tau 1.58 / 1.70 / 1.85 at 4 / 8 / 16 tokens,
# drafting ~6.5 ms against ~20 ms per plain forward; docs/cpu-runtime.md).
TAU_PER_DOUBLING = 0.22
DRAFT_SHARE = 1 / 3
BUSY_SHARE = 0.15  # other processes' share of the CPU while measuring above which the curve is not kept
# Live verify forwards: the median ratio of the latest LIVE_WINDOW to the curve, once LIVE_EVIDENCE are in,
# sets its level (`Curve.observe`); a size's own, against the curve of their moment, heal it (`SIZE_AGREES`)
LIVE_WINDOW, LIVE_EVIDENCE = 5, 3
LEVEL_MOVES = 1.1  # the curve's level follows the live median once it moves by more than this factor
# A live forward heals its size once this many more have come without moving the level: after a swing of the
# machine's speed the median of LIVE_WINDOW moves at the third forward of the new speed, so the two before it,
# judged against the level gone, are dropped instead (`Curve.observe`)
SETTLES_AFTER = 3
TOO_CHEAP = 0.6  # a stored curve live forwards take less than this share of is dropped (measured again)
SIZE_AGREES = (0.75, 1.33)  # a measured size's live median ratio outside these heals it (`Curve.observe`)
BUMP, RETIMES = 1.1, 3  # a size measured this much above the line between its neighbours is timed again, up to
# RETIMES more times (`measure`)
# In the cache's key: curves stored before sizes were timed again, or before the cache held measurements
# only (up to "retimed", live forwards' healing and rescaling were kept), are measured again
CURVE_METHOD = "measured-only"
KEPT_CURVES = 32  # curves the cache keeps, the most recently measured
PROBE_EVERY = 8  # cycles between probes of the size above those live forwards have confirmed (`Curve.probe`)


@dataclass
class Curve:
    milliseconds: dict[int, float]  # this session's costs: `shape` at `level`, made monotonic
    # Called once when live forwards show the curve as stored too dear as a whole (`cached_curve` then
    # drops it from the cache, to be measured again); None: nothing stored.
    on_too_dear: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    stored: dict[int, float] = field(init=False, repr=False, compare=False)  # as read or measured: never changed
    # The stored curve with the sizes healed (`_heal_size`): the costs' shape, at the stored curve's speed
    shape: dict[int, float] = field(init=False, repr=False, compare=False)
    level: float = field(default=1.0, repr=False, compare=False)  # this session's speed against `shape`
    live: list[float] = field(default_factory=list, repr=False, compare=False)  # latest live times / shape's
    against_stored: list[float] = field(default_factory=list, repr=False, compare=False)  # ... / the stored curve's
    # per measured size, its latest settled live forwards against the curve of their moment (a size is here once
    # one has settled: SETTLES_AFTER)
    live_by_size: dict[int, list[float]] = field(default_factory=dict, repr=False, compare=False)
    # the latest live forwards not yet settled, oldest first: (n, milliseconds), all at this level (a move drops them)
    unsettled: list[tuple[int, float]] = field(default_factory=list, repr=False, compare=False)
    cycles: int = field(default=0, repr=False, compare=False)  # selections seen (`probe`)
    # `cost` by n for the `milliseconds` it was read from: the rate rules ask for a dozen sizes at each
    # draft level (the dict is replaced when the curve changes, never changed in place)
    _costs: tuple[dict[int, float], dict[int, float]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.stored, self.shape = dict(self.milliseconds), dict(self.milliseconds)
        self._costs = (self.milliseconds, {})

    def observe(self, n: int, milliseconds: float) -> None:
        """A live forward of n tokens (a verify step) took `milliseconds`. The curve's level follows the
        median of the latest ones' ratios to its shape; a measured size whose own forwards contradict
        the curve of their moment is healed; a stored curve they find too dear is dropped (see the
        module docstring)."""
        if self.on_too_dear is not None:  # (nothing to drop: a curve not stored, or dropped already)
            self.against_stored.append(milliseconds / interpolated(self.stored, n))
            del self.against_stored[:-LIVE_WINDOW]
            stored = statistics.median(self.against_stored)
            if len(self.against_stored) >= LIVE_EVIDENCE and stored < TOO_CHEAP:
                log.info(f"live verify forwards take {stored:.2f}x the stored verify-cost curve's: it is measured "
                         f"again at the next start")
                self.on_too_dear()
                self.on_too_dear = None
        at_shape = milliseconds / interpolated(self.shape, n)
        self.live.append(at_shape)
        del self.live[:-LIVE_WINDOW]
        level = statistics.median(self.live)
        if len(self.live) >= LIVE_EVIDENCE and not 1 / LEVEL_MOVES <= level / self.level <= LEVEL_MOVES:
            log.debug(f"live verify forwards take {level:.2f}x the cost curve's shape: its level now")
            self.level = level
            # The level lags the machine's speed by a few forwards: the unsettled ones may have been judged
            # against the level gone. The settled ones stay, each judged against the level of its moment
            # (cleared at every move, a VM's sizes lost their evidence every ~12 forwards, and a size verified
            # only by probes, one every PROBE_EVERY cycles, never gathered the LIVE_EVIDENCE that heals it).
            self.unsettled.clear()
            self._rebuild()
        elif n in self.shape:
            self.unsettled.append((n, milliseconds))
            if len(self.unsettled) > SETTLES_AFTER:  # judged against the shape as healed since
                settled, settled_ms = self.unsettled.pop(0)
                self._heal_size(settled, settled_ms / self.shape[settled] / self.level)

    def _heal_size(self, n: int, ratio: float) -> None:
        """Size n's forward took `ratio` times the curve's cost (settled: `observe`): where the median of
        its latest ones is outside SIZE_AGREES, its shape takes them, and the sizes either side of it keep
        the curve monotonic around it. For this session only (the module docstring)."""
        recent = self.live_by_size.setdefault(n, [])
        recent.append(ratio)
        del recent[:-LIVE_WINDOW]
        median = statistics.median(recent)
        if len(recent) < LIVE_EVIDENCE or SIZE_AGREES[0] <= median <= SIZE_AGREES[1]:
            return
        log.debug(f"live verify forwards of {n} tokens take {median:.2f}x the cost curve's: healed")
        healed = self.shape[n] * median
        self.shape = {size: min(ms, healed) if size < n else healed if size == n else max(ms, healed)
                      for size, ms in self.shape.items()}
        recent.clear()
        self._rebuild()

    def _rebuild(self) -> None:
        """`milliseconds`: the shape at this level, no smaller size dearer than a larger one."""
        ceiling, costs = math.inf, {}
        for size in sorted(self.shape, reverse=True):
            ceiling = costs[size] = round(min(self.shape[size] * self.level, ceiling), 2)
        self.milliseconds = dict(sorted(costs.items()))

    def probe(self, expected: dict[int, float], drafting_ms: float, best: int) -> int:
        """The tokens to verify this cycle: `best`, the size the rate rule chose (`expected`: tokens by
        tokens verified, the root included; `drafting_ms`: the cycle's drafting so far); or, every
        PROBE_EVERY cycles, the smallest measured size above every size LIVE_EVIDENCE live forwards of
        its own have confirmed, where the drafts at hand reach it and it would beat the best even at
        the least it can cost (what the largest confirmed size costs: no forward costs less than a
        smaller one's). See the module docstring."""
        self.cycles += 1
        if self.cycles % PROBE_EVERY:
            return best
        seen = collections.Counter({n: len(recent) for n, recent in self.live_by_size.items()})
        seen.update(n for n, _ in self.unsettled)  # each size's live forwards, settled or not
        confirmed = max((n for n, count in seen.items() if count >= LIVE_EVIDENCE), default=1)
        size = min((n for n in self.milliseconds if n > confirmed), default=None)
        if size is None or size <= best or size not in expected:
            return best
        best_rate = expected[best] / (drafting_ms + self.cost(best))
        return size if expected[size] / (drafting_ms + self.cost(confirmed)) > best_rate else best

    def expected_rate(self, n: int, trust: float = 1.0) -> float:
        """Modelled tokens per millisecond when n tokens are verified per cycle; `trust` scales the
        drafts' acceptance (below 1 where fewer survive than the model assumes, as under sampling)."""
        tau = 1 + trust * TAU_PER_DOUBLING * math.log2(n)
        return tau / (self.milliseconds[n] + DRAFT_SHARE * self.milliseconds[1])

    @property
    def largest(self) -> int:
        return max(self.milliseconds)

    def cost(self, n: int) -> float:
        """Milliseconds for a forward of n tokens: interpolated between measured sizes, extended
        linearly past the largest."""
        read_from, costs = self._costs
        if read_from is not self.milliseconds:
            read_from, costs = self._costs = (self.milliseconds, {})
        if n not in costs:
            costs[n] = interpolated(self.milliseconds, n)
        return costs[n]

    def best_total_tokens(self, trust: float = 1.0) -> int:
        return max(self.milliseconds, key=lambda n: (self.expected_rate(n, trust), -n))


def interpolated(milliseconds: dict[int, float], n: int) -> float:
    """A forward of n tokens under measured `milliseconds` by size: between the sizes either side, or
    extended linearly past the largest."""
    sizes = sorted(milliseconds)
    if n <= sizes[0]:
        return milliseconds[sizes[0]]
    for low, high in zip(sizes, sizes[1:]):
        if n <= high:
            share = (n - low) / (high - low)
            return milliseconds[low] + share * (milliseconds[high] - milliseconds[low])
    low, high = sizes[-2], sizes[-1]
    slope = (milliseconds[high] - milliseconds[low]) / (high - low)
    return milliseconds[high] + slope * (n - high)


def _key(target) -> str:
    runtime = target.spec.quantize
    if runtime in KERNEL_BITS:  # specchat's kernel: a changed kernel is timed again
        runtime += f"-{woq_kernel.kernel_version()}"
    runtime += "-compiled" if target.compiled else ""
    sizes = "-".join(map(str, SIZES))  # a curve measured at other sizes is measured again
    return (f"{target.name}|{str(target.dtype)}|{runtime}|{device_name(target.device)}|{torch.get_num_threads()}|{sizes}"
            f"|{CURVE_METHOD}")


@torch.inference_mode()
def measure(target, sizes=SIZES, context: int = CONTEXT, repeats: int = REPEATS) -> Curve:
    """Each size timed `repeats` times, the sizes taken in turn each round and the fastest run kept:
    a small VM's speed drifts by 20-30% within seconds, and timing one size after another folded
    that drift into the curve's shape (6 tokens measured dearer than 8 in one run, cheaper in the next)."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, len(target.tokenizer))
    cache = target.new_cache()
    target.forward(torch.randint(0, vocab, (1, context), generator=generator).to(target.device), cache, logits_for="none")
    inputs = {n: (torch.randint(0, vocab, (1, n), generator=generator).to(target.device),
                  torch.arange(context, context + n, device=target.device)[None],
                  causal_mask(context, n, target.device)) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}

    def timed(n: int) -> None:
        ids, positions, mask = inputs[n]
        synchronize(target.device)
        start = time.perf_counter()
        target.forward(ids, cache, positions=positions, mask=mask, logits_for="all")
        synchronize(target.device)
        times[n].append(time.perf_counter() - start)
        cache.trim(context)

    def fastest() -> dict[int, float]:
        return {n: round(min(runs[1:]) * 1000, 2) for n, runs in times.items()}

    for _ in range(repeats + 1):  # the first round warms kernels up and is not counted
        for n in sizes:
            timed(n)
    for _ in range(RETIMES):  # a size a slow moment bent the curve at is timed again
        if not (suspects := bumps(fastest())):
            break
        for n in suspects:
            timed(n)
    return Curve(fastest())


def bumps(milliseconds: dict[int, float]) -> list[int]:
    """The sizes measured more than BUMP above the line between the sizes either side of them."""
    sizes = sorted(milliseconds)
    return [n for low, n, high in zip(sizes, sizes[1:], sizes[2:])
            if milliseconds[n] > BUMP * (milliseconds[low] + (n - low) / (high - low)
                                         * (milliseconds[high] - milliseconds[low]))]


def implausible(milliseconds: dict[int, float]) -> str | None:
    """What no quiet machine measures, or None: a larger forward costing less than half a smaller one,
    or more than 1.5x as much per token (kernel tilings make curves only mildly non-monotonic)."""
    sizes = sorted(milliseconds)
    for small, large in zip(sizes, sizes[1:]):
        if milliseconds[large] < 0.5 * milliseconds[small]:
            return f"{large} tokens measured cheaper than half of {small}"
        if milliseconds[large] > 1.5 * large / small * milliseconds[small]:
            return f"{large} tokens measured dearer per token than {small}"
    return None


# A curve not kept is measured again at the next start, not at the next call of the same start: a
# tree's size and then its proposer ask for it (two measurements, each seconds, on a machine already busy).
_unkept_this_start: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its curve


def cached_curve(target) -> Curve:
    """The curve for this machine and target, measured on first use (a few seconds), kept unless the
    machine was busy meanwhile or the curve's shape is implausible (the module docstring)."""
    if (unkept := _unkept_this_start.get(target)) is not None:
        return unkept
    path = cache_dir() / "verify-cost.json"
    key = _key(target)
    stored = _read(path).get(key)
    if stored is not None and not implausible({int(n): ms for n, ms in stored.items()}):
        return Curve({int(n): ms for n, ms in stored.items()}, on_too_dear=lambda: _drop(path, key))
    log.info("measuring what verifying n tokens costs on this machine once (seconds)...")
    with other_processes_share() as busy:
        curve = measure(target)
    reason = implausible(curve.milliseconds) or (
        f"other processes used {busy.share:.0%} of the CPU meanwhile" if busy.share > BUSY_SHARE else None)
    if reason is None:
        _keep(path, key, curve.milliseconds)
        curve.on_too_dear = lambda: _drop(path, key)
    else:
        log.warning(f"the verify-cost curve is used for now but not kept ({reason}): it is measured again at the next "
                    f"start, and live verify forwards correct it meanwhile")
        # A curve made monotonic, so that an outlier does not make a size look free.
        running = 0.0
        curve.milliseconds = {n: (running := max(running, ms)) for n, ms in sorted(curve.milliseconds.items())}
        curve.stored, curve.shape = dict(curve.milliseconds), dict(curve.milliseconds)
        _unkept_this_start[target] = curve
    return curve


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _keep(path, key: str, milliseconds: dict[int, float]) -> None:
    """Store a measured curve under `key` (read again first: another process may have stored other
    keys), the newest last; the oldest beyond KEPT_CURVES go (a changed kernel or thread count keys
    every model anew, and a model folder that is gone leaves its key behind)."""
    known = _read(path)
    known.pop(key, None)
    known[key] = milliseconds
    _write(path, dict(list(known.items())[-KEPT_CURVES:]))


def _drop(path, key: str) -> None:
    """The curve under `key` goes (read again first, as in `_keep`): the next start measures it again."""
    known = _read(path)
    if known.pop(key, None) is not None:
        _write(path, known)


def _write(path, curves: dict) -> None:
    replace_atomically(path, lambda partial: partial.write_text(json.dumps(curves, indent=1)))
