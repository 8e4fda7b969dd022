"""The policy file as pydantic models: every key, its default, and the checks on one field.

Checks that relate several fields (duplicate names, tier order, floor vs ceiling...) live in
`checks.py` so each error can point at the exact key that is wrong.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Annotated, Final, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationInfo,
    model_validator,
)

from gateway.config import secrets

# The admission sections, defined in admission.py: imported from here like every other section.
from gateway.config.admission import AdmissionClassPolicy as AdmissionClassPolicy
from gateway.config.admission import AdmissionPolicy as AdmissionPolicy
from gateway.config.admission import BatchPolicy as BatchPolicy
from gateway.config.admission import ConcurrencyPolicy as ConcurrencyPolicy
from gateway.config.admission import InteractivePolicy as InteractivePolicy
from gateway.config.admission import TenantsPolicy as TenantsPolicy
from gateway.config.admission import TokenBudgetPolicy as TokenBudgetPolicy
from gateway.config.admission import VllmSignalsPolicy as VllmSignalsPolicy
from gateway.config.fallbacks import (
    FALLBACK_CAUSES,
    Api,
    FallbackCause,
    Targets,
)
from gateway.config.fields import (
    TOKEN_RE,
    Fraction,
    Smoothing,
    Strict,
    UrlPath,
    off_or_defaults,
    switch,
)
from gateway.config.units import Duration, Size

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _check_name(value: str) -> str:
    # Names appear in admin URLs, Redis keys and metric labels: keep them to a safe alphabet.
    if not NAME_RE.match(value):
        raise ValueError(
            f"invalid name {value!r}: use letters, digits, '.', '_' or '-' (at most 63)"
        )
    return value


def split_host_port(value: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` into its parts; raises ValueError when malformed."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"invalid listen address {value!r}: expected host:port")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"invalid port {port} in {value!r}")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            raise ValueError(f"invalid listen address {value!r}: unbalanced brackets")
        host = host[1:-1]
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"invalid listen address {value!r}: bad host")
    return host, port


def _check_listen(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"invalid listen address {value!r}: expected host:port, e.g. 0.0.0.0:8080")
    split_host_port(value)
    return value


def _check_upstream_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.username or parts.password:
        # Checked first, and the url is not echoed: error messages end up in logs.
        raise ValueError("credentials do not belong in an instance url")
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"invalid url {value!r}: the scheme must be http or https")
    if not parts.hostname or any(c.isspace() for c in parts.hostname):
        raise ValueError(f"invalid url {value!r}: no valid host")
    if parts.path.rstrip("/").endswith("/v1"):
        # The gateway appends /v1/chat/completions itself: this would call /v1/v1/...
        raise ValueError(f"invalid url {value!r}: give the server's root, without /v1")
    if parts.query or parts.fragment:
        raise ValueError(f"invalid url {value!r}: no query or fragment allowed")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise ValueError(f"invalid url {value!r}: {exc}") from None
    return value.rstrip("/")


def _check_redis_url(value: str) -> str:
    if urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        raise ValueError("redis_url must start with redis://, rediss:// or unix://")
    return value


Name = Annotated[str, AfterValidator(_check_name)]
ListenAddress = Annotated[str, BeforeValidator(_check_listen)]
UpstreamUrl = Annotated[str, AfterValidator(_check_upstream_url)]
RedisUrl = Annotated[str, AfterValidator(_check_redis_url)]

RETRY_KINDS = ("connect_failure", "reset", "timeout", "oom")


# Answers about the request, not the instance: a validation error, a prompt over the context
# window (handed to `context_fallbacks` instead), a content-policy refusal, a refused key.
_ABOUT_THE_REQUEST = frozenset((400, 401, 403))


def _parse_retry_condition(value: object) -> str | int:
    # One clear message instead of one per member of a union.
    if isinstance(value, str) and value in RETRY_KINDS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
        if value in _ABOUT_THE_REQUEST:
            raise ValueError(
                f"{value} is never retried: it is an answer about the request itself (invalid, "
                "too long for the model, refused by a content policy, or a key refused), "
                "which every attempt would get again"
            )
        return value
    raise ValueError(
        f"invalid retry condition {value!r}: use {', '.join(RETRY_KINDS)} "
        "or an HTTP status from 400 to 599"
    )


RetryCondition = Annotated[str | int, BeforeValidator(_parse_retry_condition)]


class AdminPolicy(Strict):
    listen: ListenAddress = "127.0.0.1:9901"
    token_env: Annotated[str, Field(min_length=1)] = "GATEWAY_ADMIN_TOKEN"


class MetricsPolicy(Strict):
    """A listener of its own serving `GET /metrics` without a token, for Prometheus to scrape
    from the pod's address (the admin plane's `/metrics` stays, behind its token). Absent: none."""

    listen: ListenAddress | None = None


def _check_cidr(value: object) -> str:
    import ipaddress

    if not isinstance(value, str):
        raise ValueError(f"invalid network {value!r}: expected an address or CIDR, e.g. 10.0.0.0/8")
    try:
        return str(ipaddress.ip_network(value.strip(), strict=True))
    except ValueError as exc:
        raise ValueError(f"invalid network {value!r}: {exc}") from None


Cidr = Annotated[str, BeforeValidator(_check_cidr)]


class LimitsPolicy(Strict):
    max_request_bytes: Size = Field(default=8 * 1024 * 1024, gt=0)
    # Slowloris / slow bodies: the request line and headers must arrive within header_timeout
    # of the connection (or of the request's first byte on a kept-alive one), the whole body
    # within body_timeout of the headers; else 408 and the connection is closed.
    header_timeout: Duration = Field(default=10.0, gt=0)
    body_timeout: Duration = Field(default=60.0, gt=0)
    max_header_bytes: Size = Field(default=64 * 1024, ge=1024)  # 431 above
    max_headers: int = Field(default=100, ge=8)  # 431 above
    max_uri_bytes: Size = Field(default=8 * 1024, ge=256)  # 414 above
    max_connections: int = Field(default=10000, ge=1)  # a fast 503 above
    # Peers whose X-Forwarded-For is believed (default: nobody's, the peer replaces it).
    trusted_proxies: tuple[Cidr, ...] = ()


class SharedPolicy(Strict):
    redis_url: RedisUrl
    key_prefix: Name = "gw"
    decision_ttl: Duration = Field(default=3.0, ge=0.3)
    # Bound on each Redis call (never retried): Redis is off the request path, but a slow one
    # must not stall the shared-state session for long either.
    timeout: Duration = Field(default=0.05, gt=0, le=1.0)
    # Learn other replicas' decisions in milliseconds from the channel; off (for a Redis
    # without pub/sub), the key re-reads every decision_ttl / 3 are the only source.
    pubsub: bool = True


class TelemetryPolicy(Strict):
    service_name: str = "llm-gateway"
    tracing: bool = False
    log_format: Literal["text", "json"] = "text"  # `gateway run --log-format` overrides it
    # One line per proxied request. Off by default, as in Envoy, Linkerd or Traefik: at
    # thousands of requests per second a line each costs a few percent of the throughput.
    access_log: bool = False


class DrainPolicy(Strict):
    """Graceful shutdown on SIGTERM (see README, "Graceful shutdown")."""

    # SIGTERM to closing the listeners: /readyz answers 503 while requests are still served,
    # so the endpoints controller takes the pod out of its Services first.
    delay: Duration = Field(default=5.0, ge=0)
    # From the listeners' closing: in-flight requests and streams may finish until then.
    timeout: Duration = Field(default=30.0, ge=0)


class InstancePolicy(Strict):
    name: Name
    url: UpstreamUrl


def split_nameserver(value: str) -> tuple[str, int]:
    """`IP`, `IP:PORT` or `[v6]:PORT` (a bare IPv6 address too) into address and port (53 when
    absent); raises ValueError otherwise: a resolver is reached by address, never by name."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else ("" if not rest else "x")
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        host, port = value, ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"invalid nameserver {value!r}: expected IP or IP:PORT") from None
    if port and (not port.isdigit() or not 0 < int(port) <= 65535):
        raise ValueError(f"invalid nameserver {value!r}: bad port")
    return host, int(port) if port else 53


