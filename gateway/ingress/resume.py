"""Resuming a stream that broke after its first byte: whether, and how the next attempt goes.

The relay (`ingress.relay`) asks `plan` when a stream it forwards breaks (a reset, an EOF
before the protocol's last event, an idle timeout, the engine's own error event). The answer
is one of:
- the bytes that end the stream properly, when the generation had ended and only its last
  events were lost;
- a `Continue`: the next attempt's body and the rewriter of its events (`core.continuation`),
  sent through the request path below admission (`start`, as `stream_resume` wires it): it
  picks another instance (the one that broke is avoided while any other can take it), retries
  before its own first byte, and keeps the client's deadline;
- a refusal (its reason), and the stream ends as it would without resume. A whole answer
  fetched as a stream (`ingress.whole`), whose client has seen nothing yet, is asked again
  from nothing instead (a `Continue` without a rewriter: `Restart`), within the same limits.

A resume is allowed within `resume.max_resumes` per request and the pool's resume budget,
before the request's deadline. The resume budget is the retry budget's rule with its own
counts: resumes up to `resume.budget` (1.0) of the streams that reached their first byte over
the last 10 s, plus `retries.budget.min_per_second`. Its own, so that a rolling restart, which
cuts a third of a pool's streams at once and refuses new requests meanwhile, leaves both the
cut streams and the refused requests their chance: a continuation replaces the work of the
stream it continues, it adds none. Every resume is counted per pool, instance and reason; a
stream that broke and could not be resumed is counted by the reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from gateway.config.models import ResumePolicy
from gateway.config.routes import CHAT_PATH, COMPLETIONS_PATH, MESSAGES_PATH
from gateway.core import continuation_anthropic, continuation_openai
from gateway.core.backoff import backoff_s
from gateway.core.breaker import ADMITTING
from gateway.core.continuation import NotResumable, Rewriter, Transcript
from gateway.errors import (
    GatewayError,
    UpstreamError,
    UpstreamLeft,
    UpstreamProtocolError,
    UpstreamStreamCut,
    UpstreamStreamError,
    UpstreamTimeout,
)
from gateway.pipeline.call import Call, Handler
from gateway.runtime import Clock
from gateway.upstream.instance import InstanceState
from gateway.upstream.pool import PoolState
from gateway.upstream.response import Owned, UpstreamResponse

# A stream is moved for its pace when its mean gap over `PACE_WINDOW` chunks, in
# `SLOW_WINDOWS` windows in a row, is this many times the best other instance's largest gap.
SLOW_STREAM_FACTOR = 3.0
PACE_WINDOW = 16
SLOW_WINDOWS = 2
# The wait before a continuation is tried again after one failed before its first byte (every
# instance it could go to refused it: a pool restarting, a lone instance coming back):
# doubling from this, at most `retries.max_backoff`, half of it fixed and half jittered so
# that the streams a restart cut together do not come back together.
RESUME_PAUSE_S = 0.25

# Sends a continuation through the request path; returns its response and the idle timeout
# of its stream.
# How a continuation is sent: given the resume it is for, its body and the instance that broke
# the stream. The resume is an argument rather than something the function holds: a resume
# that held a function holding it would be a reference cycle, freed by the collector only.
Start = Callable[["StreamResume", bytes, InstanceState], Awaitable[tuple[UpstreamResponse, float]]]


@dataclass(frozen=True, slots=True)
class Continue:
    """The next attempt: its body, and the rewriter of its events (None: a restart, whose
    events go on as they come, into a fresh transcript)."""

    body: bytes
    rewriter: Rewriter | None


@dataclass(frozen=True, slots=True)
class Restart:
    """How a whole answer fetched as a stream starts again from nothing when it cannot be
    continued (its client has seen nothing yet): the request's streamed body, a fresh
    transcript, and `reset`, which empties what was assembled so far."""

    body: bytes
    transcript: Callable[[], Transcript | None]
    reset: Callable[[], None]


# Refusals that bound the request's resumes: a restart is bounded by them too.
_LIMITS = frozenset({"max_resumes", "deadline", "budget"})


def refusal_for(path: str, request: dict[str, Any]) -> str | None:
    """Why a stream on `path` could not be continued, decided from its request alone."""
    if path in (CHAT_PATH, COMPLETIONS_PATH):
        return continuation_openai.refusal(request, path == CHAT_PATH)
    if path == MESSAGES_PATH:
        return continuation_anthropic.refusal(request)
    return "route"


def transcript_for(
    path: str, request: dict[str, Any], policy: ResumePolicy
) -> tuple[Transcript | None, str | None]:
    """The transcript a stream on `path` keeps, or why it cannot be resumed at all."""
    if not policy.enabled:
        return None, "off"
    refused = refusal_for(path, request)
    if refused is not None:
        return None, refused
    max_text, echo = policy.max_text, policy.echo
    if path == MESSAGES_PATH:
        return continuation_anthropic.AnthropicTranscript(request, max_text, echo), None
    return continuation_openai.OpenAITranscript(request, path == CHAT_PATH, max_text, echo), None


def break_reason(error: UpstreamError) -> str:
    """A bounded label for what broke a stream."""
    if isinstance(error, UpstreamTimeout):
        return "idle_timeout"
    if isinstance(error, UpstreamStreamError):
        return "error_event"
    if isinstance(error, UpstreamStreamCut):
        return "eof"
    if isinstance(error, UpstreamLeft):
        return error.reason  # isolated, slow: why the gateway moved it
    return {"reset": "reset", "protocol": "protocol"}.get(error.kind, "error")


class StreamResume:
    """One streamed request's resumes."""

    def __init__(
        self,
        transcript: Transcript | None,
        refusal: str | None,
        policy: ResumePolicy,
        pool: PoolState,
        start: Start,
        clock: Clock,
        deadline: float,
        restart: Restart | None = None,
    ) -> None:
        self.transcript = transcript
        self._refusal = refusal
        self._policy = policy
        self._pool = pool
        self._start = start
        self._clock = clock
        self._deadline = deadline
        pool.resume_budget.record_request(clock())  # a stream past its first byte
        self.resumes = 0
        self.reasons: list[str] = []  # why each resume happened, in order
        self.attempts = 0  # the continuations' attempts, retries included
        self.failed_starts = 0  # continuations that failed before their first byte
        # The stream's last events as the client got them (rewritten after a resume): where
        # the usage it was told sits, set by the relay when it ends.
        self.told = b""
        self.instance: InstanceState | None = None  # where the stream ended
        self._prepaid = False  # a move (`movable`) spent the next resume's budget already
        # For a whole answer: how it starts again when it cannot be continued (None: a stream,
        # whose client already has part of it).
        self.restart = restart

    async def start(self, body: bytes, broken: InstanceState) -> tuple[UpstreamResponse, float]:
        """Sends a continuation (`body`) after `broken` broke the stream: its response, at its
        first byte, and the idle timeout of its stream."""
        return await self._start(self, body, broken)

    def pause_s(self) -> float:
        """How long to wait before trying again a continuation that just failed before its
        first byte (`RESUME_PAUSE_S`). The stream's client already waits through gaps of its
        stream: a short wait there can see an instance back where trying again at once would
        spend the stream's last resumes on the same refusals."""
        self.failed_starts += 1
        pool = self._pool
        cap = pool.policy.retries.max_backoff
        return backoff_s(self.failed_starts, RESUME_PAUSE_S, cap, pool.rng, fixed=0.5)

    @property
    def moves(self) -> bool:
        """Whether a healthy-looking attempt may be left (its instance isolated, its pace far
        too slow): a stream's, not a whole answer's, whose client sees nothing before the end
        and would lose the generation so far."""
        return self.restart is None

    def plan(self, error: UpstreamError, broken: InstanceState) -> Continue | bytes | str:
        """What to do about a stream `error` broke on `broken`."""
        refused = self._why_not(error)
        if isinstance(refused, bytes):
            return refused
        if refused is not None:
            if self._restartable(refused, spent=False):
                return self._restarted(error, broken)
            self._pool.stats.not_resumed(refused)
            return refused
        transcript = self.transcript
        assert transcript is not None
        try:
            body, rewriter = transcript.continuation()
        except NotResumable as exc:
            if self._restartable(str(exc), spent=True):
                return self._restarted(error, broken)
            self._pool.stats.not_resumed(str(exc))
            return str(exc)
        self._resumed(error, broken)
        return Continue(body, rewriter)

    def _resumed(self, error: UpstreamError, broken: InstanceState) -> None:
        reason = break_reason(error)
        self.resumes += 1
        self.reasons.append(reason)
        self._pool.stats.resumed(broken.name, reason)

    def _restartable(self, refused: str, *, spent: bool) -> bool:
        """Whether a whole answer that cannot be continued (a reasoning or tool call in
        progress, too much text, an unreadable event) may start again, within the same
        limits and budget as a resume."""
        if self.restart is None or refused in _LIMITS:
            return False  # the limits were checked before the transcript (`_checks`)
        return spent or self._pool.resume_budget.try_spend(self._clock())

    def _restarted(self, error: UpstreamError, broken: InstanceState) -> Continue:
        restart = self.restart
        assert restart is not None
        self.transcript = restart.transcript()
        restart.reset()
        self._resumed(error, broken)
        return Continue(restart.body, None)

    def too_slow(self, instance: InstanceState, pace_s: float) -> bool:
        """Whether a stream whose chunks came `pace_s` apart on average is far slower than the
        pool's other instances make theirs: its mean gap above `SLOW_STREAM_FACTOR` times
        the learned largest gap of the best other instance that takes traffic (so a healthy
        stream's pauses never count, and an instance nobody learned is not judged)."""
        best: float | None = None
        min_samples = self._pool.policy.timeouts.min_samples
        for other in self._pool.routable:
            if other is instance or other.breaker.state != ADMITTING or other.engine.saturated:
                continue
            gap = other.latency.gap
            if gap.samples >= min_samples and (best is None or gap.mean < best):
                best = gap.mean
        return best is not None and pace_s > SLOW_STREAM_FACTOR * best

    def movable(self) -> bool:
        """Whether the stream could be continued elsewhere now, asked before moving it off a
        healthy-looking attempt (its instance is being left): everything `plan` checks, the
        retry budget spent now, so a stream that moves is never one that then cannot."""
        if self._prepaid:
            return True
        if self._checks() is not None:
            return False
        pool = self._pool
        if not pool.resume_budget.try_spend(self._clock()):
            return False
        self._prepaid = True
        return True

    def _why_not(self, error: UpstreamError) -> bytes | str | None:
        prepaid, self._prepaid = self._prepaid, False
        refused = self._checks()
        if refused is not None or prepaid:
            return refused
        if not self._pool.resume_budget.try_spend(self._clock()):
            return "budget"
        return None

    def _checks(self) -> bytes | str | None:
        """All but the budget: an ending to send instead, a refusal, or None."""
        if self._refusal is not None:
            return self._refusal
        transcript = self.transcript
        assert transcript is not None
        transcript.fold()
        ending = transcript.finishing()
        if ending is not None:
            return ending
        if self.resumes >= self._policy.max_resumes:
            return "max_resumes"
        if self._clock() >= self._deadline:
            return "deadline"
        return transcript.why_not()


