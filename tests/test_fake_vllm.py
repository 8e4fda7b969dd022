"""The fake vLLM backend, run as a real subprocess and driven over loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.fake_vllm.responses import OOM_MESSAGE, text
from loadtests.procs import ManagedProcess, ProcessFailed, python_module

MODELS = ("m1", "m2")


@pytest.fixture(scope="module")
def fake() -> Iterator[ManagedProcess]:
    args = ["--port", "0", "--name", "t", "--models", ",".join(MODELS), "--seed", "1"]
    args += ["--ttft", "0.01", "--per-token", "0.001"]
    proc = ManagedProcess(python_module("loadtests.fake_vllm", *args))
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture
def client(fake: ManagedProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{fake.port()}", timeout=5.0) as c:
        c.post("/_fake/reset").raise_for_status()
        yield c


def set_faults(client: httpx.Client, **faults: Any) -> None:
    client.post("/_fake/faults", json=faults).raise_for_status()


def ended_log(client: httpx.Client, count: int, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """The request log once `count` requests have ended (the fake wakes us; no polling)."""
    log: list[dict[str, Any]] = client.get(
        "/_fake/requests", params={"wait_for": count, "timeout": timeout_s}
    ).json()
    assert sum(r["ended"] is not None for r in log) >= count, log
    return log


def sse_events(response: httpx.Response) -> Iterator[tuple[float, str]]:
    """(arrival time, data) of each SSE event as its bytes come off the socket."""
    buffer = b""
    for chunk in response.iter_raw():
        now = time.monotonic()
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            yield now, event[len(b"data: ") :].decode()


def chat(max_tokens: int = 5, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m1",
        "messages": [{"role": "user", "content": "say something nice"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def test_chat_non_streamed_has_text_and_usage(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=chat(max_tokens=5))
    assert response.status_code == 200
    assert response.headers["content-length"] == str(len(response.content))
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m1"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_completion_non_streamed_defaults_to_16_tokens(client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"model": "m2", "prompt": "once upon"}).json()
    assert body["object"] == "text_completion"
    assert len(body["choices"][0]["text"].split()) == 16
    assert body["usage"]["completion_tokens"] == 16


def test_stream_events_arrive_incrementally(client: httpx.Client) -> None:
    set_faults(client, per_token=0.05)
    request = chat(max_tokens=10, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    tokens, usage = chunks[:-1], chunks[-1]
    assert len(tokens) == 10
    assert tokens[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 9 + ["length"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
    assert len(text.split()) == 10
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    # Ten tokens 50 ms apart: the first is read long before the last is produced.
    assert events[9][0] - events[0][0] > 0.3


def test_tokens_per_event_batches_tokens(client: httpx.Client) -> None:
    set_faults(client, tokens_per_event=4, per_token=0.02)
    request = chat(max_tokens=10, stream=True, stream_options={"include_usage": True})
    started = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        events = list(sse_events(response))
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    tokens, usage = chunks[:-1], chunks[-1]
    contents = [c["choices"][0]["delta"]["content"] for c in tokens]
    assert [len(text.split()) for text in contents] == [4, 4, 2]
    assert "".join(contents) == "the model says hello to a fast gateway and its"
    assert tokens[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "role" not in tokens[1]["choices"][0]["delta"]
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, "length"]
    assert usage["usage"]["completion_tokens"] == 10
    # Timing is per token as before: the last event leaves when token 10 is due.
    assert time.monotonic() - started >= 10 * 0.02 - 0.005

    # A cut (die) is an event boundary: exactly die_after tokens arrive, in completions too.
    set_faults(client, tokens_per_event=3, per_token=0, die_rate=1, die_after=5)
    completion = {"model": "m2", "prompt": "x", "max_tokens": 10, "stream": True}
    received: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", "/v1/completions", json=completion) as r,
    ):
        received.extend(data for _, data in sse_events(r))
    texts = [json.loads(d)["choices"][0]["text"] for d in received]
    assert texts == ["the model says", " hello to"]

    # null goes back to the command line's value (1 here); bad values are refused.
    set_faults(client, tokens_per_event=None, die_rate=0)
    with client.stream("POST", "/v1/completions", json=completion) as r:
        assert len([d for _, d in sse_events(r)]) == 10 + 1
    for bad in (0, 2.5, True, "4"):
        assert client.post("/_fake/faults", json={"tokens_per_event": bad}).status_code == 400


def test_completion_stream_without_usage_ends_with_done(client: httpx.Client) -> None:
    set_faults(client, per_token=0)
    request = {"model": "m2", "prompt": "x", "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as response:
        data = [d for _, d in sse_events(response)]
    assert data[-1] == "[DONE]"
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == ["the", " model", " says"]


def test_embeddings(client: httpx.Client) -> None:
    one = client.post("/v1/embeddings", json={"model": "m2", "input": "hello world"}).json()
    assert [d["index"] for d in one["data"]] == [0]
    assert one["data"][0]["object"] == "embedding"
    assert len(one["data"][0]["embedding"]) == 8
    assert one["usage"]["prompt_tokens"] == 2
    many = client.post("/v1/embeddings", json={"model": "m2", "input": ["a", "b", "a"]}).json()
    vectors = [d["embedding"] for d in many["data"]]
    assert len(vectors) == 3 and vectors[0] == vectors[2] != vectors[1]


def test_models_and_health(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == list(MODELS)
    assert all(m["object"] == "model" for m in models["data"])
    health = client.get("/health")
    assert health.status_code == 200 and health.content == b""
    set_faults(client, unhealthy=True)
    assert client.get("/health").status_code == 503
    client.post("/_fake/reset")
    assert client.get("/health").status_code == 200


def test_bad_requests(client: httpx.Client) -> None:
    unknown = client.post("/v1/chat/completions", json={**chat(), "model": "nope"})
    assert unknown.status_code == 404
    assert set(unknown.json()["error"]) == {"message", "type", "code"}
    bad_json = client.post("/v1/completions", content=b"{not json")
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["code"] == 400
    assert client.post("/nowhere").status_code == 404
    assert client.get("/v1/chat/completions").status_code == 405
    outcomes = [r["outcome"] for r in ended_log(client, 2)]
    assert outcomes == ["error", "error"]


def test_error_fault(client: httpx.Client) -> None:
    set_faults(client, error_rate=1, error_status=503)
    response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503
    assert [(r["outcome"], r["fault"]) for r in ended_log(client, 1)] == [("error", "error")]


def test_oom_fault_counts(client: httpx.Client) -> None:
    set_faults(client, oom_rate=1)
    first = client.post("/v1/completions", json={"model": "m1", "prompt": "x"})
    second = client.post("/v1/chat/completions", json=chat())
    assert first.status_code == second.status_code == 500
    error = first.json()["error"]
    assert error["message"].startswith("CUDA out of memory. Tried to allocate")
    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert [first.headers["x-oom-count"], second.headers["x-oom-count"]] == ["1", "2"]
    assert {r["outcome"] for r in ended_log(client, 2)} == {"oom"}


def test_rate_limit_fault(client: httpx.Client) -> None:
    set_faults(client, rate_limit_rate=1, retry_after=7)
    response = client.post("/v1/embeddings", json={"model": "m1", "input": "x"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert response.json()["error"]["type"] == "RateLimitError"
    assert ended_log(client, 1)[0]["outcome"] == "rate_limited"


def test_hang_fault_holds_headers_until_the_client_leaves(client: httpx.Client) -> None:
    set_faults(client, hang_rate=1)
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=chat(), timeout=0.3)
    assert time.monotonic() - started >= 0.29
    [record] = ended_log(client, 1)
    assert record["fault"] == "hang"
    assert record["outcome"] == "cancelled"


def test_hang_fault_answers_504_after_hang_s(client: httpx.Client) -> None:
    set_faults(client, hang_rate=1, hang_s=0.1)
    response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 504
    assert ended_log(client, 1)[0]["outcome"] == "hung"


def test_stall_fault_stops_mid_stream(client: httpx.Client) -> None:
    set_faults(client, stall_rate=1, stall_after=2, per_token=0)
    received: list[str] = []
    timeout = httpx.Timeout(5.0, read=0.3)
    with (
        pytest.raises(httpx.ReadTimeout),
        client.stream("POST", "/v1/chat/completions", json=chat(10, True), timeout=timeout) as r,
    ):
        received.extend(data for _, data in sse_events(r))
    assert len(received) == 2
    [record] = ended_log(client, 1)
    assert (record["fault"], record["outcome"]) == ("stall", "cancelled")


def test_stall_fault_closes_after_hang_s(client: httpx.Client) -> None:
    set_faults(client, stall_rate=1, stall_after=1, hang_s=0.1)
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", "/v1/completions", json={**chat(5, True), "prompt": "x"}) as r,
    ):
        list(sse_events(r))
    assert ended_log(client, 1)[0]["outcome"] == "stalled"


def test_die_fault_breaks_a_stream(client: httpx.Client) -> None:
    set_faults(client, die_rate=1, die_after=2, per_token=0)
    received: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", "/v1/chat/completions", json=chat(10, True)) as r,
    ):
        assert r.status_code == 200
        received.extend(data for _, data in sse_events(r))
    assert len(received) == 2 and "[DONE]" not in received
    assert ended_log(client, 1)[0]["outcome"] == "died"


def test_die_fault_truncates_a_plain_response(client: httpx.Client) -> None:
    set_faults(client, die_rate=1)
    with pytest.raises(httpx.RemoteProtocolError):
        client.post("/v1/chat/completions", json=chat())
    with pytest.raises(httpx.RemoteProtocolError):
        client.post("/v1/embeddings", json={"model": "m1", "input": "x"})
    assert {r["outcome"] for r in ended_log(client, 2)} == {"died"}


def test_slow_factor_scales_latency(client: httpx.Client) -> None:
    set_faults(client, ttft=0.05, per_token=0.0, slow_factor=4)
    started = time.monotonic()
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    # 4 x 0.05 s; an event loop may wake a timer a few milliseconds early, and
    # anything well above the unscaled 0.05 s shows the factor was applied.
    assert time.monotonic() - started >= 0.15


def test_random_faults_are_reproducible_after_reset(client: httpx.Client) -> None:
    def statuses() -> list[int]:
        set_faults(client, error_rate=0.5, ttft=0, per_token=0)
        return [client.post("/v1/completions", json={"model": "m1"}).status_code for _ in range(20)]

    first = statuses()
    client.post("/_fake/reset")
    assert statuses() == first
    assert set(first) == {200, 500}


def test_request_log_records_requests(client: httpx.Client) -> None:
    headers = [("X-Trace", "a"), ("x-trace", "b"), ("Authorization", "Bearer t")]
    client.post("/v1/chat/completions?debug=1", json=chat(7), headers=headers)
    client.post("/v1/embeddings", json={"model": "m2", "input": "x"})
    client.get("/v1/models")  # not a generation request: not logged
    first, second = ended_log(client, 2)
    assert first["id"] == 1 and second["id"] == 2
    assert first["method"] == "POST"
    assert first["path"] == "/v1/chat/completions" and first["query"] == "debug=1"
    assert (first["model"], first["stream"], first["max_tokens"]) == ("m1", False, 7)
    assert first["headers"]["x-trace"] == "a, b"
    assert first["headers"]["authorization"] == "Bearer t"
    assert first["outcome"] == "ok" and first["fault"] is None
    assert first["started"] <= first["ended"] <= second["started"]
    assert (second["path"], second["model"], second["outcome"]) == ("/v1/embeddings", "m2", "ok")
    client.post("/_fake/reset")
    assert client.get("/_fake/requests").json() == []


def test_wait_for_gives_up_after_timeout(client: httpx.Client) -> None:
    started = time.monotonic()
    # Answered (the log as it is: empty) rather than left waiting for a request that never
    # comes, which the client would give up on after its own 5 s.
    assert client.get("/_fake/requests", params={"wait_for": 1, "timeout": 0.2}).json() == []
    assert time.monotonic() - started >= 0.2


def test_client_disconnect_mid_stream_is_cancelled(client: httpx.Client) -> None:
    set_faults(client, per_token=0.05)
    with client.stream("POST", "/v1/chat/completions", json=chat(100, True)) as response:
        events = sse_events(response)
        next(events)
        next(events)
        running = client.get("/metrics").text
        assert 'vllm:num_requests_running{model_name="m1"} 1.0' in running
    # Leaving the block closed the half-read connection; 100 tokens would take 5 s, and end
    # "ok" if left to run.
    [record] = ended_log(client, 1)
    assert record["outcome"] == "cancelled"
    metrics = client.get("/metrics").text
    assert 'vllm:num_requests_running{model_name="m1"} 0.0' in metrics
    assert "vllm:request_success_total{" in metrics
    assert "vllm:num_requests_waiting{" in metrics and "vllm:gpu_cache_usage_perc{" in metrics


def test_faults_endpoint_merges_and_validates(client: httpx.Client) -> None:
    set_faults(client, error_rate=0.25)
    set_faults(client, retry_after=3)
    faults = client.get("/_fake/faults").json()
    assert (faults["error_rate"], faults["retry_after"], faults["hang_s"]) == (0.25, 3, 3600.0)
    assert client.post("/_fake/faults", json={"bogus": 1}).status_code == 400
    assert client.post("/_fake/faults", json={"error_rate": 2}).status_code == 400
    assert client.post("/_fake/faults", json={"unhealthy": "yes"}).status_code == 400
    assert client.get("/_fake/faults").json() == faults


def test_fixed_body_mode_and_clean_stop() -> None:
    proc = ManagedProcess(python_module("loadtests.fake_vllm", "--port", "0", "--fixed-body"))
    try:
        url = f"http://127.0.0.1:{proc.port()}"
        assert proc.ready["name"] == "fake"
        response = httpx.post(f"{url}/v1/embeddings", content=b"not even json")
        assert response.status_code == 200
        assert response.json()["object"] == "chat.completion"
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        assert proc.stop() == 0, proc.output()


@pytest.fixture
def engine_fake() -> Iterator[ManagedProcess]:
    # Two generate at once in a 250-token KV cache; 0.5 s a token keeps a stream running until
    # the test closes it.
    args = ["--port", "0", "--models", "m1,m2", "--ttft", "0", "--per-token", "0.5"]
    args += ["--max-running", "2", "--kv-tokens", "250"]
    proc = ManagedProcess(python_module("loadtests.fake_vllm", *args))
    yield proc
    assert proc.stop() == 0, proc.output()


def gauge(metrics: str, name: str, model: str) -> float:
    prefix = f'{name}{{model_name="{model}"}} '
    [line] = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(line[len(prefix) :])


async def test_engine_queues_beyond_max_running_and_fails_kv_overflow_as_oom(
    engine_fake: ManagedProcess,
) -> None:
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{engine_fake.port()}", timeout=10.0
    ) as client:

        async def wait_waiting(count: int) -> dict[str, Any]:
            # The fake answers once `count` requests are queued: no polling.
            state: dict[str, Any] = (
                await client.get("/_fake/engine", params={"waiting": count, "timeout": 5})
            ).json()
            assert state["waiting"] >= count, state
            return state

        async def stream_all(body: dict[str, Any]) -> tuple[int, list[str]]:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                text = (await response.aread()).decode()
            return response.status_code, [e for e in text.split("\n\n") if e]

        # KV need = 3 prompt words + max_tokens. A stream's headers mean it is running.
        async with client.stream("POST", "/v1/chat/completions", json=chat(200, True)) as a:
            assert a.status_code == 200  # 203 of 250 tokens held
            overflow = await client.post("/v1/chat/completions", json={**chat(100), "model": "m2"})
            assert overflow.status_code == 500  # 203 + 103 > 250, though a place is free
            assert overflow.json()["error"]["message"] == OOM_MESSAGE
            assert overflow.headers["x-oom-count"] == "1"

            async with client.stream("POST", "/v1/chat/completions", json=chat(40, True)) as b:
                assert b.status_code == 200  # 246 of 250 held; both places taken
                await client.post("/_fake/faults", json={"per_token": 0})
                late_big = asyncio.create_task(client.post("/v1/chat/completions", json=chat(100)))
                await wait_waiting(1)
                late_small = asyncio.create_task(stream_all(chat(5, True)))
                await wait_waiting(2)
                assert not late_big.done() and not late_small.done()
                metrics = (await client.get("/metrics")).text
                for model in ("m1", "m2"):  # one engine: the same figures on each model's line
                    assert gauge(metrics, "vllm:num_requests_running", model) == 2
                    assert gauge(metrics, "vllm:num_requests_waiting", model) == 2
                    assert gauge(metrics, "vllm:gpu_cache_usage_perc", model) == 246 / 250
                    assert gauge(metrics, "vllm:kv_cache_usage_perc", model) == 246 / 250
            # Closing b frees its place and 43 tokens: the first waiter (103) still does not fit
            # beside a's 203 and fails as OOM; the place goes on to the next, which runs.
            big = await asyncio.wait_for(late_big, 5)
            assert big.status_code == 500 and big.headers["x-oom-count"] == "2"
            status, events = await asyncio.wait_for(late_small, 5)
            assert status == 200 and len(events) == 5 + 1 and events[-1] == "data: [DONE]"

        log = (await client.get("/_fake/requests", params={"wait_for": 5, "timeout": 5})).json()
        outcomes = sorted((r["max_tokens"], r["outcome"], r["fault"]) for r in log)
        assert outcomes == [
            (5, "ok", None),
            (40, "cancelled", None),
            (100, "oom", "oom"),
            (100, "oom", "oom"),
            (200, "cancelled", None),
        ]
        state = (await client.get("/_fake/engine")).json()
        assert (state["running"], state["waiting"], state["kv_used"], state["ooms"]) == (0, 0, 0, 2)
        metrics = (await client.get("/metrics")).text
        assert gauge(metrics, "vllm:kv_cache_usage_perc", "m1") == 0
        await client.post("/_fake/reset")
        assert (await client.get("/_fake/engine")).json()["ooms"] == 0


def test_a_replacement_booted_ahead_serves_only_once_told_to(tmp_path: Path) -> None:
    """`--serve-when PATH`: booted, it says so (PATH.booted) and waits with its port closed;
    it serves once PATH exists, and READY comes then."""
    trigger = tmp_path / "serve"
    argv = python_module("loadtests.fake_vllm", "--port", "0", "--serve-when", str(trigger))
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(ManagedProcess, argv, ready_timeout_s=60)
        booted = Path(f"{trigger}.booted")
        for _ in range(600):  # bounded: 60 s
            if booted.exists() or starting.done():
                break
            time.sleep(0.1)
        assert booted.exists()
        time.sleep(0.3)
        assert not starting.done(), "it serves before it is told to"
        trigger.touch()
        proc = starting.result(timeout=30)
    try:
        response = httpx.get(f"http://127.0.0.1:{proc.port()}/health", timeout=5)
        assert response.status_code == 200
    finally:
        proc.stop()


def test_a_replacement_booted_ahead_and_never_needed_exits_when_cancelled(tmp_path: Path) -> None:
    trigger = tmp_path / "serve"
    Path(f"{trigger}.cancel").touch()
    argv = python_module("loadtests.fake_vllm", "--port", "0", "--serve-when", str(trigger))
    with pytest.raises(ProcessFailed):
        ManagedProcess(argv, ready_timeout_s=60)
    assert Path(f"{trigger}.booted").exists()  # it booted, then left without serving


# --- continuation, as vLLM does it ------------------------------------------------------------


def test_a_continued_final_message_picks_up_where_its_text_ends(client: httpx.Client) -> None:

    prefix = text(5)
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": prefix}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 7,
    }
    reply = client.post("/v1/chat/completions", json=body).json()
    assert prefix + reply["choices"][0]["message"]["content"] == text(12)
    # The prompt counts the continued text (the fake counts words).
    assert reply["usage"] == {"prompt_tokens": 6, "total_tokens": 13, "completion_tokens": 7}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(d) for _, d in sse_events(r) if d != "[DONE]"]
    # vLLM's first chunk names the role with empty content; the text follows.
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert prefix + streamed == text(12)


def test_continue_final_message_needs_add_generation_prompt_off(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}]
    both = {"model": "m1", "messages": messages, "continue_final_message": True}
    reply = client.post("/v1/chat/completions", json=both)  # add_generation_prompt: true
    assert reply.status_code == 400
    assert "add_generation_prompt" in reply.json()["error"]["message"]
    user_last = {**both, "messages": messages[:1], "add_generation_prompt": False}
    assert client.post("/v1/chat/completions", json=user_last).status_code == 400


def test_a_completion_continues_its_prompt(client: httpx.Client) -> None:

    reply = client.post(
        "/v1/completions", json={"model": "m1", "prompt": "once " + text(3), "max_tokens": 4}
    ).json()
    assert text(3) + reply["choices"][0]["text"] == text(7)


@pytest.mark.parametrize("fault", ["die_next", "error_next"])
def test_the_next_streams_can_be_cut_after_n_tokens(client: httpx.Client, fault: str) -> None:
    set_faults(client, **{fault: 1}, die_after=2, stall_after=2)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 6}) as r:
        try:
            data = [d for _, d in sse_events(r)]
        except httpx.RemoteProtocolError:
            data = []  # die: the connection dropped after the tokens
    if fault == "error_next":
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == 500  # vLLM's error event
        assert len(data) == 4
    # Only the next one: the stream after it is whole.
    with client.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 6}) as r:
        assert [d for _, d in sse_events(r)][-1] == "[DONE]"
    log = ended_log(client, 2)
    assert [r["fault"] for r in log] == ["die" if fault == "die_next" else "stream_error", None]