def _check_nameserver(value: str) -> str:
    split_nameserver(value)
    return value


def _check_dns_name(value: str) -> str:
    labels = value.rstrip(".").split(".")
    if not value or len(value) > 253 or any(not _DNS_LABEL.match(label) for label in labels):
        raise ValueError(f"invalid DNS name {value!r}")
    return value


_DNS_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$")
Nameserver = Annotated[str, AfterValidator(_check_nameserver)]
DnsName = Annotated[str, AfterValidator(_check_dns_name)]
Port = Annotated[int, Field(ge=1, le=65535)]


class DnsDiscoveryPolicy(Strict):
    """Instances from DNS: A and AAAA records of `name` (a Kubernetes headless Service lists
    its ready pods so) on `port`, or SRV records (target and port each)."""

    name: DnsName
    port: Port | None = None  # A: required; SRV: the records give it
    type: Literal["A", "SRV"] = "A"
    # Asked again after this, or the records' TTL when that is sooner (not sooner than 1 s).
    interval: Duration = Field(default=5.0, gt=0)
    # Absent: the system's resolvers (/etc/resolv.conf, with its search domains).
    nameservers: tuple[Nameserver, ...] = ()
    timeout: Duration = Field(default=2.0, gt=0)  # one resolution, every nameserver tried

    @model_validator(mode="after")
    def _port_by_type(self) -> DnsDiscoveryPolicy:
        if self.type == "A" and self.port is None:
            raise ValueError("type A needs a port (SRV records carry their own)")
        if self.type == "SRV" and self.port is not None:
            raise ValueError("type SRV takes its ports from the records: remove port")
        return self


