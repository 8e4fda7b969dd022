"""The hedging layer: a first attempt slow to answer gets a second one elsewhere; the first to
answer wins.

Between the pick and the rest of an attempt. When an attempt is the first of its retry loop (a
client request's, or a resumed stream's continuation) and another instance could take it, a
timer is set at its instance's predicted first byte plus `hedging.k` deviations
(`PoolTiming.hedge_delay`: near its 95th percentile, plus the wait behind the gateway's own
queue there), never sooner than `hedging.min_delay`. Most attempts answer before it and only
cancel the timer. When it fires, unless its instance serves the attempt in its turn
(`_in_its_turn`: a hedge would start a long prefill over from nothing), if another instance
has a free slot (the gateway holds fewer attempts there than it was seen serving at once) and
the first half of the pool's retry budget allows (`HEDGE_SHARE`: hedges bet on latency, and
leave the rest to retries, which rescue failures), a hedge picks another instance (the pick
layer, avoiding this one) and is sent from a task of its own:

- the hedge answers first (a status below 400, read to the commit point): the first attempt
  is cancelled at once (`SUPERSEDED`: its connection closes, so vLLM frees the sequence), the
  request takes the hedge's instance, timeouts and response;
- the first attempt answers first: the hedge is cancelled (or its answer, if it had one,
  discarded);
- one fails: the other is waited for; both fail: the first one's failure goes to the retry
  layer, as without a hedge.

Nothing here runs after the commit point: both attempts end at their first byte. A pool of one
never hedges, nor does an instance with nothing learned (no prediction to hedge at), nor an
isolated instance's probe, nor a prompt long for its instance (`large_prompt`: a second prefill
elsewhere doubles the pause it imposes, and a cancelled one goes on in the engine). An attempt
given up for a hedge is not a failure, but an instance that loses every race is: the account
layer counts the losses in a row (`Account`).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.core.concurrency import prompt_tokens
from gateway.core.timeouts import large_prompt
from gateway.errors import UpstreamError
from gateway.pipeline.call import Call, Handler, Layer
from gateway.runtime import SUPERSEDED, Cancellation, Clock
from gateway.upstream.instance import InstanceState
from gateway.upstream.response import Owned, UpstreamResponse

# The part of the pool's retry budget hedges may spend: the rest is the retries'.
HEDGE_SHARE = 0.5

log = logging.getLogger("gateway.hedge")


class _Race:
    """One hedged request's two attempts: the hedge's task, its call and its result (its
    answer held until the race settles: handed over when it wins, else ended as failed)."""

    __slots__ = (
        "first_done",
        "hedge",
        "hedge_started",
        "main",
        "result",
        "started",
        "task",
        "timer",
    )

    def __init__(self, call: Call) -> None:
        self.main = call
        self.started = 0.0  # when each attempt was sent, for the loser's latency
        self.hedge_started = 0.0  # also when the hedge spent its share of the retry budget
        self.first_done = False
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.hedge: Call | None = None
        self.result: Owned | BaseException | None = None


class Hedge:
    """The layer. `pick`: the pick layer, which chooses the hedge's instance."""

    def __init__(self, pick: Layer, clock: Clock) -> None:
        self._pick = pick
        self._clock = clock

    def _delay(self, call: Call, now: float) -> float | None:
        """How long the first attempt waits before its hedge leaves; None: no hedge."""
        pool = call.pool
        policy = pool.policy.hedging
        attempt = call.attempt
        instance = attempt.instance
        assert instance is not None, "the pick layer runs first"
        if (
            not policy.enabled
            or call.attempts != 1
            or attempt.probe
            or call.acts
            or not call.route.hedged
            or pool.alone(instance, now, call.avoid)
        ):
            # A probe is the one request that tells whether an isolated instance is back:
            # it is left to answer or time out.
            return None
        if not call.prompt_tokens:  # worked out once: the deadline layer reads it too
            call.prompt_tokens = prompt_tokens(call.prompt_bytes())
        if large_prompt(instance.latency, call.prompt_tokens):
            return None
        facts = call.facts
        delay = pool.timing.hedge_delay(
            instance, now, stream=facts.stream, max_tokens=facts.max_tokens
        )
        if delay is None:
            return None
        delay = max(delay, policy.min_delay)
        return None if now + delay >= call.deadline else delay

    async def __call__(self, call: Call, next_handler: Handler) -> UpstreamResponse:
        now = self._clock()
        delay = self._delay(call, now)
        if delay is None:
            return await next_handler(call)
        pool = call.pool
        race = _Race(call)
        race.started = now
        loop = asyncio.get_running_loop()
        race.timer = loop.call_later(delay, self._launch, race, next_handler)
        try:
            response = await next_handler(call)
        except asyncio.CancelledError:
            race.first_done = True
            if call.cancellation.consume(SUPERSEDED):
                return self._hedge_won(race)
            await self._abandon(race)
            raise
        except UpstreamError:
            race.first_done = True
            # The hedge may have answered as this one failed: its cancel is not for anyone.
            call.cancellation.consume(SUPERSEDED)
            hedged = await self._hedge_result(race)
            if hedged is not None:
                return hedged
            raise
        except Exception as defect:
            # An error of no kind the race knows (a defect): the request ends with it, and
            # the race too, its hedge cancelled or its answer ended; left running, the hedge
            # held its instance's slot and connection with nobody to end its answer.
            race.first_done = True
            call.cancellation.consume(SUPERSEDED)
            try:
                await self._abandon(race)
            except BaseException:
                raise defect from None  # the defect is what the request ends with, and shows
            raise
        race.first_done = True
        if race.task is None:
            if race.timer is not None:
                race.timer.cancel()
            return response
        # The first attempt's answer ends as failed when it is not the one returned: the
        # hedge's won, or the request ended while the race was settled.
        with Owned(response) as first:
            if response.outcome.kind != "ok":
                hedged = await self._hedge_result(race)
                if hedged is not None:
                    return hedged
                return first.hand_over()
            hedge = race.hedge
            if hedge is not None and hedge.attempt.instance is None:
                # The first attempt answered as its hedge was leaving, before it chose an
                # instance: nothing was sent, nothing was wasted, and the budget is given back.
                pool.stats.hedged("late")
                pool.budget.refund(race.hedge_started, self._clock())
            else:
                pool.stats.hedged("lost")
                self._slow(hedge, race.hedge_started)
            await self._abandon(race)
            self._count_attempts(race)
            return first.hand_over()

    def _launch(self, race: _Race, next_handler: Handler) -> None:
        """The timer fired: send the hedge, if the first attempt is still waiting."""
        race.timer = None
        call = race.main
        if race.first_done:
            return
        pool = call.pool
        instance = call.attempt.instance
        assert instance is not None
        now = self._clock()
        if _in_its_turn(instance, race.started, now):
            pool.stats.hedged("in_order")
            return
        if not pool.has_room(instance, now, call.avoid):
            # Every other instance is as full: a hedge would only queue there too, and leave
            # a cancelled request in an engine's queue.
            pool.stats.hedged("no_room")
            return
        if not pool.budget.try_spend(now, HEDGE_SHARE):
            pool.stats.hedged("no_budget")
            return
        hedge = call.for_hedge()
        race.hedge = hedge
        race.hedge_started = now
        task = asyncio.get_running_loop().create_task(self._run(race, hedge, next_handler))
        hedge.cancellation = Cancellation(task)
        race.task = task

    async def _run(self, race: _Race, hedge: Call, next_handler: Handler) -> None:
        try:
            response = await self._pick(hedge, next_handler)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a failure of the hedge is the first attempt's chance
            race.result = exc
            return
        race.result = Owned(response)
        if response.outcome.kind == "ok" and not race.first_done:
            race.main.cancellation.cancel(SUPERSEDED)  # the first attempt is given up

    def _hedge_won(self, race: _Race) -> UpstreamResponse:
        call, hedge, answer = race.main, race.hedge, race.result
        assert hedge is not None and isinstance(answer, Owned)
        race.result = None
        response = answer.hand_over()
        call.pool.stats.hedged("won")
        self._slow(call, race.started)
        call.adopt(hedge)  # the request goes on with the hedge's attempt
        self._count_attempts(race)
        response.bind(call.cancellation, call.deadline)
        return response

    async def _hedge_result(self, race: _Race) -> UpstreamResponse | None:
        """After the first attempt failed: the hedge's answer when it is a good one."""
        if race.timer is not None:
            race.timer.cancel()
            race.timer = None
        task = race.task
        if task is None:
            return None
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await self._abandon(race)
            raise
        result = race.result
        if isinstance(result, Owned):
            answer = result.response
            assert answer is not None
            if answer.outcome.kind == "ok":
                return self._hedge_won(race)
            result.end()  # a failed answer: the first attempt's failure goes on
        race.result = None
        call = race.main
        call.pool.stats.hedged("failed")
        self._count_attempts(race)
        return None

    async def _abandon(self, race: _Race) -> None:
        """The first attempt won or the request ends: the hedge is cancelled, or its answer
        (if it came meanwhile) discarded."""
        if race.timer is not None:
            race.timer.cancel()
            race.timer = None
        task = race.task
        if task is None:
            return
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # the request itself was cancelled meanwhile
        result = race.result
        if isinstance(result, Owned):
            race.result = None
            result.end()  # the hedge lost: its answer is not relayed

    def _slow(self, loser: Call | None, started: float) -> None:
        """The attempt that lost took at least this long without answering: what the
        balancer learns of its instance (its attempt was cancelled, so it is accounted as
        neither a success nor a failure), or it would keep getting first attempts."""
        if loser is None:
            return
        instance = loser.attempt.instance
        if instance is None:
            return
        now = self._clock()
        pace = loser.pool.timing.latency_prior(now).per_token.mean
        instance.price.first_byte(now, now - started, instance.latency, pace, bound=True)

    @staticmethod
    def _count_attempts(race: _Race) -> None:
        """The hedge counts as one more upstream attempt of the request, not as a retry."""
        hedge, main = race.hedge, race.main
        if hedge is not None and hedge.attempts > main.attempts:
            main.hedges += hedge.attempts - main.attempts
            main.attempts = hedge.attempts


def _in_its_turn(instance: InstanceState, sent_at: float, now: float) -> bool:
    """Whether an attempt sent at `sent_at` with no first byte yet is being served in its
    turn: its instance works (it sent bytes since), has a slot for it (no more in flight than
    it was seen serving at once), and has answered nothing sent after it. Such an attempt is in
    a prefill longer than most, or on an instance slower than most, and a hedge would start it
    over from nothing elsewhere: measured under chaos-mix, such hedges lost the race nine
    times in ten, most of them by milliseconds (those on an instance slower than its peers,
    all of them). One that was overtaken (stuck), waits in a queue, or whose instance went
    silent gets its hedge."""
    if instance.progress_at <= sent_at or instance.overtaken(sent_at):
        return False
    return not instance.over_capacity(now)
