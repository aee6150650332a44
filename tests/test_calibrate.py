"""The verify-cost curve and the tree size it picks."""

import json

import pytest

from conftest import load_tiny_target
from specchat.decode.runtime import calibrate
from specchat.decode.drafting.selection import Candidates
from specchat.decode.runtime.calibrate import SIZE_AGREES, Curve


def test_the_size_with_the_best_expected_rate_is_picked():
    curve = Curve({1: 100.0, 8: 104.0, 16: 109.0, 20: 130.0, 32: 108.0})
    assert curve.best_total_tokens() == 32  # flat again at 32 (kernel shapes): the largest tree pays
    assert Curve({1: 100.0, 4: 110.0, 8: 200.0}).best_total_tokens() == 4  # a steep curve: a small tree
    assert Curve({1: 100.0, 4: 300.0}).best_total_tokens() == 1  # verifying costs too much: no tree pays


def test_less_trusted_drafts_get_a_smaller_budget():
    avx2 = Curve({1: 22.6, 2: 23.5, 3: 26.4, 4: 31.0, 6: 42.8, 8: 46.0, 16: 73.7})  # docs/bench-cpu-avx2
    sizes = [avx2.best_total_tokens(trust) for trust in (1.0, 0.8, 0.6, 0.4, 0.2)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert avx2.best_total_tokens() == avx2.best_total_tokens(1.0)


class Load:
    """`machine.other_processes_share` as a test sets it: what the tests assert may not hang on what
    else the machine runs."""

    share = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_curve_is_measured_once_and_cached(qwen_dir, monkeypatch):
    monkeypatch.setattr(calibrate, "other_processes_share", Load)
    target = load_tiny_target(qwen_dir)
    calls = []
    real = calibrate.measure
    monkeypatch.setattr(calibrate, "measure", lambda t: calls.append(1) or real(t, sizes=(1, 4), repeats=1))
    first = calibrate.cached_curve(target)
    second = calibrate.cached_curve(target)
    assert calls == [1] and first.milliseconds == second.milliseconds and set(first.milliseconds) == {1, 4}


def test_sizes_are_timed_in_turn_and_the_fastest_run_kept(qwen_dir, monkeypatch):
    """A machine that slows down for a while slows every size alike instead of bending the curve."""
    target = load_tiny_target(qwen_dir)
    order, clock = [], [0.0]
    real_forward = target.forward

    def forward(ids, cache, **kwargs):  # each forward "takes" n ms, 50 ms more while the machine is slow
        order.append(ids.shape[1])
        slow = 4 <= len(order) <= 7
        clock[0] += (ids.shape[1] + 50 * slow) / 1000
        return real_forward(ids, cache, **kwargs)

    monkeypatch.setattr(target, "forward", forward)
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    curve = calibrate.measure(target, sizes=(1, 4, 6), context=8, repeats=3)
    assert order == [8] + [1, 4, 6] * 4  # the prefill, then the sizes in turn, round after round
    assert curve.milliseconds == {1: 1.0, 4: 4.0, 6: 6.0}


def _timed_curve(target, monkeypatch, milliseconds) -> tuple[Curve, list[int]]:
    """`measure` where a forward of n tokens takes `milliseconds(n, how many of them ran before)`."""
    order, clock = [], [0.0]
    real_forward = target.forward

    def forward(ids, cache, **kwargs):
        n = ids.shape[1]
        clock[0] += milliseconds(n, order.count(n)) / 1000
        order.append(n)
        return real_forward(ids, cache, **kwargs)

    monkeypatch.setattr(target, "forward", forward)
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    return calibrate.measure(target, sizes=(1, 4, 6, 8), context=8, repeats=3), order


def test_a_size_a_slow_moment_bent_the_curve_at_is_timed_again(qwen_dir, monkeypatch):
    """A size slowed in every round (another process woke with it) stands above the line between its
    neighbours; timed again, it takes its cost, and the sizes the curve was right about are not timed again."""
    target = load_tiny_target(qwen_dir)
    curve, order = _timed_curve(target, monkeypatch, lambda n, before: n + 3 * (n == 6 and before < 4))
    assert order == [8] + [1, 4, 6, 8] * 4 + [6]  # the prefill, the rounds, then 6 once more
    assert curve.milliseconds == {1: 1.0, 4: 4.0, 6: 6.0, 8: 8.0}
    assert calibrate.bumps({1: 10.0, 4: 16.0, 6: 23.0, 8: 22.0}) == [6]  # 6 above the line from 4 to 8 (19) by 21%
    assert calibrate.bumps({1: 10.0, 4: 16.0, 6: 20.0, 8: 22.0}) == []  # by 5%: a kernel's shape, not a slow moment


def test_a_kernel_s_real_step_stays_after_a_few_more_forwards(qwen_dir, monkeypatch):
    """A size that costs what the next one does (a kernel's tiling: 6 rows take one pass of 8) stands
    above the line every time it is timed: it keeps its cost, after RETIMES more forwards."""
    target = load_tiny_target(qwen_dir)
    curve, order = _timed_curve(target, monkeypatch, lambda n, before: 8 if n == 6 else n)
    assert order == [8] + [1, 4, 6, 8] * 4 + [6] * calibrate.RETIMES
    assert curve.milliseconds == {1: 1.0, 4: 4.0, 6: 8.0, 8: 8.0}


def test_a_poisoned_curve_is_replaced_within_the_first_reply(qwen_dir, monkeypatch):
    """A curve measured on a busy machine (monotonic, so it is not measured again at load) is far
    dearer than what live verify forwards take: the first reply rescales it, and drops it from the
    cache, so that the next start measures it again."""
    from conftest import random_head
    from specchat.decode.engine.engine import Engine, GenerationSettings
    from specchat.decode.drafting import heads
    from specchat.decode.drafting.lookup import LookupSource
    from specchat.decode.drafting.shapes import DynamicTree, DynamicTreeParams

    target = load_tiny_target(qwen_dir)
    path = calibrate.cache_dir() / "verify-cost.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    poisoned = {1: 2000.0, 2: 2100.0, 4: 2400.0, 8: 3000.0, 16: 4500.0}
    path.write_text(json.dumps({calibrate._key(target): poisoned}))
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("a plausible stored curve is not measured"))
    curve = calibrate.cached_curve(target)
    assert curve.milliseconds == poisoned
    proposer = heads.for_target(random_head("eagle3", target), target, DynamicTree(DynamicTreeParams(4, 3, 2)),
                                lookup=LookupSource(), curve=curve)
    steps = list(Engine(target, proposer).generate([258, 10, 20, 30, 40], GenerationSettings(max_new_tokens=24)))
    assert sum(step.draft_tokens > 0 for step in steps) >= calibrate.LIVE_EVIDENCE
    assert curve.milliseconds[1] < 0.1 * poisoned[1]  # tiny-model forwards take milliseconds
    assert calibrate._key(target) not in json.loads(path.read_text())
    measured = {1: 2.0, 2: 2.1, 4: 2.4, 8: 3.0, 16: 4.5}
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: Curve(dict(measured)))
    monkeypatch.setattr(calibrate, "other_processes_share", Load)
    assert calibrate.cached_curve(load_tiny_target(qwen_dir)).milliseconds == measured  # the next start


