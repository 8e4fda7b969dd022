"""Fallbacks: a request its model's pool cannot answer, handed over to the next pool the policy
names (`pools.<name>.fallbacks`, `context_fallbacks`), before its first byte.

The request goes through its own pool's whole path first (admission, retries, hedges): a
fallback is what comes after the pool gave up, never instead of a retry there. It hands over
when the pool's answer is one of the causes its `fallback_on` names (`config.fallbacks`): no
instance could take it, admission shed it, its retries ran out, a 429 or a 5xx after them. A
prompt over the model's context window (`core.refusals`) goes to `context_fallbacks` only, and
never to the same model again. Nothing else hands over: a validation error, a content-policy
refusal or a refused key is the answer, whoever asks.

While its fallbacks may answer, the request's own pool does not panic (`Call.handover`): with
no instance healthy and admitting, it goes to a fallback at once rather than to the least bad
of its instances (which would hammer a pool that is down). When no fallback answered, the own
pool is tried once more, panic routing allowed, as it would be without fallbacks: its
instances may have been isolated wrongly, and its least bad answer beats none.

The pools are tried depth first (a fallback's own fallbacks before the next of the pool's
list), each at most once, at most `MAX_FALLBACK_DEPTH` hand-overs per request, within the
request's own deadline. A fallback's answer is taken when it is not a failure of its own;
when every pool failed, the client gets the first pool's failure, the one about the model it
asked for (a fallback's refusal never hides it). A fallback that cannot take the request is
skipped, visibly (`gateway_fallback_skips_total`, the span's events): a pool of another API
family for a route that cannot be translated, a multipart body, a pool a reload removed.

Once the first byte went out, a request stays where it is: a stream that breaks is continued
within its pool (`ingress.resume`), and on the pool's first fallback of its API family only
when the pool has no instance left to continue it on (`Fallbacks.continuation`). A request
that could do something twice (`Call.acts`) is handed over only when its pool never ran it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import trace

from gateway.config.fallbacks import CONTEXT_LENGTH, MAX_FALLBACK_DEPTH, FallbackTarget
from gateway.core.refusals import refusal_of
from gateway.core.translate import Untranslatable
from gateway.errors import (
    GatewayError,
    NoInstanceAvailable,
    Shed,
    ShuttingDown,
    UpstreamConnectError,
    UpstreamError,
)
from gateway.pipeline.call import Call, Handler, RequestFacts
from gateway.runtime import Clock
from gateway.upstream.pool import PoolState
from gateway.upstream.response import Owned, UpstreamResponse
from gateway.upstream.translated import NotTranslated, Translated, translation_for

# The causes that prove the request was never run: no instance took it, admission refused it,
# the instance refused it (429), or refused the prompt (400).
_NEVER_RAN: Final = frozenset(("unavailable", "shed", "rate_limited", CONTEXT_LENGTH))
# What sends a broken stream's continuation to a fallback: its pool had nothing left to
# continue it on.
_NOTHING_LEFT: Final = frozenset(("unavailable", "retries_exhausted"))
# The API family of each route protocol (None: any pool serves it as it comes).
_FAMILY: Final = {"openai": "openai", "responses": "openai", "anthropic": "anthropic"}


def cause_of_error(error: GatewayError) -> str | None:
    """Why a pool raised `error` instead of answering, as a fallback cause; None when the
    error is not one a fallback helps with (the gateway shutting down, a refused request)."""
    if isinstance(error, NoInstanceAvailable | UpstreamConnectError):
        return "unavailable"
    if isinstance(error, Shed):
        return "shed"
    if isinstance(error, ShuttingDown):
        return None
    if isinstance(error, UpstreamError):
        return "retries_exhausted"
    return None


def cause_of_answer(response: UpstreamResponse) -> str | None:
    """Why a pool's answer (after its retries) is a failure a fallback may cure; None for an
    answer to relay as it is (a success, a 4xx about the request)."""
    status = response.status
    if status < 400:
        return None
    if status == 429:
        return "rate_limited"
    if status >= 500:
        return "server_error"
    return CONTEXT_LENGTH if refusal_of(status, response.body) == CONTEXT_LENGTH else None


class Handover:
    """One request's way through its pool and its fallbacks: the pools tried, those still to
    try (depth first), and the first failure, kept to be the answer if nothing better comes."""

    __slots__ = (
        "_held",
        "_pending",
        "answering",
        "calls",
        "failure",
        "first",
        "hops",
        "last_resort",
        "reasons",
        "tried",
    )

    def __init__(self, call: Call) -> None:
        self.first = call  # the call on the request's own pool
        self.answering = call  # the call whose answer the client gets
        self.calls = [call]  # one per pool tried
        self.tried = [call.pool.name]
        self._pending: list[FallbackTarget] = []
        self.hops = 0
        self.reasons: list[str] = []  # "from>to:cause" per hand-over, for the access log
        self._held: Owned | None = None  # the first failure's response, until the end
        self.failure: GatewayError | None = None  # or the error it raised
        # Its own pool again, panic routing allowed, once no fallback answered (`_last_resort`).
        self.last_resort: Call | None = None

    @property
    def attempts(self) -> int:
        """The upstream attempts made on every pool tried."""
        return sum(call.attempts for call in self.calls)

    def keep(self, response: UpstreamResponse | None, error: GatewayError | None) -> None:
        """A pool failed (its `response`, or `error`): the first failure is kept for the end,
        any later one finished now."""
        if self._held is None and self.failure is None:
            if response is not None:
                self._held = Owned(response)
            else:
                self.failure = error
        elif response is not None:
            with Owned(response):
                pass  # a fallback's failure: not the answer

    def next(self, pool: PoolState, cause: str | None) -> FallbackTarget | None:
        """The next pool to try after `pool` failed for `cause`: its own list for that cause
        first (when its `fallback_on` names it), then what earlier pools still listed."""
        policy = pool.policy
        if cause is None:
            chain: tuple[FallbackTarget, ...] = ()
        elif cause == CONTEXT_LENGTH:
            chain = policy.context_fallbacks
        else:
            chain = policy.fallbacks if cause in policy.fallback_on else ()
        self._pending[:0] = chain
        while self._pending and self.hops < MAX_FALLBACK_DEPTH:
            target = self._pending.pop(0)
            if target.pool not in self.tried:
                return target
        return None

    def went_to(self, source: str, target: str, reason: str | None) -> None:
        self.reasons.append(f"{source}>{target}:{reason or 'refused'}")
        self.tried.append(target)
        self.hops += 1

    def original(self) -> UpstreamResponse:
        """The first failure: its response handed back, or its error raised."""
        held, self._held = self._held, None
        if held is not None:
            return held.hand_over()
        assert self.failure is not None
        raise self.failure

    def close(self) -> None:
        """The request is answered: a first failure still held is finished."""
        held, self._held = self._held, None
        if held is not None:
            held.end()


class Fallbacks:
    """Hands requests over between pools (`pools`: the registry's, changed in place by a
    reload), counting each hand-over and skip in the pool it left (`PoolStats`)."""

    def __init__(self, pools: Mapping[str, PoolState], clock: Clock, traced: bool) -> None:
        self._pools = pools
        self._clock = clock
        self._traced = traced

    async def answer(self, handover: Handover, handler: Handler) -> UpstreamResponse:
        """The request's answer, from its pool or a fallback (`handover.answering`: the call
        that got it; the request's own when the answer is its pool's failure). Raises the
        first pool's error when that is the answer."""
        call = handover.first
        try:
            while True:
                response: UpstreamResponse | None = None
                error: GatewayError | None = None
                try:
                    response = await handler(call)
                    cause = cause_of_answer(response)
                except GatewayError as raised:
                    error = raised
                    cause = cause_of_error(raised)
                    if cause is None and handover.hops == 0:
                        raise
                if (
                    cause is None
                    and response is not None
                    and (handover.hops == 0 or _taken(response))
                ) or call is handover.last_resort:
                    # An answer; or the last resort's, whatever it is (below).
                    handover.answering = call
                    if response is None:
                        assert error is not None
                        raise error
                    return response
                # A failure: the pool's, or (no cause) a fallback's own refusal, which goes on
                # to what earlier pools listed but never becomes the answer.
                handover.keep(response, error)
                next_call = self._next_call(handover, call, cause)
                if next_call is None:
                    next_call = _last_resort(handover, self._clock())
                if next_call is None:
                    return handover.original()
                handover.calls.append(next_call)
                call = next_call
        finally:
            handover.close()

    def _next_call(self, handover: Handover, call: Call, cause: str | None) -> Call | None:
        """The call on the next pool that can take the request, or None when none is left
        (nor time to try one). A request that could do something twice (`Call.acts`) goes on
        only when its pool never ran it (`_NEVER_RAN`)."""
        if call.acts and cause not in _NEVER_RAN:
            return None
        while True:
            target = handover.next(call.pool, cause)
            if target is None:
                return None
            pool = self._pools.get(target.pool)
            if pool is None:
                self._skip(call.pool, target.pool, "unknown_pool")
                handover.tried.append(target.pool)
                continue
            model = target.model or pool.policy.models[0]
            request = {**call.facts.request, "model": model}
            sent = _sent_as(call, pool, request, model)
            if isinstance(sent, str):
                self._skip(call.pool, target.pool, sent)
                handover.tried.append(target.pool)
                continue
            now = self._clock()
            if now >= call.deadline:
                return None
            body, translation = sent
            facts = RequestFacts(model, call.facts.stream, call.facts.max_tokens, request)
            deadline = min(call.deadline, now + pool.policy.timeouts.ceiling)
            self._went(call.pool, pool.name, cause, model)
            handover.went_to(call.pool.name, pool.name, cause)
            return call.for_fallback(pool, body, facts, deadline, translation)

    def continuation(self, call: Call, body: bytes, failed: GatewayError) -> Call | None:
        """A broken stream's continuation (`body`) on a fallback of its pool, when the pool
        had no instance left to continue it on (`failed`: what the continuation there met):
        the first of the pool's `fallbacks` that can take it, asked for its model; None when
        none can (the stream then ends as it would have)."""
        cause = cause_of_error(failed)
        policy = call.pool.policy
        if cause not in _NOTHING_LEFT or cause not in policy.fallback_on:
            return None
        if call.translation is not None:
            return None  # its body is in another family than the pool's route: not continued
        for target in policy.fallbacks:
            pool = self._pools.get(target.pool)
            if pool is None or _cannot_take(call, pool) is not None:
                continue
            model = target.model or pool.policy.models[0]
            try:
                request = json.loads(body)
            except ValueError:
                return None
            request["model"] = model
            sent = json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode()
            facts = RequestFacts(model, True, call.facts.max_tokens, request)
            self._went(call.pool, pool.name, cause, model, resumed=True)
            return call.for_fallback(pool, sent, facts, call.deadline)
        return None

    def _went(
        self,
        source: PoolState,
        target: str,
        cause: str | None,
        model: str,
        resumed: bool = False,
    ) -> None:
        cause = cause or "refused"  # a fallback's own refusal, going on down the list
        source.stats.fell_back(target, cause)
        if self._traced:
            trace.get_current_span().add_event(
                "fallback",
                {
                    "gateway.fallback.from": source.name,
                    "gateway.fallback.to": target,
                    "gateway.fallback.reason": cause,
                    "gateway.fallback.model": model,
                    "gateway.fallback.resumed": resumed,
                },
            )

    def _skip(self, source: PoolState, target: str, why: str) -> None:
        why, _, detail = why.partition(":")  # "untranslatable:n>1": counted without the detail
        source.stats.skipped_fallback(target, why)
        if self._traced:
            trace.get_current_span().add_event(
                "fallback skipped",
                {
                    "gateway.fallback.from": source.name,
                    "gateway.fallback.to": target,
                    "gateway.fallback.skip_reason": why,
                    "gateway.fallback.skip_detail": detail,
                },
            )


