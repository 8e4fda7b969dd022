"""An upstream response on its way to the client, read up to the commit point."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar, overload

from gateway.config.routes import CHAT, Route
from gateway.core.outcome import Outcome, Phase
from gateway.errors import UpstreamError, UpstreamTimeout, map_upstream_exception
from gateway.upstream.watchdog import Deadline, Watchdog, expired

if TYPE_CHECKING:
    from gateway.runtime import Cancellation
    from gateway.upstream.instance import InstanceState


class HeaderLookup(Protocol):
    """A response's headers by name, case-insensitive."""

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...

    def __contains__(self, name: object) -> bool: ...


class ResponseHead(Protocol):
    """A response whose status and headers arrived, its body read through it: what the data
    plane's HTTP/1.1 client hands over (`upstream.h1.UpstreamResponseHead`), or a test's
    in-memory one. `release()` or `close()` ends it, once."""

    status: int
    raw_headers: list[tuple[bytes, bytes]]
    content_length: int | None

    @property
    def headers(self) -> HeaderLookup: ...

    @property
    def connection(self) -> object | None:
        """What the body still holds (a connection) while it has not been read to its end."""
        ...

    async def readany(self) -> bytes: ...

    async def pump(self, tap: Callable[[bytes], bool]) -> bytes | None:
        """`readany`, handing the pieces that arrive meanwhile to `tap`, which takes them
        (True) until it declines one: that one is returned (None: `tap` took one, then called
        `stop_pump`). A head may hand none to `tap`: `pump` is then `readany`."""
        ...

    def stop_pump(self) -> None: ...

    async def read(self) -> bytes: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


# A stream is stalled when a gap runs this many times past its own largest one so far (or past
# the instance's learned idle timeout, whichever is longer): an instance that turned slow keeps
# its streams going rather than having them cut one gap in.
STREAM_PACE = 3.0
# With nothing learned of an instance's gaps, its idle timeout is the static `timeouts.initial`
# (30 s by default): a stream that stalls would be noticed only then. Once the stream has shown
# its own pace (this many gaps), a gap this many times its largest so far is a stall, though
# never under UNPACED_MIN_IDLE_S: a pool with nothing learned notices a stall in seconds. The
# watchdog's allowances still apply (an engine-wide pause, a prefill the gateway saw coming).
UNLEARNED_PACE = 10.0
UNLEARNED_MIN_GAPS = 4
UNPACED_MIN_IDLE_S = 2.0

log = logging.getLogger("gateway")

_Read = TypeVar("_Read", bytes, "bytes | None")

FinishHook = Callable[["UpstreamResponse", "UpstreamError | None"], None]


