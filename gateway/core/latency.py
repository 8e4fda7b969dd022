"""What one instance's past responses say about its next one: TTFB, chunk gaps, per-token time."""

from __future__ import annotations

from gateway.core.ewma import Ewma


class LatencyState:
    """Per-instance latency estimators, all with history weight `smoothing`.

    - `ttfb`: time to the first byte of a streamed response, or the whole time of a response
      that generates no tokens (an embedding); a non-streamed generation says nothing about it;
    - `gap`: the largest gap between two chunks of one stream, one sample per stream. The idle
      timeout is built from it: one built on the mean gap would cut healthy streams at the first
      scheduling hiccup;
    - `per_token`: seconds per generated token, from either kind of response.

    Record only successful responses (a timed-out attempt has no latency, only a lower bound).
    """

    __slots__ = ("gap", "per_token", "ttfb")

    def __init__(self, smoothing: float) -> None:
        self.ttfb = Ewma(smoothing)
        self.gap = Ewma(smoothing)
        self.per_token = Ewma(smoothing)

    def observe_stream(
        self, ttfb_s: float, max_gap_s: float | None, total_s: float, tokens: int | None
    ) -> None:
        """Record a finished stream.

        `ttfb` takes `ttfb_s`; `gap` takes `max_gap_s` unless it is None (fewer than two chunks:
        no gap was seen, and a 0 would drag the idle timeout down); `per_token` takes
        `max(0, total_s - ttfb_s) / tokens` when the completion token count is known and > 0.
        """
        self.ttfb.observe(ttfb_s)
        if max_gap_s is not None:
            self.gap.observe(max_gap_s)
        if tokens is not None and tokens > 0:
            self.per_token.observe(max(0.0, total_s - ttfb_s) / tokens)

    def observe_whole(self, total_s: float, tokens: int | None) -> None:
        """Record a finished non-streamed response.

        `per_token` takes `max(0, total_s - ttfb_pred) / tokens` when the completion token count
        is known and > 0, where `ttfb_pred` is the current `ttfb` mean, or 0 while no stream has
        been seen (then the prefill is charged to the tokens: a longer timeout, never a shorter
        one). A response that generated no tokens (an embedding) teaches `ttfb` instead: its
        whole time is the prefill, and that is what its next timeout must predict.
        """
        if tokens is not None and tokens > 0:
            ttfb = self.ttfb
            predicted = ttfb.mean if ttfb.samples else 0.0
            self.per_token.observe(max(0.0, total_s - predicted) / tokens)
        else:
            self.ttfb.observe(total_s)
