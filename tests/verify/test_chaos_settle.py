"""Updates of unknown outcome settled after a run (``chaos.settle_updates``) on real processes: the
quick nemesis run checks that each was settled, which holds by itself when a run has none; here
two always are, one whose answer was lost after it took effect and one that never arrived."""

from __future__ import annotations

from pathlib import Path

import requests
from harness import BackgroundLoad, Cluster, judge_from_outside

ITEMS = [1, 2, 6, 7]


def test_an_update_sent_again_under_its_key_takes_effect_once_whatever_became_of_the_first(
        fresh_cluster: Cluster, tmp_path: Path) -> None:
    c = fresh_cluster
    load = BackgroundLoad([c.url], c.admin_token(), ITEMS, writers=0, readers=1, buyers=1, searchers=0, order_readers=0)
    load.start()
    try:
        load.buys_acked(3)
        # Book 1's update took effect, and its answer was lost on the way back (recorded as unknown).
        took = load.history.invoke(90, "update", 1, {"stock_delta": 3, "cost": 4242, "key": "settle-took"})
        r = requests.post(f"{c.url}/update/1", json={"stock_delta": 3, "cost": 42.42}, timeout=10,
                          headers={"Authorization": f"Bearer {c.admin_token()}", "Idempotency-Key": "settle-took"})
        assert r.status_code == 200, r.text
        load.history.unknown(took)
        # Book 2's never reached the cluster (lost on the way there).
        load.history.unknown(load.history.invoke(91, "update", 2, {"stock_delta": 5, "cost": 4343, "key": "settle-never"}))
        load.buys_acked(3)
    finally:
        history = load.finish()
    # Judged as a chaos run is: its stock equation is exact, each settled update counted once (the
    # first sent again must not take effect a second time, the second must take effect now).
    _, final = judge_from_outside(c, tmp_path / "run", history, [], ITEMS)
    assert final["settled_updates"] == {"settle-took": 200, "settle-never": 200}