def test_a_curve_measured_on_a_busy_machine_or_of_no_machine_s_shape_is_not_kept(qwen_dir, monkeypatch):
    """Not kept: measured again at the next start (a target loaded again), and taken as it is by the
    same start's later calls (a tree's size, then its proposer), not measured twice."""
    shapes = iter([{1: 10.0, 4: 120.0, 8: 30.0}, {1: 10.0, 4: 12.0, 8: 15.0}, {1: 10.0, 4: 12.0, 8: 15.0}])
    measured = []
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: measured.append(1) or Curve(next(shapes)))
    monkeypatch.setattr(calibrate, "other_processes_share", Load)
    first_start = load_tiny_target(qwen_dir)
    first = calibrate.cached_curve(first_start)  # 4 tokens dearer per token than 1: not kept, made monotonic
    assert first.milliseconds == {1: 10.0, 4: 120.0, 8: 120.0}
    assert calibrate.cached_curve(first_start) is first and len(measured) == 1  # the same start: not measured again
    monkeypatch.setattr(Load, "share", 0.5)
    second = calibrate.cached_curve(load_tiny_target(qwen_dir))
    assert second.milliseconds == {1: 10.0, 4: 12.0, 8: 15.0} and len(measured) == 2  # measured again, not kept
    monkeypatch.setattr(Load, "share", 0.0)
    third = calibrate.cached_curve(load_tiny_target(qwen_dir))
    assert third.milliseconds == {1: 10.0, 4: 12.0, 8: 15.0} and len(measured) == 3  # measured again, kept
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("kept: not measured again"))
    assert calibrate.cached_curve(load_tiny_target(qwen_dir)).milliseconds == {1: 10.0, 4: 12.0, 8: 15.0}


