"""Counters the request path keeps for the metrics, on the pool and instance it already holds.

Plain integers and dicts: an increment is a few tens of nanoseconds, with no label lookup and no
lock (one event loop owns them). `gateway.metrics` reads them when scraped.
"""

from __future__ import annotations

from gateway.core.histogram import TOKEN_BUCKETS_S, Histogram
from gateway.core.outcome import Outcome
from gateway.core.usage import Usage


def outcome_label(outcome: Outcome) -> str:
    """A bounded label for an attempt's outcome: its kind, or `http_<status>` for an error
    status (`ok` covers every status below 400)."""
    if outcome.kind == "status":
        return _STATUS_LABELS.get(outcome.status or 0) or f"http_{outcome.status}"
    return outcome.kind


_STATUS_LABELS = {status: f"http_{status}" for status in range(400, 600)}


def status_class(status: int) -> str:
    return _CLASSES[min(status // 100, 5)]


_CLASSES = ("1xx", "1xx", "2xx", "3xx", "4xx", "5xx")


# How a hedged first attempt ended (`pipeline.hedge`): a bounded label set, all exported.
HEDGE_RESULTS = ("won", "lost", "failed", "late", "no_budget", "no_room", "in_order")


class InstanceStats:
    """Per instance: attempts by outcome, probes by result, timeouts by phase and blame (a
    timeout that was queueing behind a busy instance is not blamed on it)."""

    __slots__ = ("attempts", "probes", "timeouts")

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}
        self.probes: dict[str, int] = {}  # "succeeded" / "failed"
        self.timeouts: dict[tuple[str, bool], int] = {}  # (phase, blamed)

    def timeout(self, phase: str, blamed: bool) -> None:
        key = (phase, blamed)
        self.timeouts[key] = self.timeouts.get(key, 0) + 1

    def attempt(self, outcome: Outcome, probe: bool) -> None:
        label = outcome_label(outcome)
        self.attempts[label] = self.attempts.get(label, 0) + 1
        if probe:
            self.probe_settled(not outcome.counts_as_failure)

    def probe_settled(self, succeeded: bool) -> None:
        """A probe's result (a stream's is known at its first byte, before its attempt ends)."""
        result = "succeeded" if succeeded else "failed"
        self.probes[result] = self.probes.get(result, 0) + 1


class PoolStats:
    """Per pool: client requests by model and status class with their latencies; retries by
    the outcome that caused them; timeouts by phase; retries the budget refused; streams
    resumed after their first byte (by the instance that broke them and why) and streams
    that broke and could not be (by the reason)."""

    __slots__ = (
        "budget_exhausted",
        "duration",
        "fallback_skips",
        "fallbacks",
        "hedges",
        "panics",
        "per_output_token",
        "requests",
        "resume_refusals",
        "resumes",
        "retries",
        "timeouts",
        "tokens",
        "ttfb",
    )

    def __init__(self, models: list[str]) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.duration = {model: Histogram() for model in models}
        self.ttfb = {model: Histogram() for model in models}
        self.retries: dict[str, int] = {}
        self.timeouts: dict[str, int] = {}
        self.budget_exhausted = 0
        self.resumes: dict[tuple[str, str], int] = {}  # (instance, reason)
        self.resume_refusals: dict[str, int] = {}
        # Hedged first attempts by how they ended: won, lost, failed (both failed), or not
        # sent: no_budget (the retry budget refused it), no_room (every other instance full),
        # in_order (its instance serves it in its turn: `pipeline.hedge`), late (the first
        # attempt answered as its hedge was leaving, before the hedge chose an instance).
        self.hedges: dict[str, int] = {}
        # Attempts sent while no instance was healthy and admitting (the pool panicked).
        self.panics = 0
        # Tokens the answers said they used, by (model, "input" | "output"), and the time per
        # output token of streams (after the first).
        self.tokens: dict[tuple[str, str], int] = {}
        self.per_output_token: dict[str, Histogram] = {}
        # Requests this pool handed over to another (`ingress.fallback`), by (pool, reason),
        # and fallbacks it could not use for one, by (pool, why not).
        self.fallbacks: dict[tuple[str, str], int] = {}
        self.fallback_skips: dict[tuple[str, str], int] = {}

    def count_usage(self, model: str, usage: Usage, stream_s: float | None = None) -> None:
        """An answer's usage; `stream_s`: a stream's time from first to last byte."""
        tokens = self.tokens
        if usage.input_tokens is not None:
            key = (model, "input")
            tokens[key] = tokens.get(key, 0) + usage.input_tokens
        output = usage.output_tokens
        if output is not None:
            key = (model, "output")
            tokens[key] = tokens.get(key, 0) + output
            if stream_s is not None and output > 1:
                histogram = self.per_output_token.get(model)
                if histogram is None:
                    histogram = self.per_output_token[model] = Histogram(TOKEN_BUCKETS_S)
                histogram.observe(stream_s / (output - 1))

    def fell_back(self, to: str, reason: str) -> None:
        key = (to, reason)
        self.fallbacks[key] = self.fallbacks.get(key, 0) + 1

    def skipped_fallback(self, to: str, why: str) -> None:
        key = (to, why)
        self.fallback_skips[key] = self.fallback_skips.get(key, 0) + 1

    def hedged(self, result: str) -> None:
        self.hedges[result] = self.hedges.get(result, 0) + 1

    def resumed(self, instance: str, reason: str) -> None:
        key = (instance, reason)
        self.resumes[key] = self.resumes.get(key, 0) + 1

    def not_resumed(self, reason: str) -> None:
        self.resume_refusals[reason] = self.resume_refusals.get(reason, 0) + 1

    def request(self, model: str, status: int, duration_s: float) -> None:
        key = (model, status_class(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        self.duration[model].observe(duration_s)

    def retry(self, outcome: Outcome) -> None:
        label = outcome_label(outcome)
        self.retries[label] = self.retries.get(label, 0) + 1

    def timeout(self, phase: str) -> None:
        self.timeouts[phase] = self.timeouts.get(phase, 0) + 1
