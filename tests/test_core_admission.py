from __future__ import annotations

from collections import Counter

import pytest

from gateway.core.admission import (
    CLASSES,
    AdmissionQueues,
    ArrivalRate,
    Priority,
    burst_weight,
)

BASE: dict[Priority, float] = {"interactive": 4.0, "standard": 2.0, "batch": 1.0}
TIMEOUT: dict[Priority, float] = {"interactive": 0.05, "standard": 5.0, "batch": 60.0}


def queues(max_queue: int = 10_000, max_total: int = 100_000) -> AdmissionQueues[int]:
    return AdmissionQueues(
        BASE, dict.fromkeys(CLASSES, max_queue), dict.fromkeys(CLASSES, 1e9), max_total
    )


@pytest.mark.parametrize(
    ("qps", "peak", "weight"),
    [(0.0, 10.0, 1.0), (10.0, 10.0, 0.3), (5.0, 10.0, 0.65), (3.0, 0.0, 1.0), (20.0, 10.0, 0.3)],
)
def test_burst_weight(qps: float, peak: float, weight: float) -> None:
    assert burst_weight(qps, peak) == pytest.approx(weight)


def test_arrival_rate_over_the_window_and_its_decaying_peak() -> None:
    rate = ArrivalRate(window_s=10, half_life_s=100.0)
    for _ in range(50):
        rate.arrive(0.5)
    assert rate.qps(0.9) == pytest.approx(5.0)
    assert rate.peak(0.9) == pytest.approx(5.0, rel=0.01)
    assert rate.qps(10.5) == 0.0  # the burst left the window
    assert rate.peak(100.5) == pytest.approx(2.5, rel=0.01)  # one half-life later


def test_waiting_classes_share_the_service_by_weight() -> None:
    q = queues()
    for i in range(1000):
        for name in CLASSES:
            assert q.offer(i, name, 0.0).queued
    served = Counter(entry.priority for entry in (q.pop(1.0) for _ in range(700)) if entry)
    assert served == {"interactive": 400, "standard": 200, "batch": 100}


def test_a_bursting_class_is_served_at_a_fraction_of_its_weight() -> None:
    q = queues()
    for _ in range(100):  # interactive arrivals at their peak rate: burst factor 0.3
        q.arrived("interactive", 0.0)
    for i in range(500):
        q.offer(i, "interactive", 0.0)
        q.offer(i, "batch", 0.0)
    weights = q.weights(0.5)
    assert weights["interactive"] == pytest.approx(4.0 * 0.3)
    served = Counter(entry.priority for entry in (q.pop(0.5) for _ in range(220)) if entry)
    assert served["interactive"] == pytest.approx(120, abs=1)  # 1.2 : 1
    assert served["batch"] == pytest.approx(100, abs=1)


def test_fifo_within_a_class() -> None:
    q = queues()
    for i in range(5):
        q.offer(i, "standard", float(i))
    assert [entry.item for entry in (q.pop(10.0) for _ in range(5)) if entry] == list(range(5))
    assert q.pop(10.0) is None


def test_a_head_that_does_not_fit_is_passed_only_by_more_urgent_classes() -> None:
    q = queues()
    q.offer(5000, "standard", 0.0)  # items are token counts here
    q.offer(10, "standard", 0.0)
    q.offer(20, "batch", 0.0)
    q.offer(30, "interactive", 0.0)

    def fits(tokens: int) -> bool:
        return tokens <= 100

    # Interactive goes past the large standard request; batch may not take its room, and the
    # standard request behind the large one waits its turn (FIFO within a class).
    served = [entry.item for entry in (q.pop(1.0, fits) for _ in range(3)) if entry]
    assert served == [30]
    assert q.length("standard") == 2 and q.length("batch") == 1
    head = q.pop(1.0)
    assert head is not None and head.item == 5000


def test_a_large_batch_head_holds_up_nobody_else() -> None:
    q = queues()
    q.offer(5000, "batch", 0.0)
    q.offer(10, "standard", 0.0)
    q.offer(20, "interactive", 0.0)
    served = [entry.item for entry in (q.pop(1.0, lambda t: t <= 100) for _ in range(3)) if entry]
    assert sorted(served) == [10, 20] and q.length("batch") == 1


def test_an_idle_class_banks_no_credit() -> None:
    q = queues()
    for i in range(100):
        q.offer(i, "batch", 0.0)
    for _ in range(100):
        q.pop(0.0)  # batch alone: its pass grows to 100
    for i in range(100):
        q.offer(i, "batch", 1.0)
        q.offer(i, "standard", 1.0)
    served = Counter(entry.priority for entry in (q.pop(1.0) for _ in range(30)) if entry)
    assert served == {"standard": 20, "batch": 10}  # 2 : 1 at once, no catching up


def test_a_full_class_queue_refuses() -> None:
    q = queues(max_queue=2)
    assert q.offer(1, "standard", 0.0).queued and q.offer(2, "standard", 0.0).queued
    refused = q.offer(3, "standard", 0.0)
    assert not refused.queued and refused.reason == "the standard queue is full"
    assert q.shed["standard"] == 1 and q.length("standard") == 2


