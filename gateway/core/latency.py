"""What one instance's past responses say about its next one: TTFB, chunk gaps, per-token time."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.core.ewma import Ewma


class PrefillFit:
    """How an instance's time to first byte grows with the prompt: an exponentially weighted
    least-squares line `ttfb ≈ a + b·prompt_tokens` over the streams it took at once.

    `slope()` is `b` (seconds per prompt token, at least 0) once the prompts seen differ enough
    to tell (their spread at least a quarter of their mean), else None: prompts all of one size
    say nothing of the cost of a longer one. `mean_tokens` is the typical prompt size. On a GPU
    the fixed cost dominates short prompts, so the slope, not the ratio of the two, is what a
    long prompt adds; a backend whose first byte does not depend on the prompt has a slope of 0.
    """

    __slots__ = ("mean_cross", "mean_tokens", "mean_tokens_sq", "mean_ttfb", "samples", "weight")

    def __init__(self, smoothing: float) -> None:
        self.weight = smoothing
        self.samples = 0
        self.mean_tokens = self.mean_ttfb = self.mean_tokens_sq = self.mean_cross = 0.0

    def observe(self, tokens: float, ttfb_s: float) -> None:
        if self.samples == 0:
            self.mean_tokens, self.mean_ttfb = tokens, ttfb_s
            self.mean_tokens_sq, self.mean_cross = tokens * tokens, tokens * ttfb_s
        else:
            a = self.weight
            b = 1.0 - a
            self.mean_tokens = a * self.mean_tokens + b * tokens
            self.mean_ttfb = a * self.mean_ttfb + b * ttfb_s
            self.mean_tokens_sq = a * self.mean_tokens_sq + b * tokens * tokens
            self.mean_cross = a * self.mean_cross + b * tokens * ttfb_s
        self.samples += 1

    def slope(self) -> float | None:
        mean = self.mean_tokens
        variance = self.mean_tokens_sq - mean * mean
        if self.samples < 3 or variance <= (0.25 * mean) ** 2:
            return None
        return max(0.0, (self.mean_cross - mean * self.mean_ttfb) / variance)


class LatencyState:
    """Per-instance latency estimators, all with history weight `smoothing`.

    - `ttfb`: time to the first byte of a streamed response, or the whole time of a response
      that generates no tokens (an embedding); a non-streamed generation says nothing about it;
    - `gap`: the largest gap between two chunks of one stream, one sample per stream. The idle
      timeout is built from it: one built on the mean gap would cut healthy streams at the first
      scheduling hiccup;
    - `per_token`: seconds per generated token, from either kind of response;
    - `prefill`: seconds to the first byte per prompt token of a stream the instance took at
      once (not queued behind others), and `fit`, the line through those first bytes by prompt
      size (`PrefillFit`): what a long prompt will cost it, and how long it will pause the
      streams it is already decoding. The ratio overestimates (short prompts' fixed cost is
      spread over few tokens), which errs on the safe side when the line cannot be told;
    - `service`: how long a whole exchange occupies the instance, from the request to the last
      byte: what a request queued behind a full instance waits for each turn.

    Record only successful responses (a timed-out attempt has no latency, only a lower bound).
    `timeouts_in_row` counts the first-byte timeouts in a row since the instance's last answer,
    one per round (`timed_out`): each doubles the first-byte time of the next attempt timed
    from the pool's prior, or of the next last attempt (as TCP backs its retransmission timeout
    off), so an instance that turned slower than it was, or is slower than the peers it is
    timed from, is not cut forever before it could teach its new pace. A round is an attempt
    that waited the time backed off so far: fifty attempts sent at once to a frozen instance
    and timed out together double it once, not fifty times. `idle_timeouts_in_row` does the
    same for the idle timeout of its streams: the largest gaps are learned only from streams
    that end, and a stream cut short after its first byte cannot be retried.
    """

    __slots__ = (
        "fit",
        "gap",
        "idle_timeouts_in_row",
        "per_token",
        "prefill",
        "service",
        "timeouts_in_row",
        "ttfb",
    )

    def __init__(self, smoothing: float) -> None:
        self.ttfb = Ewma(smoothing)
        self.gap = Ewma(smoothing)
        self.per_token = Ewma(smoothing)
        self.prefill = Ewma(smoothing)
        self.fit = PrefillFit(smoothing)
        self.service = Ewma(smoothing)
        self.timeouts_in_row = 0
        self.idle_timeouts_in_row = 0

    @property
    def estimators(self) -> tuple[Ewma, Ewma, Ewma, Ewma, Ewma]:
        return (self.ttfb, self.gap, self.per_token, self.prefill, self.service)

    def timed_out(self, backoff: int) -> None:
        """An attempt whose first-byte time was doubled `backoff` times (its
        `AttemptTimeouts.backoff`) got no first byte: the next ones double once more than it."""
        self.timeouts_in_row = max(self.timeouts_in_row, backoff + 1)

    def idle_timed_out(self) -> None:
        """A stream's idle timeout cut it: the next streams' gaps wait twice as long, up to
        `MAX_DOUBLINGS` times (`attempt_timeouts`), until a stream ends whole."""
        self.idle_timeouts_in_row += 1

    def set_smoothing(self, smoothing: float) -> None:
        for estimate in self.estimators:
            estimate.smoothing = smoothing
        self.fit.weight = smoothing

    def observe_stream(
        self,
        ttfb_s: float,
        max_gap_s: float | None,
        total_s: float,
        tokens: int | None,
        prompt_tokens: int = 0,
        queued: bool = False,
    ) -> None:
        """Record a finished stream.

        `ttfb` takes `ttfb_s`; `gap` takes `max_gap_s` unless it is None (fewer than two chunks:
        no gap was seen, and a 0 would drag the idle timeout down); `per_token` takes
        `max(0, total_s - ttfb_s) / tokens` when the completion token count is known and > 0;
        `service` takes `total_s`; `prefill` takes `ttfb_s / prompt_tokens` when the prompt's
        size is known (> 0) and the attempt was not `queued` behind a full instance (its wait
        for a slot is no prefill).
        """
        self.ttfb.observe(ttfb_s)
        if max_gap_s is not None:
            self.gap.observe(max_gap_s)
        if tokens is not None and tokens > 0:
            self.per_token.observe(max(0.0, total_s - ttfb_s) / tokens)
        self.service.observe(total_s)
        if prompt_tokens > 0 and not queued:
            self.prefill.observe(ttfb_s / prompt_tokens)
            self.fit.observe(prompt_tokens, ttfb_s)
        self.timeouts_in_row = 0
        self.idle_timeouts_in_row = 0

    def observe_whole(self, total_s: float, tokens: int | None) -> None:
        """Record a finished non-streamed response.

        `per_token` takes `max(0, total_s - ttfb_pred) / tokens` when the completion token count
        is known and > 0, where `ttfb_pred` is the current `ttfb` mean, or 0 while no stream has
        been seen (then the prefill is charged to the tokens: a longer timeout, never a shorter
        one). A response that generated no tokens (an embedding) teaches `ttfb` instead: its
        whole time is the prefill, and that is what its next timeout must predict. `service`
        takes `total_s` either way.
        """
        if tokens is not None and tokens > 0:
            ttfb = self.ttfb
            predicted = ttfb.mean if ttfb.samples else 0.0
            self.per_token.observe(max(0.0, total_s - predicted) / tokens)
        else:
            self.ttfb.observe(total_s)
        self.service.observe(total_s)
        self.timeouts_in_row = 0

    def just_learned(self, min_samples: int) -> bool:
        """Whether an estimate has exactly `min_samples` samples: it was just learned, and a
        prior worked out before it is out of date."""
        return any(estimate.samples == min_samples for estimate in self.estimators)

    def young(self, min_samples: int) -> bool:
        """Whether any estimate has fewer than `min_samples` samples (a prior may help)."""
        return any(estimate.samples < min_samples for estimate in self.estimators)


def pool_prior(states: Iterable[LatencyState], min_samples: int, smoothing: float) -> LatencyState:
    """What a pool's learned instances say about an instance that has not learned yet: per
    estimator, the average mean and deviation over the `states` that have at least
    `min_samples` samples of it (marked with `min_samples` samples), else an empty estimate.
    """
    prior = LatencyState(smoothing)
    states = list(states)
    for index, target in enumerate(prior.estimators):
        learned = [s.estimators[index] for s in states]
        learned = [e for e in learned if e.samples >= min_samples]
        if learned:
            target.mean = sum(e.mean for e in learned) / len(learned)
            target.deviation = sum(e.deviation for e in learned) / len(learned)
            target.samples = min_samples
    return prior
