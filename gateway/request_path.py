"""The request path, top to bottom: what a proxied request goes through, in order, and why.

    front end   `ingress.asgi.DataPlane._proxy`, step by step: the connection's limits
                (`ingress.protocol`), the route (`config.routes`: what the gateway knows of
                it), the client's key checked (`ingress.auth`); the body read within its cap
                and `model`, `stream` and `max_tokens` read from it, a JSON object or a
                multipart form (`_read_request`, `ingress.form`); the pool chosen by model,
                the only pool when none is named (`_route`); the request's deadline (the
                pool's ceiling or `x-gateway-timeout`) and priority (`RequestHeaders.terms`),
                its `Cancellation` (`runtime`) and its `Call` (`_call`); a watch for the
                client leaving; a whole answer on a route whose streams can be continued is
                fetched as a stream (`ingress.whole`). Whatever ends it, it leaves its
                counts, its access-log line and its span's attributes behind
                (`ingress.exchange.Exchange`)
    admit       `pipeline.admit.Admit`: in pools with `admission`, a slot for the whole
                exchange, by priority class; a request it cannot queue is shed (429)
    retry       `pipeline.retry.Retry`: the attempts, each re-running everything below;
                retries as the pool's failure-rate tier and retry budget allow, with backoff
    pick        `pipeline.pick.Pick`: the instance for this attempt (peak-EWMA p2c over the
                admitting instances, untried ones first; panic routing when none admits)
    hedge       `pipeline.hedge.Hedge`: a first attempt still without its first byte at its
                instance's predicted p95 gets a second one on another instance (picked by
                the pick layer); the first to answer wins, the other is cancelled
    account     `pipeline.account.Account`: the attempt counted against its instance and
                pool when it ends (breaker, failure rate, latency EWMAs, limiter)
    deadline    `pipeline.deadline.DeadlineLayer`: the attempt's timeouts, predicted from the
                instance's latency (connect, first byte, idle gap of a stream)
    attempt span `pipeline.attempt_span.AttemptSpans` (tracing on): a CLIENT span per attempt
    transport   `pipeline.transport.Transport`: the request sent (`upstream.clients`), read up
                to the commit point: a whole body up to 1 MiB, else the first chunk (a 200
                event stream's first whole event); a 200 that cannot be an answer (a JSON
                route's body that is not a JSON object, a stream that does not begin with an
                event) is the upstream's protocol failure, never relayed as a success
    ---------   the commit point: from here the response goes to the client, no retry
    relay       `ingress.relay.relay` (`DataPlane._relay`): the response forwarded, inside
                its scope (`upstream.response.Owned`), which finishes it once when the relay
                ends, however it ends: then the work the layers registered with
                `UpstreamResponse.after` (the attempt's span, its accounting, the slot). A
                stream's pieces that need only a write (whole events, no engine error, a
                client taking them at once) are written from the upstream connection's
                callback (`ingress.writer`), the rest by the relay's task
    resume      `ingress.resume`: a stream that breaks after its first byte (a reset, an
                EOF before its last event, an idle timeout, the engine's error event), or
                that is moved (its instance isolated, or far slower than the others), is
                continued: its text so far goes in a continuation request, sent through
                the layers below admission (`RequestPath.resume`: retry, pick, hedge,
                account, deadline, transport; `ingress.resume.stream_resume`) to another
                instance, the request's slot going on with it, and the continuation's events
                are rewritten into the same stream (`core.continuation`). A stream
                that cannot be continued ends with an error event, never silently. A
                whole answer fetched as a stream is relayed into `ingress.whole.WholeAnswer`,
                which sends the client one JSON answer (or error) at the stream's end.

Why this order: admission wraps the retries, so a request holds one slot however many attempts
it makes. The hedge sits after the pick, so its timer is that instance's prediction, and before
the accounting, so each of the two attempts is accounted against its own instance. The retry
loop wraps `pick`, so every attempt picks again (and can avoid the instances that failed it).
Accounting wraps the deadline, so an attempt that timed out is counted too, and the deadline
sits inside the retry loop, so it bounds one attempt (the request's own deadline bounds them
all). Everything before the commit point can still be retried; after it, nothing is sent
twice: a stream is only ever continued from where its client is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from gateway.pipeline.account import Account
from gateway.pipeline.admit import Admit, PoolAdmission
from gateway.pipeline.attempt_span import AttemptSpans
from gateway.pipeline.call import Handler, Layer
from gateway.pipeline.chain import compose
from gateway.pipeline.deadline import DeadlineLayer
from gateway.pipeline.hedge import Hedge
from gateway.pipeline.pick import Pick
from gateway.pipeline.retry import Retry
from gateway.pipeline.transport import Transport, UpstreamClient
from gateway.runtime import Clock
from gateway.telemetry.tracing import Tracing
from gateway.upstream.feedback import OnTransition
from gateway.upstream.pool import PoolState
from gateway.upstream.watchdog import Watchdog


class RequestPath(NamedTuple):
    """`handle`: a client request, from admission on; `resume`: the continuation of a stream
    that broke, from the retry loop on (the request already holds its admission slot)."""

    handle: Handler
    resume: Handler


def build_pipeline(
    *,
    admissions: Mapping[str, PoolAdmission],
    account_pools: dict[str, PoolState],
    on_transition: OnTransition,
    client: UpstreamClient,
    watchdog: Watchdog,
    clock: Clock,
    tracing: Tracing | None = None,
) -> RequestPath:
    """The pipeline between the front end and the relay, outermost layer first.

    `admissions`: the pools' admission (a pool without one costs one dict lookup; a reload
    may add or drop one in place); `account_pools`: the pools attempts are recorded into,
    dropped ones included while they have attempts in flight; `client`: what sends the
    requests (the data plane's HTTP/1.1 client, or a test's in-memory one); `clock`: the
    event loop's time, the one every layer reads."""
    admit = Admit(admissions)
    pick = Pick(clock)
    layers: list[Layer] = [
        Retry(clock, traced=tracing is not None),
        pick,
        Hedge(pick, clock),
        Account(account_pools, on_transition, clock),
        DeadlineLayer(clock),
    ]
    if tracing is not None:
        layers.append(AttemptSpans(tracing))
    transport = Transport(client, watchdog, clock)
    return RequestPath(compose([admit, *layers], transport), compose(layers, transport))
