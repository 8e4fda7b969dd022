"""What a pool's admission looks like at one moment: the one read both the metrics and the
operator's view (/admin/state) make of a `PoolAdmission`, so the two show the same figures
and a new one is added here once.

Tenant figures are bounded here, for both: the `TOP_TENANTS` tenants with the most requests
waiting in each class, the rest added up under `(other)`; the shed counts keep the tenants
`TenantCounts` keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gateway.core.admission import CLASSES, Priority
from gateway.core.histogram import Histogram
from gateway.pipeline.admit import PoolAdmission, tenant_labels

TOP_TENANTS: Final = 20


@dataclass(frozen=True, slots=True)
class AdmissionSnapshot:
    """A pool's admission as both views show it."""

    # Requests let through and not finished (slots of the room, and those sent on past a
    # learned limit), and of them those sent on past it.
    running: int
    over: int
    room: int  # slots of the pool (`PoolAdmission.room`)
    # By class, in `CLASSES` order: waiting, shed (answered 429), sent on past a learned limit.
    queued: dict[Priority, int]
    shed: dict[Priority, int]
    overflow: dict[Priority, int]
    flood: bool  # as last judged (judging again would move it)
    engine_refused: bool  # an engine paced by a learned limit refused work lately
    weights: dict[Priority, float]  # the classes' burst-aware weights now
    tenants_queued: dict[Priority, dict[str, int]]
    tenants_shed: list[tuple[str, int]]  # `(other)` last
    # The time admitted requests waited, by class: the histograms themselves (read in place,
    # on the event loop that fills them).
    waits: Mapping[Priority, Histogram]
    engine_signals: bool  # whether its policy reads the engines' gauges (`vllm_signals`)


def admission_snapshot(admission: PoolAdmission, now: float) -> AdmissionSnapshot:
    """`admission` at `now` (event-loop time)."""
    queues = admission.queues
    return AdmissionSnapshot(
        running=admission.running + admission.over,
        over=admission.over,
        room=admission.room(),
        queued={name: queues.length(name) for name in CLASSES},
        shed=dict(queues.shed),
        overflow=dict(queues.overflow),
        flood=admission.flood_watch.flooding,
        engine_refused=admission.refused_lately(now),
        weights=queues.weights(now),
        tenants_queued={name: _tenants_queued(admission, name) for name in CLASSES},
        tenants_shed=admission.tenant_shed.items(),
        waits=admission.waits,
        engine_signals=admission.policy.vllm_signals is not None,
    )


def _tenants_queued(admission: PoolAdmission, priority: Priority) -> dict[str, int]:
    """The `TOP_TENANTS` tenants with the most requests waiting in the class, the rest added
    up under `(other)`."""
    ranked = sorted(admission.queues.tenants(priority).items(), key=lambda kv: -kv[1])
    # `(other)` always there (0 when nobody else waits): a series that never goes missing.
    others = sum(c for _, c in ranked[TOP_TENANTS:])
    return dict(tenant_labels(ranked[:TOP_TENANTS], others))
