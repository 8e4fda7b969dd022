"""Checks that relate several fields of a policy, each reported at the key that is wrong."""

from __future__ import annotations

from gateway.config.models import Policy, PoolPolicy, split_host_port

Loc = tuple[str | int, ...]


def cross_field_errors(policy: Policy) -> list[tuple[Loc, str]]:
    """Every inconsistency between fields, as (location, message), in file order."""
    errors: list[tuple[Loc, str]] = []
    if _same_socket(policy.listen, policy.admin.listen):
        errors.append(
            (("admin", "listen"), f"the admin plane needs its own address, not {policy.listen}")
        )
    metrics = policy.metrics.listen
    if metrics is not None:
        for other, name in ((policy.listen, "the data plane"), (policy.admin.listen, "admin")):
            if _same_socket(metrics, other):
                errors.append(
                    (("metrics", "listen"), f"{metrics} is taken by {name}: give it its own port")
                )
    owner: dict[str, str] = {}
    for pool_name, pool in policy.pools.items():
        where: Loc = ("pools", pool_name)
        for index, model in enumerate(pool.models):
            if model in owner:
                errors.append(
                    (
                        (*where, "models", index),
                        f"model {model!r} is already served by pool {owner[model]!r}",
                    )
                )
            else:
                owner[model] = pool_name
        errors.extend(_pool_errors(where, pool))
    return errors


_WILDCARDS = ("0.0.0.0", "::", "")


def _same_socket(first: str, second: str) -> bool:
    """Whether two listen addresses would compete for one port (a wildcard takes every host)."""
    host_a, port_a = split_host_port(first)
    host_b, port_b = split_host_port(second)
    if port_a != port_b or port_a == 0:
        return False
    return host_a == host_b or host_a in _WILDCARDS or host_b in _WILDCARDS


def _pool_errors(where: Loc, pool: PoolPolicy) -> list[tuple[Loc, str]]:
    errors: list[tuple[Loc, str]] = []
    if not pool.instances and pool.discovery is None:
        errors.append(((*where, "instances"), "a pool needs instances, discovery or both"))
    seen: set[str] = set()
    for index, instance in enumerate(pool.instances):
        if instance.name in seen:
            errors.append(
                (
                    (*where, "instances", index, "name"),
                    f"duplicate instance name {instance.name!r}",
                )
            )
        seen.add(instance.name)

    timeouts = pool.timeouts
    if timeouts.floor > timeouts.ceiling:
        errors.append(
            (
                (*where, "timeouts", "floor"),
                f"floor ({timeouts.floor:g}s) is above ceiling ({timeouts.ceiling:g}s)",
            )
        )

    limit = timeouts.first_token_max
    if limit is not None and limit > timeouts.ceiling:
        errors.append(
            (
                (*where, "timeouts", "first_token_max"),
                f"first_token_max ({limit:g}s) is above ceiling ({timeouts.ceiling:g}s)",
            )
        )
    backoff = pool.retries.rate_limit_backoff
    if backoff.base > backoff.max:
        errors.append(
            (
                (*where, "retries", "rate_limit_backoff", "base"),
                f"base ({backoff.base:g}s) is above max ({backoff.max:g}s)",
            )
        )

    tiers = pool.retries.tiers
    for index, tier in enumerate(tiers):
        tier_loc: Loc = (*where, "retries", "tiers", index)
        if index > 0 and tier.below <= tiers[index - 1].below:
            errors.append(
                (
                    (*tier_loc, "below"),
                    f"tier bounds must increase: {tier.below:g} is not above "
                    f"{tiers[index - 1].below:g}",
                )
            )
        if tier.k[0] > tier.k[1]:
            errors.append(((*tier_loc, "k"), "k must be [low, high] with low <= high"))
    if tiers[-1].below < 1.0:
        errors.append(
            (
                (*where, "retries", "tiers", len(tiers) - 1, "below"),
                "the last tier must cover every failure rate (below: 1.0)",
            )
        )

    breaker = pool.breaker
    if breaker.max_isolation < breaker.isolation:
        errors.append(
            (
                (*where, "breaker", "max_isolation"),
                f"max_isolation ({breaker.max_isolation:g}s) is below isolation "
                f"({breaker.isolation:g}s)",
            )
        )
    if pool.health.timeout > pool.health.interval:
        errors.append(
            (
                (*where, "health", "timeout"),
                "a health check timeout longer than its interval lets checks pile up",
            )
        )
    return errors
