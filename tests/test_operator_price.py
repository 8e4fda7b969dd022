"""An operator's restore prices the instance as the quickest of its peers that answered: the
operator vouches for it. A peer's guess is no answer: held as one, it was priced above the
peers' first answers until it faded, and the instance was passed over meanwhile."""

from __future__ import annotations

from typing import Any, cast

from gateway.core.balancer import DEFAULT_RTT_S
from gateway.operations import Operations
from gateway.upstream.pool import PoolState
from tests.test_lost_races import Clock, setting


def operations(pool: PoolState, clock: Clock) -> Operations:
    """Operator actions over `pool` alone (a restore reads nothing else)."""
    unused = cast(Any, None)
    return Operations(
        {"chat": pool},
        {},
        unused,
        unused,
        unused,
        lambda pool_name, transition, shared: None,
        lambda: False,
        clock,
    )


def test_a_restore_is_priced_as_the_quickest_peer_that_answered() -> None:
    _, pool, a, clock = setting()
    b, c = pool.instances[1], pool.instances[2]
    b.price.peak.observe(clock.now, 0.2)
    c.price.peak.observe(clock.now, 0.4)
    operations(pool, clock).operator("chat", a.name, "restore")
    assert a.price.peak.learned  # the operator's word, held as an answer
    assert a.price.peak.get(clock.now) == 0.2


def test_a_restore_among_peers_that_never_answered_is_a_guess() -> None:
    _, pool, a, clock = setting()
    clock.now += 5.0  # the peers' guesses have faded a little: still no answers
    operations(pool, clock).operator("chat", a.name, "restore")
    assert not a.price.peak.learned  # costed as its peers are until its first answer
    assert a.price.peak.get(clock.now) == DEFAULT_RTT_S
    # Its first answer replaces the guess, however far below it.
    a.price.peak.observe(clock.now, 0.05)
    assert a.price.peak.get(clock.now) == 0.05
