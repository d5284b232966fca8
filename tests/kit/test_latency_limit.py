"""The write cap that follows latency (``pygmy.kit.admission.LatencyLimit``), in simulation: it is
pure, so each test drives it with its own clock and latencies.

What it must do: cut the cap while requests are slow *and* the cap holds load back; leave it alone
for load the cap did not hold back (closed-loop clients); grow it back to the configured cap once
latency is normal; keep a baseline that a long surge cannot raise; and stay within its bounds
whatever it is fed."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pygmy.kit import admission
from pygmy.kit.admission import Admission, Gate, LatencyLimit

WINDOW = 0.05


def feed(limit: LatencyLimit, now: float, latency: float, windows: int, *, reached: bool, per_window: int = 8) -> float:
    """``windows`` windows of ``per_window`` requests of ``latency`` each; returns the clock after them."""
    for _ in range(windows):
        if reached:
            limit.reached()
        for k in range(per_window):
            limit.observe(now + k * (WINDOW + 0.0005) / (per_window - 1), latency)
        now += WINDOW + 0.002
    return now


def test_slow_requests_while_the_cap_holds_load_back_cut_it_and_fast_ones_grow_it_back() -> None:
    limit = LatencyLimit(48, 2.0)
    now = feed(limit, 0.0, 0.010, 5, reached=False)
    assert limit.limit == 48 and limit.baseline == pytest.approx(0.010)
    now = feed(limit, now, 0.050, 1, reached=True)
    assert limit.limit == 43, "cut by a tenth"
    now = feed(limit, now, 0.050, 5, reached=True)
    assert limit.limit == 25
    assert limit.baseline == pytest.approx(0.010), "a surge does not raise the baseline"
    now = feed(limit, now, 0.012, 10, reached=True)
    assert limit.limit == 35, "one more place each window at normal latency"
    feed(limit, now, 0.012, 40, reached=False)
    assert limit.limit == 48, "back to the configured cap, never over it"


def test_requests_still_slow_at_the_floor_put_the_cap_back_and_rebase() -> None:
    """Slow whatever the cap: the cap is not the cause, and a low one would only cost goodput."""
    limit = LatencyLimit(48, 2.0)
    now = feed(limit, 0.0, 0.010, 5, reached=False)
    now = feed(limit, now, 0.050, 13, reached=True)
    assert limit.limit == 12, "down to the floor (a quarter), not below"
    now = feed(limit, now, 0.050, 2, reached=True)
    assert limit.limit == 12, "it waits for the floor's own windows"
    now = feed(limit, now, 0.050, 1, reached=True)
    assert limit.limit == 48 and limit.baseline == pytest.approx(0.050) and limit.rebases == 1
    now = feed(limit, now, 0.060, 50, reached=True)
    assert limit.limit == 48, "as slow as at the floor: within the tolerance of the new baseline"
    feed(limit, now, 0.010, 1, reached=False)
    assert limit.baseline == pytest.approx(0.010), "and a fast window brings it down at once"


def test_slow_requests_the_cap_did_not_hold_back_are_not_shed_and_teach_the_baseline() -> None:
    """32 closed-loop buyers under a cap of 48: slower than an idle service, but nothing queues at
    the cap, so shedding them would only turn waits into errors."""
    limit = LatencyLimit(48, 2.0)
    now = feed(limit, 0.0, 0.010, 5, reached=False)
    now = feed(limit, now, 0.050, 200, reached=False)
    assert limit.limit == 48
    assert 0.045 < limit.baseline < 0.050, "the baseline follows latency below the cap"
    feed(limit, now, 0.008, 1, reached=False)
    assert limit.baseline == pytest.approx(0.008), "and falls at once"


def test_a_window_closes_on_time_and_samples_together_and_judges_by_its_median() -> None:
    limit = LatencyLimit(10, 2.0)
    for k in range(3):
        limit.observe(k * 0.1, 0.010)
    assert limit.baseline is None, "three samples are not a window however long they took"
    limit.observe(0.3, 0.010)
    assert limit.baseline == pytest.approx(0.010)
    limit.reached()
    for k, latency in enumerate((0.011, 0.012, 0.010, 5.0, 5.0)):  # two stragglers do not make a slow window
        limit.observe(0.4 + k * 0.013, latency)
    assert limit.limit == 10
    limit.reached()
    for k in range(20):  # a burst of fast completions: the window waits for its time
        limit.observe(0.6 + k * 0.001, 0.5)
    assert limit.limit == 10
    limit.observe(0.7, 0.5)
    assert limit.limit == 9


def test_a_simulated_open_loop_surge_settles_where_latency_meets_the_tolerance() -> None:
    """A service whose latency is its base up to 16 requests in flight and grows in proportion beyond
    (a saturated CPU), offered more than it can take: every place is always taken, so the cap is
    always reached, and the cap settles around the in-flight count whose latency is the tolerance."""
    limit = LatencyLimit(64, 2.0)
    now = feed(limit, 0.0, 0.010, 3, reached=False)
    seen = []
    for _ in range(400):
        latency = 0.010 * max(1.0, limit.limit / 16)
        now = feed(limit, now, latency, 1, reached=True)
        seen.append(limit.limit)
    settled = seen[-100:]
    assert min(settled) >= 28 and max(settled) <= 34, settled


@settings(max_examples=200, deadline=None)
@example(ceiling=1, tolerance=2.0, steps=[(0.06, 0.01, False)] * 4 + [(0.06, 0.05, True)] * 16)
@given(ceiling=st.integers(1, 200), tolerance=st.floats(1.01, 10),
       steps=st.lists(st.tuples(st.floats(0, 0.2), st.floats(0, 10), st.booleans()), max_size=300))
def test_whatever_it_is_fed_the_cap_stays_within_its_bounds(ceiling: int, tolerance: float,
                                                             steps: list[tuple[float, float, bool]]) -> None:
    limit = LatencyLimit(ceiling, tolerance)
    now, lowest = 0.0, None
    for dt, latency, reached in steps:
        now += dt
        before, rebases = limit.baseline, limit.rebases
        if reached:
            limit.reached()
        limit.observe(now, latency)
        lowest = latency if lowest is None else min(lowest, latency)
        assert max(1, ceiling // 4) <= limit.limit <= ceiling
        if limit.baseline is not None:
            assert limit.baseline >= lowest, "the baseline is a latency that was seen, or above one"
            if reached and before is not None and limit.rebases == rebases:
                assert limit.baseline <= before, "while the cap is reached the baseline only falls, but for a rebase"


def test_a_tolerance_must_be_over_one() -> None:
    for bad in (1.0, 0.5, -2):
        with pytest.raises(ValueError):
            LatencyLimit(10, bad)


def test_a_gate_feeds_its_requests_latency_to_its_limit_and_admits_by_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    gate = Gate(10, 2.0)
    assert gate.adaptive is not None and Gate(10).adaptive is None

    def round_trip(latency: float) -> None:
        assert gate.try_enter()
        entered = clock[0]
        clock[0] += latency
        gate.leave(entered)

    for _ in range(8):
        round_trip(0.010)
    assert gate.adaptive.baseline == pytest.approx(0.010)
    held = 0
    while gate.try_enter():  # every place taken: the cap is reached
        held += 1
    assert held == 10
    for _ in range(held):
        clock[0] += 0.02
        gate.leave(clock[0] - 0.5)
    assert gate.limit == 9 and gate.ceiling == 10
    assert [gate.try_enter() for _ in range(10)].count(True) == 9, "the cut cap admits"


def test_admission_reports_a_following_cap_and_its_baseline() -> None:
    app = Admission(lambda e, s: [b""], "svc-l", {"write": 6, "read": 3}, tolerances={"write": 2.0})
    snap = app.snapshot()
    assert snap["write"] == {"limit": 6, "in_flight": 0, "ceiling": 6, "baseline_ms": None}
    assert snap["read"] == {"limit": 3, "in_flight": 0}
    assert app.gates["read"].adaptive is None


def test_a_small_cap_reaches_its_floor_and_rebases_like_a_large_one() -> None:
    limit = LatencyLimit(3, 2.0)
    assert limit.floor == 1
    now = feed(limit, 0.0, 0.010, 3, reached=False)
    now = feed(limit, now, 0.050, 4, reached=True)
    assert limit.limit == 1 and limit.value > 1
    now = feed(limit, now, 0.050, 2, reached=True)
    assert limit.limit == 1
    feed(limit, now, 0.050, 1, reached=True)
    assert limit.limit == 3 and limit.rebases == 1, "three windows at the floor, counted by the cap in force"
    assert LatencyLimit(10, 2.0, floor=0).floor == 1 and LatencyLimit(10, 2.0, floor=20).floor == 10
    with pytest.raises(ValueError):
        LatencyLimit(0, 2.0)


def test_a_window_left_open_by_an_idle_service_is_dropped_not_judged_with_new_samples() -> None:
    limit = LatencyLimit(12, 2.0)
    now = feed(limit, 0.0, 0.010, 3, reached=False)
    for k in range(3):  # an idle service: three fast buys, then nothing for seconds
        limit.observe(now + k * 0.001, 0.010)
    now += 5.0
    limit.reached()
    for k in range(4):  # slow ones at the cap: their window alone is judged, and cut
        limit.observe(now + k * 0.02, 1.0)
    assert limit.limit == 10


def test_a_zero_latency_does_not_make_every_later_window_slow() -> None:
    limit = LatencyLimit(48, 2.0)
    now = feed(limit, 0.0, 0.0, 2, reached=False)
    feed(limit, now, 0.0001, 5, reached=True)
    assert limit.limit == 48