class KubernetesDiscoveryPolicy(Strict):
    """Instances from the EndpointSlices of a Service (or of every Service whose labels match
    `selector`: a Service's labels are copied to its slices), watched through the API."""

    namespace: Name | None = None  # absent: the gateway's own (its service account's)
    service: Name | None = None
    selector: Annotated[str, Field(min_length=1)] | None = None
    # The port's name in the Service, or its number in the slices (the pods' port, its
    # targetPort, not the Service's port); absent: the slices' only port.
    port: Annotated[str, Field(min_length=1)] | Port | None = None

    @model_validator(mode="after")
    def _one_target(self) -> KubernetesDiscoveryPolicy:
        if (self.service is None) == (self.selector is None):
            raise ValueError("give exactly one of service or selector")
        return self


class DiscoveryPolicy(Strict):
    """Where a pool learns its instances from, beside or instead of `instances`."""

    dns: DnsDiscoveryPolicy | None = None
    kubernetes: KubernetesDiscoveryPolicy | None = None
    scheme: Literal["http", "https"] = "http"  # how discovered instances are reached
    # An empty answer over a non-empty set is believed only after answers stayed empty this
    # long (a resolver restarting, a Service being edited must not empty the pool).
    grace: Duration = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _one_source(self) -> DiscoveryPolicy:
        if (self.dns is None) == (self.kubernetes is None):
            raise ValueError("give exactly one source: dns or kubernetes")
        return self

    @property
    def source(self) -> str:
        return "dns" if self.dns is not None else "kubernetes"


class HealthPolicy(Strict):
    enabled: bool = True
    path: UrlPath = "/health"
    interval: Duration = Field(default=2.0, gt=0)
    # Sooner while the verdict is in doubt, and right after a request timed out there or could
    # not connect (no sooner than this after the previous check): HAProxy's fastinter.
    fast_interval: Duration = Field(default=0.5, gt=0)
    timeout: Duration = Field(default=1.0, gt=0)
    healthy_threshold: int = Field(default=1, ge=1)
    unhealthy_threshold: int = Field(default=2, ge=1)
    slow_start: Duration = 0.0  # traffic share ramps from 10 % to full over this after healthy