def test_live_forwards_rescale_a_curve_they_contradict_and_a_stored_one_too_dear_is_dropped():
    dropped = []
    curve = Curve({1: 10.0, 4: 20.0}, on_too_dear=lambda: dropped.append(True))
    for _ in range(calibrate.LIVE_EVIDENCE):
        curve.observe(4, 21.0)  # agrees: nothing changes
    assert curve.milliseconds == {1: 10.0, 4: 20.0} and not dropped
    assert curve.cost(2) == pytest.approx(10 + 10 / 3)
    for _ in range(calibrate.LIVE_EVIDENCE):
        curve.observe(4, 60.0)  # the machine is busy now: dearer for this session
    assert curve.milliseconds == {1: 30.0, 4: 60.0} and not dropped
    assert curve.cost(2) == pytest.approx(40.0)  # the costs read before are not reused
    for _ in range(calibrate.LIVE_EVIDENCE):
        curve.observe(4, 6.0)
    assert curve.milliseconds == {1: 3.0, 4: 6.0} and dropped == [True]  # 0.3x the stored curve: dropped, once
    assert curve.cost(2) == pytest.approx(4.0) and curve.cost(8) == pytest.approx(10.0)
    assert curve.stored == {1: 10.0, 4: 20.0}


def test_a_curve_made_dearer_by_a_busy_spell_and_cheaper_again_is_not_dropped():
    """Live forwards three times the curve (the machine busy) make it dearer for the session; once the
    machine is quiet, forwards at half that rescaled curve make it cheaper again, which is still 1.5x
    what was measured: the stored curve stays."""
    dropped = []
    curve = Curve({1: 10.0, 4: 20.0}, on_too_dear=lambda: dropped.append(True))
    for _ in range(calibrate.LIVE_EVIDENCE):
        curve.observe(4, 60.0)
    for _ in range(calibrate.LIVE_EVIDENCE):
        curve.observe(4, 30.0)
    assert curve.milliseconds == {1: 15.0, 4: 30.0}  # this session's
    assert not dropped and curve.stored == {1: 10.0, 4: 20.0}