def _last_resort(handover: Handover, now: float) -> Call | None:
    """The request's own pool once more, with panic routing, when no fallback answered and
    its pool had held panic back for them (`Call.handover`): the least bad of its instances, as
    without fallbacks, rather than no answer. None when that does not apply, or was done."""
    first = handover.first
    if (
        not first.handover
        or now >= first.deadline
        or handover.last_resort is not None
        or not isinstance(handover.failure, NoInstanceAvailable)
        or first.pool.policy.breaker.when_none_available != "panic"
    ):
        return None
    last = handover.last_resort = first.for_fallback(
        first.pool, first.body, first.facts, first.deadline
    )
    return last


def _taken(response: UpstreamResponse) -> bool:
    """Whether a fallback's answer is the request's: a success, or a content-policy refusal
    (its reason must reach the client); any other refusal is the fallback's own failure."""
    return response.status < 400 or refusal_of(response.status, response.body) == "content_policy"


def _sent_as(
    call: Call, pool: PoolState, request: dict[str, Any], model: str
) -> tuple[bytes, Translated | None] | str:
    """The body the request goes to `pool` with (`request`, its model that pool's), and its
    translation when the pool speaks the other API family (chat completions and Messages
    only); or why it cannot go there: a multipart body, another family's route that is not
    translated ("api"), a request the other family cannot express ("untranslatable:...")."""
    if call.facts.form or not call.facts.request:
        return "form"
    if call.route.kind == "other" and pool.policy.credentials is not None:
        return "credentials"  # the operator's key is spent only on what the gateway knows
    try:
        translation = translation_for(call.route, pool.policy.api, request, model)
    except Untranslatable as refused:
        return f"untranslatable:{refused.reason}"
    except NotTranslated:
        return "api"
    if translation is None:
        return json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode(), None
    return translation.body, translation


def _cannot_take(call: Call, pool: PoolState) -> str | None:
    """Why `pool` cannot take the request as it is (None: it can): a multipart body (its
    model is a form field, not rewritten), or a pool of the other API family."""
    if call.facts.form or not call.facts.request:
        return "form"
    family = _FAMILY.get(call.route.protocol)
    api = pool.policy.api
    if api is not None and family is not None and api != family:
        return "api"
    return None