class ConnectionsPolicy(Strict):
    """Connections to each instance of the pool. A request beyond `max` busy connections waits
    for one to come free, within `timeouts.connect`, then goes to another instance (or gets a
    503 `upstream_connection_limit`); at most `max_idle` are kept open idle."""

    max: int = Field(default=1024, ge=1)
    max_idle: int = Field(default=64, ge=0)


class TimeoutsPolicy(Strict):
    smoothing: Smoothing = 0.85
    initial: Duration = Field(default=30.0, gt=0)
    min_samples: int = Field(default=10, ge=1)
    floor: Duration = Field(default=0.25, gt=0)
    ceiling: Duration = Field(default=600.0, gt=0)
    jitter: Duration = 0.005
    connect: Duration = Field(default=1.0, gt=0)
    # Non-streamed requests: the guess per output token until it is learned, how many tokens
    # to assume when a request sets no max_tokens, and headroom over the learned rate.
    initial_per_token: Duration = Field(default=0.05, gt=0)
    assumed_max_tokens: int = Field(default=4096, ge=1)
    token_headroom: Annotated[float, Field(ge=0.0)] = 0.5
    # Streamed generations: the longest any attempt waits for its first byte, whatever the
    # prediction (absent: no limit). Not above `ceiling` (`checks.py`).
    first_token_max: Annotated[Duration, Field(gt=0)] | None = None


class TierPolicy(Strict):
    below: Annotated[float, Field(gt=0.0, le=1.0)]
    max_retries: int = Field(ge=0, le=10)
    backoff: Duration
    k: tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(ge=0)]]


DEFAULT_TIERS = (
    TierPolicy(below=0.005, max_retries=2, backoff=0.025, k=(1.2, 1.8)),
    TierPolicy(below=0.05, max_retries=3, backoff=0.05, k=(1.8, 3.0)),
    TierPolicy(below=1.0, max_retries=1, backoff=0.1, k=(3.0, 4.0)),
)


class BudgetPolicy(Strict):
    ratio: Annotated[float, Field(ge=0.0)] = 0.2
    min_per_second: Annotated[float, Field(ge=0.0)] = 5.0


class RateLimitBackoffPolicy(Strict):
    # A 429 without a usable Retry-After: its instance is left alone from `base` on, doubling
    # per such answer in a row, up to `max` (`core.backoff.rate_limit_pause_s`).
    base: Duration = Field(default=0.5, gt=0)
    max: Duration = Field(default=10.0, gt=0)


class RetriesPolicy(Strict):
    failure_smoothing: Smoothing = 0.97
    tiers: tuple[TierPolicy, ...] = Field(default=DEFAULT_TIERS, min_length=1)
    budget: BudgetPolicy = BudgetPolicy()
    max_backoff: Duration = Field(default=1.0, gt=0)  # cap of the exponential backoff
    max_retry_after: Duration = Field(default=10.0, ge=0)  # cap on a backend's Retry-After
    rate_limit_backoff: RateLimitBackoffPolicy = RateLimitBackoffPolicy()
    on: tuple[RetryCondition, ...] = (
        "connect_failure",
        "reset",
        "timeout",
        429,
        500,
        502,
        503,
        504,
        529,  # Anthropic's overloaded_error
    )


class BreakerPolicy(Strict):
    consecutive_timeouts: int = Field(default=3, ge=1)
    consecutive_failures: int = Field(default=5, ge=1)  # of any kind, as Envoy's consecutive_5xx
    error_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 0.15
    window: Duration = Field(default=60.0, gt=0)
    min_requests: int = Field(default=20, ge=1)
    isolation: Duration = Field(default=5.0, gt=0)
    max_isolation: Duration = Field(default=120.0, gt=0)
    max_isolated_fraction: Fraction = 0.5
    # Back in traffic (an isolation over, its health checks passing again), an instance's share
    # ramps from 10 % to full over this rather than taking a queue's backlog at once; 0: off.
    slow_start: Duration = Field(default=3.0, ge=0)
    # With nothing healthy and admitting: (panic, the default) send the traffic anyway to the
    # least bad instances, as Envoy's panic threshold does, and answer 503 once each refused
    # the request; or (fail_fast) answer 503 at once.
    when_none_available: Literal["fail_fast", "panic"] = "panic"


