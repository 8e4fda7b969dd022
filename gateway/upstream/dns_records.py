"""Instances from DNS records (`discovery.dns`), asked again on an interval.

`A`: the A and AAAA records of the name, each address on the policy's port (a Kubernetes
headless Service lists its ready pods' addresses so). `SRV`: each record's target and port;
the target's address is taken from the answer's additional section, else asked for with the
same resolver (a target reachable only through the configured nameservers must not go to the
system resolver at connect time). SRV priority and weight are not used: every target is an
instance, and the balancer weighs them by what it measures.

What an answer means (`gateway.core.discovery` decides what the pool does with it):
- records, or none (NOERROR without records, NXDOMAIN): an answer, empty or not;
- a timeout, SERVFAIL, REFUSED, a malformed reply: an error, and nothing changes. With A,
  one of the two queries failing is an error too: half an answer would drop instances.

The records' TTL bounds when the name is asked again (`next_refresh`): an answer is not kept
past its TTL, and never asked for more often than once a second.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable, Sequence

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver

from gateway.config.models import DnsDiscoveryPolicy, split_nameserver
from gateway.core.discovery import Endpoint, from_addresses, from_srv, next_refresh
from gateway.runtime import Clock

Answered = Callable[[Sequence[Endpoint]], Awaitable[None]]
Failed = Callable[[str], None]


class DnsError(Exception):
    """The resolver could not answer (the last known instances stay)."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, dns.resolver.LifetimeTimeout):
        return "timed out"
    if isinstance(exc, dns.resolver.NoNameservers):
        return "no nameserver answered (SERVFAIL or REFUSED)"
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


class DnsSource:
    """One pool's DNS name, resolved with its own resolver (no cache: every ask is fresh)."""

    kind = "dns"

    def __init__(self, policy: DnsDiscoveryPolicy) -> None:
        self.policy = policy
        self._resolver: dns.asyncresolver.Resolver | None = None

    @property
    def target(self) -> str:
        return f"{self.policy.type} {self.policy.name}"

    def _get_resolver(self) -> dns.asyncresolver.Resolver:
        """Built at first use (the system's configuration may be missing for a while)."""
        if self._resolver is None:
            policy = self.policy
            try:
                resolver = dns.asyncresolver.Resolver(configure=not policy.nameservers)
            except dns.resolver.NoResolverConfiguration as exc:
                raise DnsError(f"no resolver configuration: {exc}") from None
            if policy.nameservers:
                resolver.nameservers = [
                    dns.nameserver.Do53Nameserver(*split_nameserver(server))
                    for server in policy.nameservers
                ]
            # `timeout` bounds a whole resolution; each nameserver gets its share, so one that
            # is down leaves time to ask the next.
            resolver.lifetime = policy.timeout
            resolver.timeout = policy.timeout / max(1, len(resolver.nameservers))
            self._resolver = resolver
        return self._resolver

    async def _query(
        self, name: str, rdtype: str, search: bool = True
    ) -> dns.resolver.Answer | None:
        """The answer (its rrset None when the name has no such records); None: NXDOMAIN.
        `search`: the system resolver's search domains apply (not to absolute names)."""
        try:
            return await self._get_resolver().resolve(
                name,
                rdtype,
                raise_on_no_answer=False,
                search=search and not self.policy.nameservers,
            )
        except dns.resolver.NXDOMAIN:
            return None
        except (dns.exception.DNSException, OSError) as exc:
            raise DnsError(f"{rdtype} {name}: {_describe(exc)}") from None

    async def resolve(self) -> tuple[list[Endpoint], float | None]:
        """The endpoints the records give, and their smallest TTL (None: no records).
        Raises DnsError when the resolver could not answer."""
        if self.policy.type == "SRV":
            return await self._resolve_srv()
        port = self.policy.port
        assert port is not None  # the policy requires it for A
        addresses, ttl = await self._addresses(self.policy.name)
        return from_addresses(addresses, port), ttl

    async def _resolve_srv(self) -> tuple[list[Endpoint], float | None]:
        answer = await self._query(self.policy.name, "SRV")
        if answer is None or answer.rrset is None:
            return [], None
        ttls: list[float] = [answer.rrset.ttl]
        records = [(record.target.to_text(), record.port) for record in answer.rrset]
        # Addresses the server sent along (its additional section), by target.
        given: dict[str, list[str]] = {}
        for rrset in answer.response.additional:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                owner = rrset.name.to_text().rstrip(".").lower()
                given.setdefault(owner, []).extend(record.address for record in rrset)
                ttls.append(rrset.ttl)
        endpoints = from_srv(records)
        missing = sorted({e.host for e in endpoints if e.host not in given})
        if missing:
            found = await asyncio.gather(
                *(self._addresses(target + ".", search=False) for target in missing)
            )
            for target, (addresses, ttl) in zip(missing, found, strict=True):
                given[target] = addresses
                if ttl is not None:
                    ttls.append(ttl)
        resolved = [
            Endpoint(e.name, _first_address(given[e.host]), e.port)
            for e in endpoints
            if given.get(e.host)  # a target without an address is not an instance
        ]
        return resolved, min(ttls)

    async def _addresses(self, target: str, search: bool = True) -> tuple[list[str], float | None]:
        """A and AAAA records of `target`, and their smallest TTL (None: no records)."""
        answers = await asyncio.gather(
            self._query(target, "A", search), self._query(target, "AAAA", search)
        )
        addresses: list[str] = []
        ttls: list[float] = []
        for answer in answers:
            if answer is not None and answer.rrset is not None:
                addresses.extend(record.address for record in answer.rrset)
                ttls.append(answer.rrset.ttl)
        return addresses, min(ttls, default=None)

    async def run(self, answered: Answered, failed: Failed, clock: Clock) -> None:
        """Resolve, report, wait until the next refresh; forever (until cancelled)."""
        interval = self.policy.interval
        while True:
            ttl: float | None = None
            try:
                endpoints, ttl = await self.resolve()
            except DnsError as exc:
                failed(str(exc))
            else:
                await answered(endpoints)
            now = clock()
            await asyncio.sleep(next_refresh(now, interval, ttl) - now)


def _first_address(addresses: list[str]) -> str:
    """One address per SRV target (IPv4 first, then the lowest): stable across answers."""
    return str(min((ipaddress.ip_address(a) for a in addresses), key=lambda ip: (ip.version, ip)))
