"""The instances a pool discovers (DNS, Kubernetes), as a pure record of answers.

What a discovery source answers is turned into `Endpoint`s with stable names, and
`DiscoveredSet` decides what the pool's instance list becomes after each answer:

- **An answer with endpoints** replaces the set (the shell keeps the state of the instances that
  stay: same name and address).
- **An error** (a resolver or API failure) changes nothing: the last known set stays, and the
  error is counted and kept for the operator's view.
- **An empty answer** over a non-empty set is not believed at first: a name that briefly
  resolves to nothing (a DNS server restarting, a Service being edited) must not empty the pool.
  The set stays until answers have been empty for `grace_s`; then the empty answer is taken (the
  backends are gone). An answer with endpoints in between ends the grace.

The names are stable so that state kept across answers, and decisions shared through Redis,
follow the same backend: an address and port give `10.0.0.5-8000` (IPv6 `fd00--1-8000`, its
canonical form with its colons as dashes, `0--1-8000` for `::1`); an SRV target gives its first
label (a Kubernetes headless Service's pod hostname), with the port when two records share it,
and a digest when the label would not be a valid name.

Pure: `now` is an argument.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from gateway.config.models import NAME_RE

# The soonest a source is asked again, whatever TTL its records carry (a TTL of 0 must not make
# the gateway ask in a loop).
MIN_REFRESH_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One discovered backend: its stable name, and where to reach it."""

    name: str
    host: str
    port: int

    def url(self, scheme: str = "http") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"


def address_name(address: str, port: int) -> str:
    """The stable name of an address and port: `10.0.0.5-8000`, `fd00--1-8000` (the canonical
    IPv6 form, its colons as dashes). Raises ValueError when `address` is not an IP address."""
    text = str(ipaddress.ip_address(address))
    if text.startswith(":"):
        text = "0" + text  # a name starts with a letter or digit (no canonical form has "0::")
    return f"{text.replace(':', '-')}-{port}"


def from_addresses(addresses: Iterable[str], port: int) -> list[Endpoint]:
    """Endpoints for A/AAAA answers: one per distinct address, in address order."""
    distinct = sorted({ipaddress.ip_address(a) for a in addresses}, key=lambda ip: (ip.version, ip))
    return [Endpoint(address_name(str(ip), port), str(ip), port) for ip in distinct]


def _label_name(label: str, target: str) -> str:
    if NAME_RE.match(label):
        return label
    digest = hashlib.sha256(target.encode()).hexdigest()[:12]
    return f"srv-{digest}"


def from_srv(records: Sequence[tuple[str, int]]) -> list[Endpoint]:
    """Endpoints for SRV answers, `(target, port)` each: named by the target's first label, with
    `-port` when two records share that label; sorted by name. Duplicate records count once."""
    distinct = sorted({(target.rstrip(".").lower(), port) for target, port in records})
    labels = {(t, p): _label_name(t.split(".", 1)[0], t) for t, p in distinct}
    by_label = Counter(labels.values())
    with_port = Counter(f"{label}-{p}" for (_, p), label in labels.items())
    endpoints = []
    for (target, port), label in labels.items():
        name = label if by_label[label] == 1 else f"{label}-{port}"
        if name != label and (with_port[name] > 1 or not NAME_RE.match(name)):
            # The same label and port on two targets (a.x and a.y): named by the whole target.
            name = f"srv-{hashlib.sha256(f'{target}:{port}'.encode()).hexdigest()[:12]}"
        endpoints.append(Endpoint(name, target, port))
    return sorted(endpoints, key=lambda e: e.name)


def next_refresh(now: float, interval_s: float, ttl_s: float | None) -> float:
    """When to ask again: after `interval_s`, or the records' TTL when that is sooner (a cached
    answer is not kept past its TTL), but not sooner than `MIN_REFRESH_S`."""
    delay = interval_s if ttl_s is None else min(interval_s, ttl_s)
    return now + max(MIN_REFRESH_S, delay)