# Headers a credential may not be sent in: the connection's own, what the gateway computes,
# and the gateway's own prefix.
_RESERVED_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-type",
        "expect",
        "traceparent",
        "tracestate",
    }
)


def _check_header_name(value: str) -> str:
    name = value.strip().lower()
    if not TOKEN_RE.match(name):
        raise ValueError(f"invalid header name {value!r}")
    if name in _RESERVED_HEADERS or name.startswith(("x-gateway-", "x-forwarded-")):
        raise ValueError(f"the header {name!r} cannot carry a credential")
    return name


HeaderName = Annotated[str, AfterValidator(_check_header_name)]
# The policy loader passes the policy file's folder as `base_dir` in the validation context,
# and `resolve: False` when secrets are not to be read (`gateway check` without `--resolve`:
# a CI pipeline checks the file, not the Secrets of the cluster it will run in).
BASE_DIR: Final = "base_dir"
RESOLVE: Final = "resolve"


def _resolving(info: ValidationInfo) -> bool:
    return not (isinstance(info.context, dict) and info.context.get(RESOLVE) is False)


def _resolve_path(value: str, info: ValidationInfo) -> str:
    """A relative path names a file next to the policy file (as nginx's includes do), not
    one in whatever folder the gateway was started from."""
    base = info.context.get(BASE_DIR) if isinstance(info.context, dict) else None
    if base is None or os.path.isabs(value):
        return value
    return os.path.normpath(os.path.join(base, value))


FilePath = Annotated[str, Field(min_length=1), AfterValidator(_resolve_path)]


class TlsPolicy(Strict):
    """How a pool's https:// instances are verified (absent: system CAs, verification on)."""

    ca_file: FilePath | None = None  # PEM bundle of the CAs to trust (default: the system's)
    verify: bool = True  # false: no certificate check at all (logged as a warning)
    # The bundle's text, read at validation (again on each reload: a rotated CA is a change).
    _ca_pem: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _read_ca(self, info: ValidationInfo) -> TlsPolicy:
        if self.ca_file is not None and _resolving(info):
            self._ca_pem = secrets.ca_bundle(self.ca_file)
        return self

    @property
    def ca_pem(self) -> str | None:
        return self._ca_pem


class CredentialsPolicy(Strict):
    """The credential the gateway sends upstream in place of whatever the client sent."""

    header: HeaderName = "authorization"  # `authorization` sends `Bearer <value>`
    from_env: Annotated[str, Field(min_length=1)] | None = None
    from_file: FilePath | None = None
    # The value, read at validation (again on each reload); never dumped nor shown.
    _value: str = PrivateAttr(default="")

    @model_validator(mode="after")
    def _read_value(self, info: ValidationInfo) -> CredentialsPolicy:
        if (self.from_env is None) == (self.from_file is None):
            raise ValueError("give exactly one of from_env or from_file")
        if _resolving(info):
            self._value = secrets.secret_value(self.from_env, self.from_file)
        return self

    @property
    def source(self) -> str:
        """Where the value comes from, safe to show: `env:NAME` or `file:PATH`."""
        return f"env:{self.from_env}" if self.from_env is not None else f"file:{self.from_file}"

    def header_value(self) -> str:
        return f"Bearer {self._value}" if self.header == "authorization" else self._value


class AuthPolicy(Strict):
    """Client authentication on the data plane: the API keys clients must present."""

    api_keys_env: Annotated[str, Field(min_length=1)] | None = None
    api_keys_file: FilePath | None = None
    _keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _read_keys(self, info: ValidationInfo) -> AuthPolicy:
        if (self.api_keys_env is None) == (self.api_keys_file is None):
            raise ValueError("give exactly one of api_keys_env or api_keys_file")
        if _resolving(info):
            self._keys = secrets.api_keys(self.api_keys_env, self.api_keys_file)
        return self

    @property
    def keys(self) -> tuple[str, ...]:
        return self._keys


