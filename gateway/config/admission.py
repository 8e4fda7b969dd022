"""The queues in front of a pool, as the policy sets them: admission classes, tenants, the
concurrency limit, the KV-cache token budget and the engine's own load gauges."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from gateway.config.fields import TOKEN_RE, Fraction, Strict, UrlPath, off_or_defaults
from gateway.config.units import Duration


class AdmissionClassPolicy(Strict):
    """One admission class: its share of the service, queue bound and longest wait.

    The standard and batch classes wait minutes by default, as long as a client going direct
    would wait in the engine's own queue: a shorter wait answers 429 to requests the engines
    would have served. Interactive requests, served first by weight, give up after 1 s."""

    weight: float = Field(default=2.0, gt=0)
    max_queue: int = Field(default=500, ge=0)
    queue_timeout: Duration = Field(default=300.0, gt=0)


class InteractivePolicy(AdmissionClassPolicy):
    weight: float = Field(default=4.0, gt=0)
    max_queue: int = Field(default=100, ge=0)
    queue_timeout: Duration = Field(default=1.0, gt=0)


class BatchPolicy(AdmissionClassPolicy):
    weight: float = Field(default=1.0, gt=0)
    max_queue: int = Field(default=1000, ge=0)
    queue_timeout: Duration = Field(default=600.0, gt=0)


class ConcurrencyPolicy(Strict):
    """How many attempts an instance may have in flight: fixed, or learned from its latency."""

    mode: Literal["adaptive", "fixed"] = "adaptive"
    limit: int = Field(default=1024, ge=1)  # the fixed cap, and the adaptive one's maximum
    # The adaptive limit starts open: it comes down once latency, overload or the engine's own
    # gauges show congestion, so a pool is never held below what its engines serve before the
    # gateway has seen them serve anything.
    initial: int = Field(default=1024, ge=1)
    min: int = Field(default=2, ge=1)
    # How far a stream's time to first token may rise over its learned baseline, and a whole
    # answer's time per output token, before the adaptive limit shrinks. Time per token also
    # rises as a fuller batch decodes more slowly (throughput, not overload): more room.
    tolerance: float = Field(default=1.5, ge=1)
    per_token_tolerance: float = Field(default=2.0, ge=1)


class TokenBudgetPolicy(Strict):
    """The KV-cache tokens each instance is trusted with at once (absent: not counted)."""

    # vLLM logs it at start ("GPU KV cache size: N tokens") and exports it
    # (`vllm:cache_config_info`): read from each instance's engine when it does (that wins, as
    # one pool may mix GPU types), else this one (absent: instances whose engine does not say
    # are not counted).
    capacity: int | None = Field(default=None, ge=1)
    overcommit: float = Field(default=1.3, gt=0)  # requests rarely reach their max_tokens


class VllmSignalsPolicy(Strict):
    """The engine's own load gauges (vLLM's, or llama.cpp's server's), scraped per instance: a
    saturated instance gets no new work."""

    path: UrlPath = "/metrics"
    interval: Duration = Field(default=0.5, gt=0)
    timeout: Duration = Field(default=0.25, gt=0)
    # How long an instance whose page has none of the gauges (or no page) is left alone before
    # it is asked again: an engine may be replaced by one that has them.
    recheck: Duration = Field(default=30.0, gt=0)
    # Saturated above these: requests waiting in vLLM's own queue, share of the KV cache used.
    max_waiting: float = Field(default=0.0, ge=0)
    max_cache_usage: Fraction = 0.95


def _tenant_header(value: str) -> str:
    name = value.strip().lower()
    if not TOKEN_RE.match(name):
        raise ValueError(f"invalid header name {value!r}")
    if name.startswith("x-gateway-") or name in ("authorization", "x-api-key"):
        raise ValueError(
            f"the header {name!r} cannot name a tenant (without `header`, the API key does)"
        )
    return name


class TenantsPolicy(Strict):
    """Who a request is for, within its admission class: the client's API key (as a digest,
    `key-` and 12 hex digits) unless `header` names a header whose value is the tenant. A
    request with neither is the anonymous tenant ("")."""

    header: Annotated[str, AfterValidator(_tenant_header)] | None = None
    weights: dict[str, Annotated[float, Field(gt=0)]] = {}  # by tenant; the rest: default_weight
    default_weight: float = Field(default=1.0, gt=0)


class AdmissionPolicy(Strict):
    """Queues in front of the pool (on by default; `admission: false`: every request goes
    straight to an instance)."""

    default_priority: Literal["interactive", "standard", "batch"] = "standard"
    max_queued: int = Field(default=1000, ge=0)  # over the three classes
    interactive: InteractivePolicy = InteractivePolicy()
    standard: AdmissionClassPolicy = AdmissionClassPolicy()
    batch: BatchPolicy = BatchPolicy()
    concurrency: ConcurrencyPolicy = ConcurrencyPolicy()
    tenants: TenantsPolicy = TenantsPolicy()
    tokens: TokenBudgetPolicy | None = None
    # Read from every instance unless turned off; an engine without the gauges is left to
    # the limiter.
    vllm_signals: Annotated[VllmSignalsPolicy | None, BeforeValidator(off_or_defaults)] = (
        VllmSignalsPolicy()
    )
