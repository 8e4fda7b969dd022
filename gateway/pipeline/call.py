"""The request as it flows through the pipeline, and the shapes of layers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config.routes import Route
from gateway.core.admission import Priority
from gateway.core.timeouts import AttemptTimeouts
from gateway.runtime import Cancellation
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.response import UpstreamResponse


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the gateway reads from a request body; the body itself is forwarded untouched."""

    model: str
    stream: bool
    max_tokens: int | None
    # The body as parsed (kept by reference, not copied): what a resumed stream's next request
    # is built from. Empty for a multipart body.
    request: dict[str, Any] = field(default_factory=dict)
    # A multipart body (an audio file and its form fields): its size says nothing of a prompt.
    form: bool = False


@dataclass(slots=True)
class Call:
    """One client request: what to send, where it may go, and what happened so far."""

    pool: PoolState
    route: Route
    query: str
    body: bytes
    headers: list[tuple[str, str]]
    facts: RequestFacts
    deadline: float  # event-loop time by which the whole exchange must end
    # The request's task, and why it is being cancelled (a deadline, the client gone, the
    # drain): `gateway.runtime`.
    cancellation: Cancellation
    # Sending it twice could do something twice (`config.routes.acts`): sent again only when
    # it never left, never hedged, never resent on a connection that dropped.
    acts: bool = False
    attempts: int = 0
    # Of those, hedges (`pipeline.hedge`): upstream attempts, but no retry's, so they leave
    # the retry tier's allowance as it was.
    hedges: int = 0
    # The attempt after which the retry tier allows no other (a retry on a lone instance may
    # still come): that one is not given up on early (see `attempt_timeouts`' `final`).
    last_attempt: int = 1
    tried: list[InstanceState] = field(default_factory=list)
    # Instances that refused this request's connection, dropped it before answering or let it
    # time out: no retry goes back to them while any other instance could take it, isolated
    # ones included (panic routing).
    avoid: list[InstanceState] = field(default_factory=list)
    # Instances that let this request's first byte time out after all the patience an
    # unlearned instance gets (or with their health checks unanswered), and when the attempt
    # began: while one has sent no byte to anyone since, it is not asked again (`silent`).
    timed_out: list[tuple[InstanceState, float]] = field(default_factory=list)
    instance: InstanceState | None = None  # of the current attempt
    k: float = 1.0  # the deviation multiplier of the pool's current retry tier
    probe: bool = False  # the current attempt is its isolated instance's one probe
    timeouts: AttemptTimeouts | None = None  # of the current attempt
    priority: Priority | None = None  # x-gateway-priority; None: the pool's default
    tokens: int = 0  # its estimated KV-cache need, in pools that budget tokens
    prompt_tokens: int = 0  # its prompt's estimated size (set by the deadline layer)
    # Where admission reserved those tokens, until the first attempt takes them over.
    reserved: InstanceState | None = None

    def silent(self, instance: InstanceState) -> bool:
        """Whether `instance` let this request's first byte time out and has sent no byte on
        any attempt since that attempt began: asked again, it would most likely let the
        request wait out another whole timeout."""
        return any(inst is instance and instance.progress_at <= at for inst, at in self.timed_out)

    @property
    def path(self) -> str:
        return self.route.path

    def prompt_bytes(self) -> int:
        """The size of its prompt as the body tells it (0: the body is not a prompt)."""
        return 0 if self.facts.form else len(self.body)


Handler = Callable[[Call], Awaitable[UpstreamResponse]]


class Layer(Protocol):
    """One concern of the request path: does its part, then awaits `next_handler(call)`."""

    def __call__(self, call: Call, next_handler: Handler) -> Awaitable[UpstreamResponse]: ...
