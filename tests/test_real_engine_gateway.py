"""The gateway in front of real engines (llama.cpp's server, continuous batching over slots), with
the defaults: busy is not broken.

Two engines with four slots each take more streams than they have slots (the rest wait for a
slot without a byte), while long prompts arrive whose prefill pauses every stream decoding on
their engine for seconds. Going direct, every stream completes; through the gateway every one
must too, and neither engine may be isolated, nor charged a failure for having more streams
than slots.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from loadtests.engine.server import Engine
from tests.engine import MODEL_NAME, engine_model, running_engine
from tests.support import LOOPBACK_LISTENERS, Gateway, start_gateway

SLOTS = 4
STREAMS = 12  # 1.5 times the slots of the two engines
LONG_PROMPTS = 2
WORDS = "the river runs over stone and light in the early morning while people come and go "
# Bounds of one round of load: a stream's wait for a read, and the wait for its thread. The
# test runs five rounds after starting two engines; its pytest timeout is well above
# THREAD_JOIN_S so that a stuck round is reported by these bounds, not by pytest.
READ_TIMEOUT_S = 180.0
THREAD_JOIN_S = 300.0


@dataclass
class Outcome:
    """What one streamed request got: its chunks' arrival times and how it ended."""

    status: int = 0
    done: bool = False
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    attempts: str | None = None
    instance: str | None = None
    sent_at: float = 0.0

    @property
    def max_gap_s(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def stream(url: str, body: dict[str, Any], out: Outcome, started: threading.Event) -> None:
    out.sent_at = time.monotonic()
    try:
        with (
            httpx.Client(timeout=READ_TIMEOUT_S) as http,
            http.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
        ):
            out.status = response.status_code
            out.attempts = response.headers.get("x-gateway-attempts")
            out.instance = response.headers.get("x-gateway-instance")
            buffer = b""
            for chunk in response.iter_raw():
                out.chunk_times.append(time.monotonic())
                started.set()
                buffer += chunk
            events = [e for e in buffer.decode().split("\n\n") if e.startswith("data: ")]
            for event in events[:-1]:
                payload = json.loads(event[len("data: ") :])
                if "error" in payload:
                    out.error = json.dumps(payload["error"])
            out.done = bool(events) and events[-1] == "data: [DONE]"
    except Exception as exc:
        out.error = repr(exc)


def short_body(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"{i}: tell me about the river"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


def long_body(i: int) -> dict[str, Any]:
    # About 1,500 tokens (of a slot's 2,048), with a distinct start so no prompt cache can
    # skip the prefill.
    text = f"{i} {time.monotonic_ns()} " + WORDS * 65
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "stream": True,
        "cache_prompt": False,
    }


def run_load(
    urls: list[str], max_tokens: int = 40, long_prompts: int = LONG_PROMPTS
) -> tuple[list[Outcome], list[Outcome]]:
    """STREAMS short streams at once (round robin over `urls`), then, once tokens flow, the long
    prompts one after the other; waits for all of them."""
    shorts = [Outcome() for _ in range(STREAMS)]
    longs = [Outcome() for _ in range(long_prompts)]
    flowing = threading.Event()
    threads = [
        threading.Thread(
            target=stream, args=(urls[i % len(urls)], short_body(i, max_tokens), out, flowing)
        )
        for i, out in enumerate(shorts)
    ]
    for thread in threads:
        thread.start()
    assert flowing.wait(120), "no stream started"
    ignored = threading.Event()
    for i, out in enumerate(longs):
        thread = threading.Thread(
            target=stream, args=(urls[i % len(urls)], long_body(i), out, ignored)
        )
        thread.start()
        threads.append(thread)
        time.sleep(0.5)
    for thread in threads:
        thread.join(THREAD_JOIN_S)
        assert not thread.is_alive()
    return shorts, longs


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    model = engine_model("slow")
    logs = tmp_path_factory.mktemp("engines")
    first = running_engine(model, logs, slots=SLOTS)
    second = running_engine(model, logs, slots=SLOTS)
    try:
        yield [next(first), next(second)]
    finally:
        for started in (first, second):
            started.close()


@pytest.fixture(scope="module")
def gateway(engines: list[Engine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # Nothing but the pool: the defaults must hold.
    instances = ", ".join(f'{{name: e{i}, url: "{e.url}"}}' for i, e in enumerate(engines))
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  llama:
    models: [{MODEL_NAME}]
    instances: [{instances}]
"""
    gw = start_gateway(tmp_path_factory.mktemp("gateway") / "policy.yaml", policy)
    try:
        yield gw
    finally:
        gw.stop()


def instances(gateway: Gateway) -> dict[str, dict[str, Any]]:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=10).json()
    return {i["name"]: i for i in state["pools"]["llama"]["instances"]}


@pytest.mark.timeout(THREAD_JOIN_S + 300)
def test_busy_engines_with_long_prompts_are_not_broken(
    engines: list[Engine], gateway: Gateway
) -> None:
    # Learn first, so the timeouts are the learned ones (down at their floor for a fast engine):
    # rounds of streams as many as the slots and beyond.
    for _ in range(3):
        warm, _ = run_load([gateway.url], max_tokens=16, long_prompts=0)
        assert all(o.done and o.error is None for o in warm), [o.error for o in warm]
    learned = instances(gateway)
    assert all(i["ewma"]["gap"]["samples"] >= 10 for i in learned.values())

    direct_shorts, direct_longs = run_load([e.url for e in engines])
    shorts, longs = run_load([gateway.url])

    def ok(outcomes: list[Outcome]) -> int:
        return sum(o.status == 200 and o.done and o.error is None for o in outcomes)

    after = instances(gateway)
    figures = {
        "direct": {
            "completed": ok(direct_shorts + direct_longs),
            "max_gap_s": round(max(o.max_gap_s for o in direct_shorts), 2),
        },
        "gateway": {
            "completed": ok(shorts + longs),
            "max_gap_s": round(max(o.max_gap_s for o in shorts), 2),
            "retried": sum(o.attempts not in (None, "1") for o in shorts + longs),
            "errors": [o.error for o in shorts + longs if o.error],
            # For a stream that failed: where, after how many chunks, its gaps.
            "broken": [
                {
                    "instance": o.instance,
                    "chunks": len(o.chunk_times),
                    "gaps": [round(b - a, 2) for a, b in itertools.pairwise(o.chunk_times)][-5:],
                    "since_long_s": [
                        round(o.chunk_times[-1] - t, 2) for t in (lo.sent_at for lo in longs)
                    ],
                }
                for o in shorts
                if o.error
            ],
        },
        "instances": {
            name: {
                "isolations": i["isolations"],
                "failures": i["failures"],
                "capacity_seen": i["capacity_seen"],
                "timeouts": i["timeouts_by_phase"],
                "stream_idle_s": i["timeouts"]["stream_idle_s"],
                "stream_first_byte_s": i["timeouts"]["stream_first_byte_s"],
            }
            for name, i in after.items()
        },
        "failures_while_learning": {name: i["failures"] for name, i in learned.items()},
        # The gateway's own account of every timeout (instance, phase, queueing, load).
        "timeout_log": [line for line in gateway.proc.lines if "upstream timeout" in line],
    }
    print("real engines:", json.dumps(figures))
    total = STREAMS + LONG_PROMPTS
    assert figures["direct"]["completed"] == total, figures
    # Every stream completes through the gateway, as it did direct.
    assert figures["gateway"]["completed"] == total, figures
    # Busy is not broken: no engine was isolated, and none was charged a failure while it only
    # had more streams than slots (the learning rounds: their queued attempts and the hedges
    # they lost are not its fault).
    for name, inst in after.items():
        assert inst["isolations"] == 0, (name, figures)
        assert inst["state"] == "ADMITTING"
        assert learned[name]["failures"] == 0, (name, figures)
    # With the long prompts, a short request that waits for a long prefill it was not told of
    # (nothing learned a prefill rate from the short prompts before) may outlast its learned
    # first-byte timeout on a loaded machine: blamed, it is retried on the other engine and
    # completes (above). Every failure charged is such a timeout, each one retried.
    blamed = sum(t["count"] for i in after.values() for t in i["timeouts_by_phase"] if t["blamed"])
    charged = sum(i["failures"] for i in after.values())
    assert charged <= blamed <= figures["gateway"]["retried"], figures