class UpstreamResponse:
    """Status and headers, plus either the whole body (`body`) or a stream to relay.

    For a stream, `first_chunk` was already read, so a failure before the first byte happens
    while the attempt can still be retried. Whoever holds it holds it in a scope (`Owned`),
    which finishes it once when the relay ends (or the response is discarded for a retry, or
    the scope is left any other way): it closes the upstream connection if the body was not
    read to the end, then runs the work the layers registered with `after` (the attempt's
    span, its accounting, the admission slot), once each.
    `is_sse` is true only for an uncompressed event stream: the gateway may append an error
    event to it, which would corrupt a compressed one.

    Timing (event-loop seconds): `started_at` when the attempt began, `first_at` when the first
    body byte (or the whole body) arrived, `last_at` the latest chunk, `max_gap_s` the longest
    wait between two chunks; `tail` is the last chunk (where a stream's usage figures are).
    """

    __slots__ = (
        "_after",
        "_after_request",
        "_deadline",
        "_ended",
        "_loop_time",
        "_raw",
        "_watchdog",
        "before_tail",
        "body",
        "first_at",
        "first_chunk",
        "gaps",
        "headers",
        "idle_guessed",
        "instance",
        "is_sse",
        "last_at",
        "max_gap_s",
        "outcome",
        "prompt_tokens",
        "queued",
        "route",
        "sent_with",
        "started_at",
        "status",
        "tail",
        "tokens",
        "waited_s",
    )

    def __init__(
        self,
        instance: InstanceState,
        raw: ResponseHead,
        *,
        body: bytes | None,
        first_chunk: bytes,
        is_sse: bool,
        deadline: Deadline,
        watchdog: Watchdog,
        started_at: float,
        clock: Callable[[], float],
        route: Route = CHAT,
    ) -> None:
        self.instance = instance
        self._raw = raw
        self.status = raw.status
        self.headers = raw.raw_headers
        self.body = body
        self.first_chunk = first_chunk
        self.is_sse = is_sse
        self._deadline = deadline
        self._watchdog = watchdog
        self._loop_time = clock
        self.started_at = started_at
        self.first_at = self.last_at = now = clock()
        instance.first_byte(started_at, now)
        self.max_gap_s: float | None = None
        self.gaps = 0  # gaps measured: chunks after the first
        # Its idle timeout is a static guess (`AttemptTimeouts.idle_guessed`): set by the transport.
        self.idle_guessed = False
        # Time spent waiting for the upstream's chunks (not for the client to take them).
        self.waited_s = 0.0
        self.tail = body if body is not None else first_chunk
        self.before_tail = b""  # the chunk before `tail` (a stream's usage may sit there)
        self.route = route  # what it answers (its usage keys, whether its latency is modelled)
        status = raw.status
        if status == 500:  # only a 500 can be an OOM: look closer
            self.outcome = Outcome.from_status(status, self.tail[:512], raw.headers)
        else:
            self.outcome = Outcome.from_status(status)
        # Made on the first `after`: whole answers (most) register none.
        self._after: list[FinishHook] | None = None
        self._after_request: list[FinishHook] | None = None
        self._ended = False  # finished (`Owned`): a second end does nothing
        self.tokens = 0  # the KV-cache tokens its attempt holds, released when it ends
        self.prompt_tokens = 0  # its request's estimated prompt size
        self.queued = False  # it was sent to an instance already full (waited for a slot)
        self.sent_with = 0  # attempts in flight on its instance when it was sent (itself too)

    def header(self, name: str) -> str | None:
        return self._raw.headers.get(name)

    async def next_chunk(self, idle_s: float, end_at: float) -> bytes:
        """The next piece of the body as it arrives (b"" at the end); raises UpstreamError.

        Waits at most `idle_s` for it, or `STREAM_PACE` times the stream's largest gap so far
        if that is longer, and never past `end_at` (the exchange's deadline).
        """
        now = self._loop_time()
        self._await_chunk(now, idle_s, end_at)
        chunk = await self._read(self._raw.readany(), end_at)
        if chunk:
            self._arrived(chunk, now, self._loop_time())
        return chunk

    async def pump(
        self, idle_s: float, end_at: float, tap: Callable[[bytes], bool]
    ) -> bytes | None:
        """`next_chunk`, while `tap` is handed each piece that arrives meanwhile, as it
        arrives and with the same bounds on each wait: a piece it takes (True) is gone, the
        first it declines is returned as `next_chunk` would. `tap` may `stop_pump` after
        taking one: then this returns None."""
        waited_from = self._loop_time()
        self._await_chunk(waited_from, idle_s, end_at)
        declined: bytes | None = None  # the piece `tap` declined, accounted already
        failed: Exception | None = None  # what `tap` raised: its own failure, not the upstream's

        def tapped(chunk: bytes) -> bool:
            nonlocal waited_from, declined, failed
            arrived = self._loop_time()
            self._arrived(chunk, waited_from, arrived)
            try:
                taken = tap(chunk)
            except Exception as exc:
                # Raised here, it would reach the connection's parser and pass for bytes the
                # upstream got wrong: it goes to the relay's task, as if the task had read it.
                failed = exc
                self._raw.stop_pump()
                return True
            if not taken:
                declined = chunk
                return False
            # Written to the client already: the next wait starts now.
            waited_from = arrived
            self._await_chunk(arrived, idle_s, end_at)
            return True

        chunk = await self._read(self._raw.pump(tapped), end_at)
        if failed is not None:
            raise failed
        if not chunk:
            return chunk
        if declined is None:  # never shown to `tap`: it arrived before, or nothing is tapped
            self._arrived(chunk, waited_from, self._loop_time())
        elif chunk is not declined:
            self.tail = chunk  # the declined piece and what came with it in the same read
        return chunk

    def stop_pump(self) -> None:
        """From a `pump`'s tap: the relay takes over again (the `pump` returns None)."""
        self._raw.stop_pump()

    async def _read(self, reading: Awaitable[_Read], end_at: float) -> _Read:
        """What `reading` (of the body) gives, its failures as UpstreamErrors: the deadline's
        cancel as the timeout of the phase that ran out."""
        deadline = self._deadline
        try:
            return await reading
        except asyncio.CancelledError:
            if expired(deadline):
                raise self.timeout() from None
            raise
        except UpstreamError:
            raise  # the client's own, as it is (`from` itself would make a cycle)
        except Exception as exc:
            raise map_upstream_exception(exc, phase=Phase.BODY) from exc
        finally:
            deadline.move(end_at, Phase.TOTAL)  # while the client is being written to

    def _await_chunk(self, now: float, idle_s: float, end_at: float) -> None:
        """A wait for the next piece begins at `now`: its deadline (see `next_chunk`)."""
        deadline = self._deadline
        paced = self.max_gap_s
        if paced is not None:
            if STREAM_PACE * paced > idle_s:
                # The stream's own pace: a stall is a gap well beyond the ones it already had.
                idle_s = STREAM_PACE * paced
            elif self.idle_guessed and self.gaps >= UNLEARNED_MIN_GAPS:
                # Nothing learned: its own pace says more than the static guess.
                own_s = UNLEARNED_PACE * paced
                if own_s < UNPACED_MIN_IDLE_S:
                    own_s = UNPACED_MIN_IDLE_S
                if own_s < idle_s:
                    idle_s = own_s
        if now + idle_s < end_at:
            deadline.move(now + idle_s, Phase.IDLE)
            deadline.idle_s = idle_s
            deadline.waiting_since = now
        else:
            deadline.move(end_at, Phase.TOTAL)

    def _arrived(self, chunk: bytes, waited_from: float, arrived: float) -> None:
        """A piece of the body came at `arrived`, waited for since `waited_from`."""
        self.waited_s += arrived - waited_from
        gap = arrived - self.last_at
        self.gaps += 1
        if self.max_gap_s is None or gap > self.max_gap_s:
            self.max_gap_s = gap
        self.last_at = arrived
        self.instance.progressed(arrived)
        self.before_tail = self.tail
        self.tail = chunk

    def bind(self, cancellation: Cancellation, until: float) -> None:
        """The attempt was sent from another task (a hedge): from now on its deadline
        cancels the request's (`until`: the request's deadline)."""
        self._watchdog.rebind(self._deadline, cancellation, until)

    def cancelled_by_deadline(self) -> UpstreamError | None:
        """After a CancelledError outside `next_chunk`: the timeout it stands for, if any."""
        return self.timeout() if expired(self._deadline) else None

    def timeout(self) -> UpstreamTimeout:
        phase = self._deadline.phase
        return UpstreamTimeout(f"the upstream timed out ({phase})", phase=phase)

    def _end_attempt(self, ok: bool, error: UpstreamError | None) -> list[FinishHook] | None:
        """Release the connection (or close it when the body was cut short) and run the
        attempt's own work; the request's (`after(..., request=True)`) is handed back, to run
        now or to move to the attempt that resumes the stream (`Owned`). Once: a second end
        does nothing and hands back nothing."""
        if self._ended:
            return None
        self._ended = True
        self._watchdog.disarm(self._deadline)
        if self._raw.connection is not None and not ok:
            self._raw.close()
        else:
            self._raw.release()
        hooks, self._after = self._after, None
        if hooks is not None:
            _run(hooks, self, error)
        left, self._after_request = self._after_request, None
        return left

    def after(self, hook: FinishHook, *, request: bool = False) -> None:
        """Run `hook(response, error)` when the response is finished (`Owned`): the one way a
        layer does work after a streamed response. Hooks run in the order registered: the
        innermost layer first, as the response came back through the layers (the attempt's
        span ends, then the attempt is accounted, then the admission slot is freed, so a
        request waiting for it sees the accounting already done).

        `request`: the work belongs to the whole request, not this attempt (the admission
        slot): when the stream is resumed on another attempt, it moves there."""
        if request:
            if self._after_request is None:
                self._after_request = [hook]
            else:
                self._after_request.append(hook)
        elif self._after is None:
            self._after = [hook]
        else:
            self._after.append(hook)