class ResumePolicy(Strict):
    """A stream that breaks after its first byte continued on another attempt (on by
    default): the text the client has is a prefix the next instance extends."""

    enabled: bool = True
    # Per request. A rolling restart of a pool of three cuts a long answer up to three times;
    # a request that itself breaks its engines is bounded by this, the resume budget and the
    # breakers (each break is a failure of its instance).
    max_resumes: int = Field(default=3, ge=0)
    # Resumes allowed over 10 s, as a share of the streams that reached their first byte (plus
    # `retries.budget.min_per_second`): a budget of their own, apart from the retries'. A
    # rolling restart cuts a third of a pool's streams at once, and a continuation replaces
    # the work of the stream it continues, it adds none.
    budget: Fraction = 1.0
    # The text kept per stream to continue it from; a longer stream is not resumable.
    max_text: Size = Field(default=1024 * 1024, gt=0)
    # Whether the pool's engines stream a continued prefix again before the continuation
    # (llama.cpp's server does on the Messages route): `auto` drops it when it comes.
    echo: Literal["auto", "never", "always"] = "auto"
    # Whole (non-streamed) answers fetched as streams and assembled by the gateway, so that one
    # cut mid-generation is continued like a stream instead of generated again from nothing.
    whole_answers: bool = True


Resume = Annotated[ResumePolicy, BeforeValidator(switch)]


class HedgingPolicy(Strict):
    """A first attempt that has not answered within its instance's predicted first byte plus
    `k` deviations gets a second one on another instance; the first to answer wins (on by
    default; never in a pool of one; each hedge spends retry budget)."""

    enabled: bool = True
    k: float = Field(default=2.0, ge=0)
    # Never sooner: a hedge costs a whole attempt, and below this a machine's own hiccups
    # would send hedges for answers that were never late.
    min_delay: Duration = Field(default=0.05, ge=0)


Hedging = Annotated[HedgingPolicy, BeforeValidator(switch)]


class PoolPolicy(Strict):
    models: tuple[Annotated[str, Field(min_length=1)], ...] = Field(min_length=1)
    instances: tuple[InstancePolicy, ...] = ()
    discovery: DiscoveryPolicy | None = None
    health: HealthPolicy = HealthPolicy()
    timeouts: TimeoutsPolicy = TimeoutsPolicy()
    connections: ConnectionsPolicy = ConnectionsPolicy()
    retries: RetriesPolicy = RetriesPolicy()
    breaker: BreakerPolicy = BreakerPolicy()
    resume: Resume = ResumePolicy()
    hedging: Hedging = HedgingPolicy()
    admission: Annotated[AdmissionPolicy | None, BeforeValidator(off_or_defaults)] = (
        AdmissionPolicy()
    )
    tls: TlsPolicy | None = None
    credentials: CredentialsPolicy | None = None
    # The API family its instances speak (absent: whatever route they are asked); a request
    # handed over from a pool of the other family is translated (README, "Fallbacks").
    api: Api | None = None
    # Where a request this pool cannot answer goes next, before its first byte (`fallback_on`
    # says for what), and where a prompt too long for its context window goes.
    fallbacks: Targets = ()
    context_fallbacks: Targets = ()
    fallback_on: tuple[FallbackCause, ...] = FALLBACK_CAUSES


class Policy(Strict):
    listen: ListenAddress = "0.0.0.0:8080"
    admin: AdminPolicy = AdminPolicy()
    metrics: MetricsPolicy = MetricsPolicy()
    limits: LimitsPolicy = LimitsPolicy()
    shared: SharedPolicy | None = None
    telemetry: TelemetryPolicy = TelemetryPolicy()
    drain: DrainPolicy = DrainPolicy()
    pools: dict[Name, PoolPolicy] = Field(min_length=1)
    auth: AuthPolicy | None = None  # absent: clients are not authenticated
