"""Checks that relate several fields of a policy, each reported at the key that is wrong."""

from __future__ import annotations

from gateway.config.fallbacks import MAX_FALLBACK_DEPTH
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
    errors.extend(_fallback_errors(policy))
    return errors


_FALLBACK_LISTS = ("fallbacks", "context_fallbacks")


def _fallback_errors(policy: Policy) -> list[tuple[Loc, str]]:
    """Fallbacks that name no pool, a model their pool does not serve, the pool itself, or
    make a loop (A -> B -> A) or a chain longer than `MAX_FALLBACK_DEPTH` hand-overs."""
    errors: list[tuple[Loc, str]] = []
    pools = policy.pools
    edges: dict[str, list[tuple[str, Loc]]] = {name: [] for name in pools}
    for name, pool in pools.items():
        for key in _FALLBACK_LISTS:
            for index, target in enumerate(getattr(pool, key)):
                loc: Loc = ("pools", name, key, index)
                other = pools.get(target.pool)
                if other is None:
                    known = ", ".join(sorted(pools))
                    errors.append(((*loc, "pool"), f"no pool {target.pool!r} (pools: {known})"))
                elif target.pool == name:
                    errors.append(((*loc, "pool"), "a pool cannot fall back to itself"))
                elif target.model is not None and target.model not in other.models:
                    served = ", ".join(other.models)
                    errors.append(
                        (
                            (*loc, "model"),
                            f"pool {target.pool!r} does not serve {target.model!r} "
                            f"(it serves {served})",
                        )
                    )
                else:
                    edges[name].append((target.pool, loc))
    errors.extend(_graph_errors(edges))
    return errors


def _graph_errors(edges: dict[str, list[tuple[str, Loc]]]) -> list[tuple[Loc, str]]:
    """Loops and over-long chains in the fallback graph, each reported once, at the entry
    that closes the loop or goes one hand-over too deep."""
    errors: list[tuple[Loc, str]] = []
    reported: set[Loc] = set()

    def walk(path: list[str]) -> None:
        for to, loc in edges[path[-1]]:
            if loc in reported:
                continue
            if to in path:
                reported.add(loc)
                cycle = " -> ".join([*path[path.index(to) :], to])
                errors.append(((*loc, "pool"), f"fallback loop: {cycle}"))
            elif len(path) > MAX_FALLBACK_DEPTH:
                reported.add(loc)
                chain = " -> ".join([*path, to])
                errors.append(
                    (
                        (*loc, "pool"),
                        f"fallback chain longer than {MAX_FALLBACK_DEPTH} hand-overs: {chain}",
                    )
                )
            else:
                walk([*path, to])

    for start in edges:
        walk([start])
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
