"""Random schedules (Hypothesis) through the simulated cluster: safety always, liveness after healing."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raft_sim import CRASH_POINTS, Cluster

ACTIONS = st.one_of(
    st.tuples(st.just("tick"), st.integers(1, 40)),
    st.tuples(st.just("propose"), st.integers(1, 8)),
    st.tuples(st.just("crash"), st.integers(0, 4)),
    st.tuples(st.just("restart"), st.integers(0, 4)),
    # Node arg % n dies inside its next durable Ready, at CRASH_POINTS[arg // 5].
    st.tuples(st.just("crash_at"), st.integers(0, 5 * len(CRASH_POINTS) - 1)),
    st.tuples(st.just("partition"), st.integers(1, 30)),
    st.tuples(st.just("heal"), st.just(0)),
    st.tuples(st.just("compact"), st.integers(0, 4)),
)


def run_schedule(
    n: int,
    seed: int,
    drop: float,
    dup: float,
    delay: int,
    actions: list[tuple[str, int]],
    *,
    send_before_persist: bool = False,
) -> Cluster:
    c = Cluster(n, seed=seed, send_before_persist=send_before_persist)
    c.net.drop, c.net.dup, c.net.max_delay = drop, dup, delay
    names = c.names
    for kind, arg in actions:
        if kind == "tick":
            c.tick(arg)
        elif kind == "propose":
            c.propose(arg)
            c.tick(1)
        elif kind == "crash":
            # Keep a majority able to come back; crashes are healed at the end anyway.
            c.crash(names[arg % n])
        elif kind == "restart":
            c.restart(names[arg % n])
        elif kind == "crash_at":
            c.arm_crash(names[arg % n], CRASH_POINTS[arg // 5 % len(CRASH_POINTS)])
        elif kind == "partition":
            side = {name for i, name in enumerate(names) if arg >> i & 1}
            c.partition(side, set(names) - side)
        elif kind == "heal":
            c.heal()
        elif kind == "compact":
            c.compact(names[arg % n])
        c.tick(1)
    # Liveness: heal everything and a proposal must commit on every node within bounded time.
    c.heal()
    c.disarm()
    c.net.drop, c.net.dup, c.net.max_delay = 0.0, 0.0, 0
    for name in names:
        c.restart(name)
    assert c.commit_everywhere(max_ticks=3000), "no progress after healing"
    c.check_log_matching()
    digests = {tuple(node.storage.sm_applied[-1:]) for node in c.nodes.values()}
    assert len(digests) == 1
    return c


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([3, 5]),
    seed=st.integers(0, 2**16),
    drop=st.sampled_from([0.0, 0.05, 0.2]),
    dup=st.sampled_from([0.0, 0.1]),
    delay=st.integers(0, 6),
    actions=st.lists(ACTIONS, min_size=20, max_size=80),
)
def test_random_schedules_are_safe_and_live(n, seed, drop, dup, delay, actions):
    run_schedule(n, seed, drop, dup, delay, actions)


def test_long_chaotic_run():
    """One longer deterministic run with constant churn."""
    import random

    rng = random.Random(7)
    actions: list[tuple[str, int]] = []
    for _ in range(300):
        kind = rng.choice(
            ["tick", "tick", "propose", "propose", "crash", "restart", "partition", "heal", "compact"]
        )
        actions.append((kind, rng.randint(1, 30)))
    run_schedule(5, 7, 0.1, 0.05, 4, actions)