class Owned:
    """A response's lifetime, tied to a scope: `with Owned(response) as owned:`. Leaving the
    scope finishes the response once (its connection released, or closed when its body was cut
    short; then the work the layers registered with `after`), with the outcome stated on the
    way: `ok`, the body reached the client whole; `error`, what broke it, if the upstream did.
    A scope left with no outcome stated (an exception, a cancellation, a path that gave the
    response up) finishes it as failed, as tower's concurrency limit frees its permit when the
    permit is dropped: no connection stays open, no admission slot stays taken. A response
    returned to the caller leaves the scope unfinished (`hand_over`): the caller's scope owns
    it then.

    A stream resumed on another attempt keeps its one scope across them: the attempt that
    broke is finished when it breaks (`break_off`), and the request's own work (`after(...,
    request=True)`: the admission slot) goes on with the next attempt's response
    (`resume_on`), to run when the last one ends, or with the broken one when no next attempt
    came."""

    __slots__ = ("_broke", "_broken", "_request_work", "error", "ok", "response")

    def __init__(self, response: UpstreamResponse | None) -> None:
        # The response this scope ends (None: handed over, ended, or between two attempts):
        # read it, never set it (`hand_over`, `resume_on`).
        self.response = response
        self.ok = False
        self.error: UpstreamError | None = None
        # Between two attempts of a resumed stream: the request's work, the attempt that
        # broke and what broke it.
        self._request_work: list[FinishHook] | None = None
        self._broken: UpstreamResponse | None = None
        self._broke: UpstreamError | None = None

    def __enter__(self) -> Owned:
        return self

    def end(self, *exc_info: object) -> None:
        """Finish the response now, with the outcome stated so far: what leaving the scope
        does (`__exit__`), done before it when the response's end must not wait for the
        scope's. Once: the scope then has nothing left to end."""
        response, self.response = self.response, None
        error = self.error
        if response is not None:
            hooks = response._end_attempt(self.ok, error)
            if hooks is not None:
                _run(hooks, response, error)
        hooks, self._request_work = self._request_work, None
        if hooks is not None:
            broken = self._broken
            assert broken is not None
            _run(hooks, broken, self._broke or error)

    __exit__ = end

    def hand_over(self) -> UpstreamResponse:
        """The response, passed on to the caller: this scope no longer ends it."""
        response, self.response = self.response, None
        assert response is not None, "handed over once"
        return response

    def break_off(self, error: UpstreamError) -> UpstreamResponse:
        """The attempt broke (`error`) and its stream goes on in another one: it is finished
        now, as failed; the request's own work waits for the next attempt (`resume_on`)."""
        response, self.response = self.response, None
        assert response is not None
        self._request_work = response._end_attempt(False, error)
        self._broken = response
        self._broke = error
        return response

    def resume_on(self, response: UpstreamResponse) -> None:
        """The next attempt's response, at its first byte: the request's work moves to it,
        and the scope ends it from now on."""
        hooks, self._request_work = self._request_work, None
        for hook in hooks or ():
            response.after(hook, request=True)
        self._broken = self._broke = None
        self.response = response


def _run(
    hooks: list[FinishHook] | None, response: UpstreamResponse, error: UpstreamError | None
) -> None:
    for hook in hooks or ():
        try:
            hook(response, error)
        except Exception:  # one layer's failure must not skip the next (a slot, a count)
            log.exception("work after a response failed")