class DiscoveredSet:
    """The endpoints one pool was last told of, and how each answer changes them (rules in the
    module docstring)."""

    __slots__ = (
        "changes",
        "empty_since",
        "endpoints",
        "errors",
        "failed_at",
        "grace_s",
        "last_error",
        "pending",
        "refreshed_at",
        "shadowed",
    )

    def __init__(self, grace_s: float) -> None:
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self.endpoints: tuple[Endpoint, ...] = ()
        self.empty_since: float | None = None  # answers empty since then, over a non-empty set
        self.refreshed_at: float | None = None  # the last answer (not an error)
        self.last_error: str | None = None  # since the last answer
        self.failed_at: float | None = None
        self.errors = 0
        self.changes = 0  # answers that changed the set
        self.pending = False  # a change the pool could not take: the next answer tries again
        self.shadowed: tuple[str, ...] = ()  # found names a listed instance already has

    def answered(self, now: float, endpoints: Sequence[Endpoint]) -> bool:
        """Take an answer; whether the set changed."""
        self.refreshed_at = now
        self.last_error = None
        new = tuple(sorted(set(endpoints), key=lambda e: e.name))
        if not new and self.endpoints:
            if self.empty_since is None:
                self.empty_since = now
            if now - self.empty_since < self.grace_s:
                return False  # not believed yet
        self.empty_since = None
        if new == self.endpoints and not self.pending:
            return False
        self.endpoints = new
        self.changes += 1
        self.pending = False
        return True

    def not_applied(self) -> None:
        """The pool could not take the last change: the next answer is one, even if the same."""
        self.pending = True

    def failed(self, now: float, error: str) -> None:
        """A source that could not answer: nothing changes but the error count."""
        self.errors += 1
        self.last_error = error
        self.failed_at = now


# -- Kubernetes EndpointSlices ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SliceEndpoint:
    """One endpoint of an EndpointSlice: its address, conditions (None: not set) and pod."""

    address: str
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None
    pod: str | None = None  # targetRef.name when the target is a Pod
    hostname: str | None = None


@dataclass(frozen=True, slots=True)
class Slice:
    """What discovery reads of an EndpointSlice."""

    address_type: str  # IPv4, IPv6 or FQDN
    ports: tuple[tuple[str | None, int], ...]  # (name, port)
    endpoints: tuple[SliceEndpoint, ...]


def _slice_port(piece: Slice, port: str | int | None) -> int | None:
    """The port to use in this slice: a number or a name the slice has (None: it has no such
    port; a slice's ports are the pods' ports, not the Service's), or the slice's only port.
    Raises ValueError when it has several."""
    if isinstance(port, int):
        return port if any(number == port for _, number in piece.ports) else None
    if port is not None:
        return next((number for name, number in piece.ports if name == port), None)
    numbers = {number for _, number in piece.ports}
    if len(numbers) > 1:
        raise ValueError(f"the Service has several ports {sorted(numbers)}: name one (port)")
    return next(iter(numbers), None)


def _ready(endpoint: SliceEndpoint) -> bool:
    # The API: a ready condition not set means ready; a terminating endpoint is never ready.
    return endpoint.ready is not False and endpoint.terminating is not True


def _serving(endpoint: SliceEndpoint) -> bool:
    return endpoint.serving if endpoint.serving is not None else endpoint.ready is not False


def _endpoint_name(endpoint: SliceEndpoint, port: int) -> str:
    for name in (endpoint.pod, endpoint.hostname):
        if name and NAME_RE.match(name):
            return name
    return address_name(endpoint.address, port)


def from_slices(slices: Iterable[Slice], port: str | int | None) -> list[Endpoint]:
    """Endpoints for a Service's EndpointSlices, named by their pod.

    Ready endpoints only: one not ready, or terminating, gets no new requests (what it runs
    finishes, as for any instance that leaves). When none is ready but some still serve (every
    pod terminating, as in a rollout that replaces them all at once), those serve, as
    kube-proxy does: refusing every request would be worse. FQDN slices and endpoints without
    the port are skipped; an endpoint in both an IPv4 and an IPv6 slice counts once (IPv4).
    Raises ValueError when `port` is None and a slice has several ports."""
    ready: list[Endpoint] = []
    serving: list[Endpoint] = []
    pieces = sorted(slices, key=lambda s: s.address_type)  # IPv4 before IPv6
    for piece in pieces:
        if piece.address_type not in ("IPv4", "IPv6"):
            continue
        number = _slice_port(piece, port)
        if number is None:
            continue
        for item in piece.endpoints:
            try:
                found = Endpoint(
                    _endpoint_name(item, number), str(ipaddress.ip_address(item.address)), number
                )
            except ValueError:
                continue  # not an address: nothing to connect to
            if _ready(item):
                ready.append(found)
            elif _serving(item):
                serving.append(found)
    chosen = ready or serving
    by_name: dict[str, Endpoint] = {}
    for endpoint in chosen:
        by_name.setdefault(endpoint.name, endpoint)
    return sorted(by_name.values(), key=lambda e: e.name)
