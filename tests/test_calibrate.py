"""The verify-cost curve and the tree size it picks."""

from conftest import load_tiny_target
from specchat.decode import calibrate
from specchat.decode.calibrate import Curve


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


def test_the_curve_is_measured_once_and_cached(qwen_dir, monkeypatch):
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
