"""Which peers' X-Forwarded-For the gateway believes (`limits.trusted_proxies`).

Envoy-like: a request from a trusted proxy keeps its X-Forwarded-For and gets the peer
appended; from anyone else the header is replaced by the peer's address, so a client cannot
make the backends (or the access log) see an address it made up. The client's address is the
rightmost address of the chain that is not a trusted proxy (nginx's `real_ip_recursive on`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

_CACHE_SIZE = 4096


def _parse(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address written in X-Forwarded-For or by the socket: `1.2.3.4`, `::1`, `[::1]`,
    `1.2.3.4:5678`, `[::1]:5678`; None for anything else (`unknown`, an obfuscated name)."""
    host = host.strip()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
    return address


class TrustedProxies:
    """A set of networks; `host in proxies` with a bounded cache of the answers."""

    __slots__ = ("_cache", "_networks")

    def __init__(self, networks: Iterable[str]) -> None:
        self._networks = tuple(ipaddress.ip_network(n) for n in networks)
        self._cache: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self._networks)

    def __contains__(self, host: object) -> bool:
        if not isinstance(host, str):
            return False
        known = self._cache.get(host)
        if known is None:
            address = _parse(host)
            known = address is not None and any(address in n for n in self._networks)
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()  # many distinct peers: start over rather than grow
            self._cache[host] = known
        return known

    def client(self, forwarded_for: str, peer: str) -> str:
        """The rightmost address of `forwarded_for, peer` that is not a trusted proxy (the
        leftmost when they all are); `peer` is trusted (the caller checked)."""
        hops = [hop.strip() for hop in forwarded_for.split(",")]
        for hop in reversed(hops):
            if hop and hop not in self:
                return hop
        return next((hop for hop in hops if hop), peer)
