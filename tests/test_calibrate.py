"""The verify-cost curve and the tree size it picks."""

from conftest import load_tiny_target
from specchat import calibrate
from specchat.calibrate import Curve


def test_the_size_with_the_best_expected_rate_is_picked():
    curve = Curve({1: 100.0, 8: 104.0, 16: 109.0, 20: 130.0, 32: 108.0})
    assert curve.best_total_tokens() == 32  # flat again at 32 (kernel shapes): the largest tree pays
    assert Curve({1: 100.0, 4: 110.0, 8: 200.0}).best_total_tokens() == 4  # a steep curve: a small tree
    assert Curve({1: 100.0, 4: 300.0}).best_total_tokens() == 1  # verifying costs too much: no tree pays


def test_the_curve_is_measured_once_and_cached(qwen_dir, monkeypatch):
    target = load_tiny_target(qwen_dir)
    calls = []
    real = calibrate.measure
    monkeypatch.setattr(calibrate, "measure", lambda t: calls.append(1) or real(t, sizes=(1, 4), repeats=1))
    first = calibrate.cached_curve(target)
    second = calibrate.cached_curve(target)
    assert calls == [1] and first.milliseconds == second.milliseconds and set(first.milliseconds) == {1, 4}
