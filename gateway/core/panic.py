"""Panic routing: where a request goes when no instance of its pool is healthy and admitting.

Envoy's panic threshold sends traffic to every host once too few are healthy, on the grounds
that a partial outage must not become a total one by the gateway's own doing. Here the choice
is ranked: instances whose health checks pass but whose breakers keep them out come first
(they answer, if badly), then unhealthy ones whose last check still got an HTTP answer, then,
when none answers its checks, every instance: a check is seconds old, and an instance that
refused it may be back (a restarted pod): a direct client would try it too. Each is tried at
most once per request after it refused the request's connection or let it time out
(`refused`); when every one has, the client is told at once. Pure: what each instance's health
says is read through the functions passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def least_bad(
    instances: Sequence[T],
    healthy: Callable[[T], bool | None],
    answered: Callable[[T], bool],
    tried: Sequence[T] = (),
    refused: Sequence[T] = (),
) -> list[T] | None:
    """The candidates of a panicking pool, or None when every instance is in `refused`.

    The healthy instances if any, else those whose last health check got an answer, else all;
    never one in `refused` (it refused this request's connection, or let it time out); within
    that group the ones not in `tried` by this request when there are any, else all of it.
    """
    candidates = [i for i in instances if i not in refused] if refused else list(instances)
    group = (
        [i for i in candidates if healthy(i)]
        or [i for i in candidates if answered(i)]
        or candidates
    )
    if not group:
        return None
    untried = [i for i in group if i not in tried] if tried else group
    return untried or group