def test_a_curve_wrong_in_its_shape_takes_the_live_level_and_a_size_still_off_heals_alone():
    """A curve stored on a Zen 3 (40.6 ms for one token, 52.5 for four) where live forwards took
    0.42-0.69 of it. Its level follows the median of the live ratios; one token, still 0.63x the curve
    at that level (outside SIZE_AGREES), heals alone, the sizes either side kept monotonic around it;
    for this session only."""
    dropped = []
    stored = {1: 40.56, 2: 47.75, 3: 44.95, 4: 52.48, 6: 74.89, 8: 108.73}
    curve = Curve(dict(stored), on_too_dear=lambda: dropped.append(True))
    live = {3: 30.0, 4: 36.0, 1: 17.0}
    for n, ms in live.items():
        curve.observe(n, ms)
    level = 30.0 / 44.95  # the median ratio
    assert curve.level == pytest.approx(level) and curve.milliseconds[8] == round(stored[8] * level, 2)
    settling = -(-calibrate.SETTLES_AFTER // len(live))  # rounds before a forward settles
    for _ in range(calibrate.LIVE_EVIDENCE + settling):
        for n, ms in live.items():
            curve.observe(n, ms)
    assert curve.level == pytest.approx(level)  # the same median: no level moved
    assert curve.milliseconds[1] == pytest.approx(17.0, abs=0.01)  # healed
    for n in (3, 4):
        assert SIZE_AGREES[0] <= live[n] / curve.milliseconds[n] <= SIZE_AGREES[1]  # agree: kept
    assert curve.milliseconds[6] == round(stored[6] * level, 2) and curve.milliseconds[8] == round(stored[8] * level, 2)
    assert list(curve.milliseconds.values()) == sorted(curve.milliseconds.values())  # (2 stored dearer than 3)
    before = dict(curve.milliseconds)
    for _ in range(calibrate.LIVE_EVIDENCE):
        curve.observe(4, 37.0)  # within SIZE_AGREES, and the median level within LEVEL_MOVES: nothing changes
    assert curve.milliseconds == before
    assert not dropped and curve.stored == stored  # the shape's healing is this session's


def test_sizes_seen_at_different_moments_move_the_level_and_keep_the_shape(monkeypatch, qwen_dir):
    """A VM whose speed swings 1.4x (the same one-token forward 8.6 and 12.3 ms minutes apart, a 2-core
    Zen 4), each size verified at its own moment: the session's curve keeps the measured shape at the
    latest level, where each size's healing at its moment bent it apart (11.7 ms for 1 to 3 tokens,
    21.9 for 4, in a bench on the Zen 4); and the stored curve, as measured, is what the next start reads."""
    measured = {1: 12.65, 2: 13.24, 4: 15.19, 8: 20.88}
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: Curve(dict(measured)))
    monkeypatch.setattr(calibrate, "other_processes_share", Load)
    curve = calibrate.cached_curve(load_tiny_target(qwen_dir))
    for n, ms in ((1, 8.6), (2, 9.1), (1, 12.3), (4, 11.0), (8, 15.2)):  # fast and slow moments, size by size
        for _ in range(calibrate.LIVE_EVIDENCE):
            curve.observe(n, ms)
    assert curve.level == pytest.approx(15.2 / 20.88, rel=0.1)
    assert all(curve.milliseconds[n] == round(ms * curve.level, 2) for n, ms in measured.items())
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("stored: not measured again"))
    assert calibrate.cached_curve(load_tiny_target(qwen_dir)).milliseconds == measured