def test_a_wait_longer_than_the_class_allows_is_refused_at_once() -> None:
    q: AdmissionQueues[int] = AdmissionQueues(
        BASE, dict.fromkeys(CLASSES, 100), TIMEOUT, max_total=1000
    )
    # 20 completions/s, interactive alone: the first waits 1/20 s = 50 ms: allowed (not over).
    assert q.offer(1, "interactive", 0.0, service_rate=20.0).queued
    second = q.offer(2, "interactive", 0.0, service_rate=20.0)
    assert not second.queued and second.reason is not None and "0.10s" in second.reason
    # Unknown service rate: no estimate, queued.
    assert q.offer(3, "interactive", 0.0).queued


def test_when_the_pool_is_full_the_least_urgent_newest_request_makes_room() -> None:
    q = queues(max_total=3)
    for i in range(2):
        q.offer(i, "batch", float(i))
    q.offer(10, "standard", 2.0)
    offer = q.offer(20, "interactive", 3.0)
    assert offer.queued and [(e.item, e.priority) for e in offer.evicted] == [(1, "batch")]
    offer = q.offer(21, "standard", 4.0)
    assert offer.queued and [(e.item, e.priority) for e in offer.evicted] == [(0, "batch")]
    # Nothing less urgent than batch to evict: a batch request is refused.
    refused = q.offer(30, "batch", 5.0)
    assert not refused.queued and refused.reason == "the pool's queues are full"
    assert q.shed == {"interactive": 0, "standard": 0, "batch": 3}


def test_entries_past_their_queue_timeout_expire() -> None:
    q: AdmissionQueues[int] = AdmissionQueues(
        BASE, dict.fromkeys(CLASSES, 100), TIMEOUT, max_total=1000
    )
    q.offer(1, "interactive", 0.0)
    q.offer(2, "standard", 0.0)
    assert q.next_expiry() == pytest.approx(0.05)
    assert q.pop(0.06) is not None and q.length("interactive") == 1  # served: standard
    assert [e.item for e in q.expire(0.06)] == [1]
    assert q.shed["interactive"] == 1 and len(q) == 0 and q.next_expiry() is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        AdmissionQueues({**BASE, "batch": 0.0}, dict.fromkeys(CLASSES, 1), TIMEOUT, 10)


def test_reconfigure_keeps_the_waiting_entries_and_bounds_new_arrivals() -> None:
    q: AdmissionQueues[int] = AdmissionQueues(
        BASE, dict.fromkeys(CLASSES, 3), dict.fromkeys(CLASSES, 10.0), 100
    )
    for i in range(3):
        assert q.offer(i, "batch", 0.0).queued
    q.reconfigure(
        {"interactive": 4.0, "standard": 2.0, "batch": 8.0},
        dict.fromkeys(CLASSES, 1),
        dict.fromkeys(CLASSES, 1.0),
        100,
    )
    assert q.length("batch") == 3  # nobody is dropped by a lower bound
    assert not q.offer(3, "batch", 0.5).queued  # which holds for new arrivals
    assert q.weights(0.5)["batch"] == pytest.approx(8.0)
    assert q.next_expiry() == pytest.approx(10.0)  # they keep the deadline they were given
    assert q.offer(0, "standard", 0.5).queued
    assert [entry.item for entry in q.expire(1.5)] == [0]  # the new timeout: 0.5 + 1.0
    assert [entry.item for entry in (q.pop(2.0), q.pop(2.0), q.pop(2.0))] == [0, 1, 2]
    with pytest.raises(ValueError, match="batch"):
        q.reconfigure(BASE, dict.fromkeys(CLASSES, 1), {**TIMEOUT, "batch": 0.0}, 100)


# -- tenants within a class ------------------------------------------------------------------


def test_tenants_share_a_class_by_weight_whatever_they_sent() -> None:
    weights = {"big": 1.0, "small": 1.0, "heavy": 2.0}
    q: AdmissionQueues[int] = AdmissionQueues(
        BASE, dict.fromkeys(CLASSES, 10_000), dict.fromkeys(CLASSES, 1e9), 100_000,
        tenant_weight=weights.__getitem__,
    )  # fmt: skip
    for i in range(1000):  # big sends 10x what small sends, both before anything is served
        q.offer(i, "batch", 0.0, tenant="big")
        if i % 10 == 0:
            q.offer(i, "batch", 0.0, tenant="small")
    served = Counter(entry.tenant for entry in (q.pop(1.0) for _ in range(100)) if entry)
    assert served == {"big": 50, "small": 50}
    assert q.tenants("batch") == {"big": 950, "small": 50}
    # A tenant of weight 2 gets two turns for each of the others'.
    for i in range(300):
        q.offer(i, "batch", 2.0, tenant="heavy")
    served = Counter(entry.tenant for entry in (q.pop(3.0) for _ in range(40)) if entry)
    assert served == {"heavy": 20, "big": 10, "small": 10}


