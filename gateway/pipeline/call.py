"""The request as it flows through the pipeline, and the shapes of layers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gateway.config.routes import Route
from gateway.core.admission import Priority
from gateway.core.timeouts import AttemptTimeouts
from gateway.runtime import Cancellation
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.response import UpstreamResponse
from gateway.upstream.translated import Translated


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
class Attempt:
    """The state of a call's current attempt: where it went, on what terms, and what it holds.

    The pick and deadline layers set theirs for each attempt, admission what the first attempt
    takes over; a retry goes on in the same one. A hedge or a stream's continuation is a call
    of its own whose attempt starts as a new `Attempt` (`Call.for_hedge`,
    `Call.for_continuation`), and a hedge that answers first hands its attempt over whole
    (`Call.adopt`): nothing added here can be carried into a new call, nor left behind by one
    that wins.
    """

    instance: InstanceState | None = None
    probe: bool = False  # it is its isolated instance's one probe
    timeouts: AttemptTimeouts | None = None
    # Its estimated KV-cache need, in pools that budget tokens (set by admission, which a hedge
    # and a continuation do not go through: theirs hold none).
    tokens: int = 0
    # Where admission reserved those tokens, until the first attempt takes them over.
    reserved: InstanceState | None = None


@dataclass(slots=True)
class Call:
    """One client request: what to send, where it may go, and what happened so far.

    The request's own fields, which every call made for it carries (a continuation with a body
    of its own); the history of its retry loop (attempts, what was tried and avoided); and its
    current attempt (`attempt`), which a hedge's or a continuation's call starts anew.
    """

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
    priority: Priority | None = None  # x-gateway-priority; None: the pool's default
    # Whether fallback pools may answer it when its pool cannot (`ingress.fallback`): its pool
    # then does not panic for it (`breaker.when_none_available`: the fallbacks come first, and
    # the pool with panic routing is their last resort).
    handover: bool = False
    # Sent to a pool of the other API family (`upstream.translated`): the path and body it
    # goes with there, and how its answer is read back in the client's family. None: as is.
    translation: Translated | None = None
    # Its prompt's estimated size, worked out from `body` once (by the deadline or the hedge
    # layer) for every attempt that sends it.
    prompt_tokens: int = 0
    attempts: int = 0
    # Of those, hedges (`pipeline.hedge`): upstream attempts, but no retry's, so they leave
    # the retry tier's allowance as it was.
    hedges: int = 0
    # The attempt after which the retry tier allows no other (a retry on a lone instance may
    # still come): that one is not given up on early (see `attempt_timeouts`' `final`).
    last_attempt: int = 1
    k: float = 1.0  # the deviation multiplier of the pool's current retry tier
    tried: list[InstanceState] = field(default_factory=list)
    # Instances that refused this request's connection, dropped it before answering or let it
    # time out: no retry goes back to them while any other instance could take it, isolated
    # ones included (panic routing).
    avoid: list[InstanceState] = field(default_factory=list)
    # Instances that let this request's first byte time out after all the patience an
    # unlearned instance gets, or all a stream's first byte may get (`first_token_max`), or
    # with their health checks unanswered, and when the attempt began: while one has sent no
    # byte to anyone since, it is not asked again (`silent`).
    timed_out: list[tuple[InstanceState, float]] = field(default_factory=list)
    attempt: Attempt = field(default_factory=Attempt)

    def for_hedge(self) -> Call:
        """The call a hedge of the current attempt sends (`pipeline.hedge`): the same request
        and retry loop (its attempts counted on from this call's, what either tries or times
        out on seen by both), avoiding the current attempt's instance."""
        instance = self.attempt.instance
        assert instance is not None, "a hedge follows an attempt the pick layer sent"
        return self._next(
            body=self.body,
            prompt_tokens=self.prompt_tokens,
            attempts=self.attempts,
            hedges=self.hedges,
            tried=self.tried,
            avoid=[instance, *self.avoid],
        )

    def for_continuation(self, body: bytes, avoid: list[InstanceState]) -> Call:
        """The call that continues a stream broken after its first byte, with `body` (the
        request and what was relayed): a retry loop of its own (no attempts yet, nothing
        tried), avoiding `avoid` (the instances that broke the stream) and this call's
        avoided ones. Instances that timed out stay silent for it as for this call."""
        continued = self._next(
            body=body, prompt_tokens=0, attempts=0, hedges=0, tried=[], avoid=[*avoid, *self.avoid]
        )
        # Its own pool may panic for it and wait out pauses: the fallbacks that may take it
        # are asked only when that pool had nothing left (`ingress.resume`).
        continued.handover = False
        return continued

    def for_fallback(
        self,
        pool: PoolState,
        body: bytes,
        facts: RequestFacts,
        deadline: float,
        translation: Translated | None = None,
    ) -> Call:
        """The request handed over to another pool (`ingress.fallback`), as `body` (its model
        that pool's; `translation`: in that pool's API family): a request of its own there,
        from admission on, with nothing of this call's attempts, the instances it tried or
        avoided being another pool's."""
        return Call(
            pool=pool,
            route=self.route,
            query=self.query,
            body=body,
            headers=self.headers,
            facts=facts,
            deadline=deadline,
            cancellation=self.cancellation,
            acts=self.acts,
            priority=self.priority,
            translation=translation,
        )

    def _next(
        self,
        *,
        body: bytes,
        prompt_tokens: int,
        attempts: int,
        hedges: int,
        tried: list[InstanceState],
        avoid: list[InstanceState],
    ) -> Call:
        """The next call made for this request: what is named here, the rest of the request as
        this call's, and an attempt of its own."""
        return replace(
            self,
            body=body,
            prompt_tokens=prompt_tokens,
            attempts=attempts,
            hedges=hedges,
            tried=tried,
            avoid=avoid,
            attempt=Attempt(),
        )

    def adopt(self, hedge: Call) -> None:
        """Go on with `hedge`'s attempt, which answered first: its instance, timeouts and all
        else it holds become this call's (its attempts are counted by the hedge layer)."""
        self.attempt = hedge.attempt

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