def test_another_process_s_work_is_seen_as_the_machine_being_busy():
    import os
    import subprocess
    import sys
    import time

    from specchat.decode.runtime.machine import other_processes_share

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc here: the share cannot be told (and counts as 0)")
    with other_processes_share() as quiet:
        time.sleep(0.3)
    with other_processes_share() as busy:  # a child spins one core for a second while this one sleeps
        subprocess.run([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1: pass"], check=True)
    assert busy.share > 0.5 / os.cpu_count() and 0.0 <= quiet.share <= 1.0


def _copy_cycles(curve: Curve, live: dict[int, float], cycles: int, speed=lambda cycle: 1.0) -> list[int]:
    """`cycles` selections of a long, well-trusted lookup chain under `curve`, each verified at the
    live cost of its size (interpolated between `live`'s sizes, times the machine's `speed` at that
    cycle): the verified sizes, root included."""
    true = Curve(dict(live))
    sizes = []
    for cycle in range(cycles):
        chain = Candidates([], [], [], [], [])
        chain.add_chain(list(range(16)), [0.95] * 16, [20] * 16)
        size = len(chain.select_for_rate(curve, 0.0, 16, kept=[0])) + 1
        curve.observe(size, true.cost(size) * speed(cycle))
        sizes.append(size)
    return sizes


def test_a_curve_too_dear_past_the_sizes_it_lets_be_verified_is_probed_and_heals_within_a_reply():
    """A curve measured while another process started (2 tokens 27 ms, 3 tokens 68, the real cost 31:
    a benchmark on a Zen 3) never lets 3 tokens be verified, so without probes no live forward
    would ever contradict it. Probes verify the next size up now and then: within a reply's cycles
    the tail heals and long copies are verified at their worth."""
    live = {1: 20.0, 2: 25.0, 3: 31.0, 4: 40.0, 6: 56.0, 8: 66.0, 12: 93.0, 16: 117.0}
    dear = Curve({1: 20.3, 2: 27.4, 3: 68.1, 4: 93.4, 6: 137.8, 8: 194.5, 12: 279.6, 16: 415.3})
    without = Curve(dict(dear.milliseconds))
    without.probe = lambda expected, drafting_ms, best: best  # what selection did before probes
    assert max(_copy_cycles(without, live, 128)) == 2
    sizes = _copy_cycles(dear, live, 128)
    every = calibrate.PROBE_EVERY
    assert sizes[:every] == [2] * (every - 1) + [3]  # the first probe
    assert min(sizes[-16:]) >= 8  # healed: the copy is verified far, as the real costs make it pay
    for n in (3, 4, 6, 8):  # each probed, each now within what a size's healing tolerates
        assert calibrate.SIZE_AGREES[0] <= live[n] / dear.milliseconds[n] <= calibrate.SIZE_AGREES[1]


def test_a_too_dear_tail_heals_while_the_machine_s_speed_swings():
    """The same curve on a VM whose speed swings (a 2-core Zen 4's forwards took 1x and 1.35x in turns,
    minutes apart; here every 12 cycles): each swing moves the curve's level, and the probes and a
    probed size's healing go on across the moves, so the tail still heals within a long reply."""
    live = {1: 20.0, 2: 25.0, 3: 31.0, 4: 40.0, 6: 56.0, 8: 66.0, 12: 93.0, 16: 117.0}
    dear = Curve({1: 20.3, 2: 27.4, 3: 68.1, 4: 93.4, 6: 137.8, 8: 194.5, 12: 279.6, 16: 415.3})
    levels = set()
    observe = dear.observe
    dear.observe = lambda n, ms: (observe(n, ms), levels.add(dear.level))
    sizes = _copy_cycles(dear, live, 256, speed=lambda cycle: 1.35 if cycle // 12 % 2 else 1.0)
    assert len(levels) > 2  # the level moved with the swings
    assert min(sizes[-24:]) >= 8  # healed: the copy is verified far, as the real costs make it pay


def test_a_right_curve_costs_a_few_probes_of_the_sizes_just_past_its_best():
    """On a right curve, probes check each size above those chosen as long as it could pay even at the
    size below's cost, find each as the curve says (3 live forwards each), and stop."""
    live = {1: 20.0, 2: 25.0, 3: 31.0, 4: 40.0, 6: 56.0, 8: 66.0, 12: 93.0, 16: 117.0}
    steep = {n: ms * n for n, ms in live.items()}  # verifying more costs too much: one token a cycle
    curve = Curve(dict(steep))
    sizes = _copy_cycles(curve, steep, 20 * calibrate.PROBE_EVERY)
    assert sizes.count(3) == sizes.count(4) == calibrate.LIVE_EVIDENCE and set(sizes) == {2, 3, 4}
    assert curve.milliseconds == steep


def test_the_cache_keeps_the_newest_curves_only(tmp_path, monkeypatch):
    """A changed kernel or thread count keys every model anew: the cache keeps the KEPT_CURVES newest
    measured and drops the oldest, whatever else wrote it; a curve dropped goes alone."""
    path = tmp_path / "verify-cost.json"
    monkeypatch.setattr(calibrate, "KEPT_CURVES", 3)
    for n in range(5):
        calibrate._keep(path, f"model-{n}", {1: float(n + 1)})
    calibrate._keep(path, "model-2", {1: 9.0})  # measured again: the newest now
    assert list(json.loads(path.read_text())) == ["model-3", "model-4", "model-2"]
    calibrate._drop(path, "model-4")
    calibrate._drop(path, "model-9")  # (none such: nothing changes)
    assert json.loads(path.read_text()) == {"model-3": {"1": 4.0}, "model-2": {"1": 9.0}}