def test_fifo_within_a_tenant_and_an_idle_tenant_banks_no_credit() -> None:
    q = queues()
    for i in range(5):
        q.offer(i, "standard", 0.0, tenant="a")
    assert [e.item for e in (q.pop(1.0) for _ in range(5)) if e] == [0, 1, 2, 3, 4]
    assert q.tenants("standard") == {}  # forgotten once nothing of it waits
    for i in range(20):
        q.offer(i, "standard", 2.0, tenant="a")
    for i in range(20):
        q.offer(100 + i, "standard", 2.0, tenant="b")
    # b was not served before, a was: no catching up, they alternate at once.
    order = [e.tenant for e in (q.pop(3.0) for _ in range(6)) if e]
    assert order == ["a", "b", "a", "b", "a", "b"]


def test_a_full_class_drops_from_the_tenant_with_the_most_waiting() -> None:
    q = queues(max_queue=10)
    for i in range(10):
        assert q.offer(i, "batch", 0.0, tenant="flood").queued
    offer = q.offer(100, "batch", 1.0, tenant="quiet")
    assert offer.queued and [(e.item, e.tenant) for e in offer.evicted] == [(9, "flood")]
    assert q.tenants("batch") == {"flood": 9, "quiet": 1}
    assert q.shed["batch"] == 1
    # The flooding tenant itself is refused rather than evicting its own.
    refused = q.offer(200, "batch", 2.0, tenant="flood")
    assert not refused.queued and refused.reason == "the batch queue is full"


def test_the_expected_wait_counts_the_tenants_own_queue_and_share() -> None:
    q: AdmissionQueues[int] = AdmissionQueues(
        BASE, dict.fromkeys(CLASSES, 1000), dict.fromkeys(CLASSES, 10.0), max_total=10_000
    )
    # 10 completions/s; one tenant's 99 waiting: its next one would wait 10 s: allowed.
    for i in range(99):
        assert q.offer(i, "batch", 0.0, service_rate=10.0, tenant="flood").queued
    assert q.offer(99, "batch", 0.0, service_rate=10.0, tenant="flood").queued
    assert not q.offer(100, "batch", 0.0, service_rate=10.0, tenant="flood").queued
    # Another tenant waits behind none of its own, at half the class: 1 / (10 * 0.5) = 0.2 s.
    assert q.offer(0, "batch", 0.0, service_rate=10.0, tenant="other").queued


def test_expiry_and_eviction_reach_every_tenant() -> None:
    q: AdmissionQueues[int] = AdmissionQueues(
        BASE, dict.fromkeys(CLASSES, 100), TIMEOUT, max_total=3
    )
    q.offer(1, "batch", 0.0, tenant="a")
    q.offer(2, "batch", 1.0, tenant="b")
    q.offer(3, "batch", 2.0, tenant="b")
    offer = q.offer(4, "interactive", 3.0, tenant="a")
    assert [(e.item, e.tenant) for e in offer.evicted] == [(3, "b")]  # the largest tenant's newest
    assert q.next_expiry() == pytest.approx(3.05)
    assert [e.item for e in q.expire(3.1)] == [4]
    assert q.next_expiry() == pytest.approx(60.0)
    assert sorted(e.item for e in q.expire(61.5)) == [1, 2]
    assert len(q) == 0


def test_tenants_that_keep_one_request_waiting_do_not_starve_a_backlog() -> None:
    # Two light tenants each send their next request as soon as the last was served; a heavy
    # one has a backlog. Each of the three gets a third of the service.
    q = queues()
    for i in range(1000):
        q.offer(i, "batch", 0.0, tenant="heavy")
    for light in ("l1", "l2"):
        q.offer(0, "batch", 0.0, tenant=light)
    served: Counter[str] = Counter()
    for n in range(900):
        entry = q.pop(1.0)
        assert entry is not None
        served[entry.tenant] += 1
        if entry.tenant != "heavy":
            q.offer(n, "batch", 1.0, tenant=entry.tenant)  # back at once
    assert served == {"heavy": 300, "l1": 300, "l2": 300}
    # A newcomer every turn fares no better against the backlog: half each.
    q = queues()
    for i in range(100):
        q.offer(i, "batch", 0.0, tenant="heavy")
    q.offer(0, "batch", 0.0, tenant="new-0")
    served = Counter()
    for n in range(1, 61):
        entry = q.pop(1.0)
        assert entry is not None
        served["heavy" if entry.tenant == "heavy" else "new"] += 1
        if entry.tenant != "heavy":
            q.offer(n, "batch", 1.0, tenant=f"new-{n}")
    assert served == {"heavy": 30, "new": 30}


def test_a_fair_drop_is_always_handed_back_to_be_answered() -> None:
    q = queues(max_queue=3, max_total=3)
    for i in range(3):
        q.offer(i, "batch", 0.0, tenant="flood")
    # A reload lowers the pool's bound below what waits: the fair drop still makes the room.
    q.reconfigure(BASE, dict.fromkeys(CLASSES, 3), dict.fromkeys(CLASSES, 1e9), 2)
    offer = q.offer(10, "batch", 1.0, tenant="quiet")
    assert offer.queued and [e.item for e in offer.evicted] == [2]
    assert len(q) == 3 and q.tenants("batch") == {"flood": 2, "quiet": 1}