# The continuation of a stream on a fallback pool, given the request's call, the
# continuation's body and what the continuation met in its own pool (None: no fallback takes
# it): `ingress.fallback.Fallbacks.continuation`.
OnFallback = Callable[[Call, bytes, GatewayError], Call | None]


def stream_resume(
    call: Call,
    handler: Handler,
    clock: Clock,
    traced: bool,
    restart: Callable[[], None] | None = None,
    fallback: OnFallback | None = None,
) -> StreamResume:
    """A stream's resume: its transcript (or why it has none), and how a continuation is
    sent: the same request with the continuation's body, through the layers below admission
    (`handler`), avoiding the instances that broke it (`traced`: an event on the request's
    span for each); when its pool has no instance left to continue it on, on a fallback pool
    (`fallback`, None: none). For a whole answer fetched as a stream (`restart`: what empties
    what it assembled so far), also how it starts again from nothing when it cannot be
    continued."""
    pool = call.pool
    policy = pool.policy.resume
    request = call.facts.request
    path = call.route.path
    transcript, refusal = transcript_for(path, request, policy)
    if call.translation is not None:
        # Answered in another API family: a continuation would have to be translated too.
        transcript, refusal = None, "translated"

    left: list[InstanceState] = []  # the instances that broke this stream so far

    async def start(
        resume: StreamResume, body: bytes, broken: InstanceState
    ) -> tuple[UpstreamResponse, float]:
        left.append(broken)
        continued = call.for_continuation(body, left)
        if traced:
            trace.get_current_span().add_event(
                "stream resumed",
                {
                    "gateway.resume.reason": resume.reasons[-1],
                    "gateway.resume.from_instance": broken.name,
                    "gateway.resume.count": resume.resumes,
                },
            )
        try:
            response = await handler(continued)
        except GatewayError as failed:
            moved = fallback(call, body, failed) if fallback is not None else None
            if moved is None:
                raise
            resume.attempts += continued.attempts
            continued = moved
            response = await handler(continued)
        finally:
            resume.attempts += continued.attempts
            if continued.attempt.instance is not None:
                resume.instance = continued.attempt.instance
        if response.status != 200 or not response.is_sse:
            # The engine refused the continuation (an engine that does not continue a final
            # message answers 400): the stream ends as it would have.
            with Owned(response) as refused:
                refused.ok = response.body is not None
            pool.stats.not_resumed("refused")
            raise UpstreamProtocolError(
                f"the continuation was answered with HTTP {response.status}"
            )
        timeouts = continued.attempt.timeouts
        assert timeouts is not None
        return response, timeouts.idle_s or timeouts.first_byte_s

    again = None
    if restart is not None:

        def fresh() -> Transcript | None:
            return transcript_for(path, request, policy)[0]

        again = Restart(call.body, fresh, restart)
    return StreamResume(transcript, refusal, policy, pool, start, clock, call.deadline, again)
