"""Backends that misbehave at the byte level, played by a scripted TCP server."""

from __future__ import annotations

import gzip
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.scripted_upstream import ScriptedUpstream, chunk, trickle
from tests.support import LOOPBACK_LISTENERS, Gateway, start_gateway

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def partial_event(sock: socket.socket) -> None:
    sock.sendall(SSE_HEAD + chunk(b'data: {"n":1}\n\n') + chunk(b'data: {"n":2,"cho'))
    time.sleep(0.2)  # the gateway relays what it has; then the backend dies mid-event


def control_char_header(sock: socket.socket) -> None:
    body = b'{"choices":[]}'
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-weird: a\x01b\r\n"
        b"x-fine: yes\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )


def no_content(sock: socket.socket) -> None:
    sock.sendall(b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n")


def spoofed_gateway_headers(sock: socket.socket) -> None:
    body = b'{"choices":[]}'
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-gateway-instance: evil\r\n"
        b"x-gateway-attempts: 99\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )


def trickled_body(sock: socket.socket) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n")
    trickle(sock, b"x" * 40, 0.25)


def trickled_headers(sock: socket.socket) -> None:
    trickle(sock, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" * 5, 0.2)


def trickled_stream(sock: socket.socket) -> None:
    sock.sendall(SSE_HEAD)
    for n in range(40):  # each event comes well within the idle timeout, forever
        try:
            sock.sendall(chunk(b'data: {"n":%d}\n\n' % n))
        except OSError:
            return
        time.sleep(0.25)


def gzip_stream_cut(sock: socket.socket) -> None:
    compressed = gzip.compress(b'data: {"n":1}\n\n' * 200)
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunk(compressed[: len(compressed) // 2])
    )
    time.sleep(0.2)


GZIPPED_ANSWER = json.dumps({"choices": [{"text": "squeezed " * 100}]}).encode()


def gzip_transfer_coded(sock: socket.socket) -> None:
    # gzip as a transfer coding, under chunked: no Content-Encoding from the backend.
    coded = gzip.compress(GZIPPED_ANSWER)
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: gzip, chunked\r\n\r\n"
        + chunk(coded[:20])
        + chunk(coded[20:])
        + b"0\r\n\r\n"
    )


def status_600(sock: socket.socket) -> None:
    sock.sendall(b"HTTP/1.1 600 Beyond\r\ncontent-length: 2\r\n\r\nhi")


def two_answers(sock: socket.socket) -> None:
    # One read holding a whole answer and then another nobody asked for.
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n"
        b'{"a":1}HTTP/1.1 500 Oops\r\nx-second: yes\r\ncontent-length: 4\r\n\r\noops'
    )


def with_trailers(sock: socket.socket) -> None:
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
        b"trailer: x-checksum\r\n\r\n" + chunk(b'{"a":1}') + b"0\r\nx-checksum: abc\r\n\r\n"
    )


def too_many_fields(sock: socket.socket) -> None:
    fields = b"".join(b"x-field-%d: v\r\n" % i for i in range(101))
    sock.sendall(b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 2\r\n\r\nhi")


def cr_partial_event(sock: socket.socket) -> None:
    # Lines ended by CR alone (which SSE allows), then the backend dies mid-event.
    sock.sendall(SSE_HEAD + chunk(b'data: {"n":1}\r\r') + chunk(b'data: {"n":2,"cho'))
    time.sleep(0.2)


def endless_event(sock: socket.socket) -> None:
    # One event, then one that never ends: 64 KiB pieces of a single line, past 1 MiB.
    sock.sendall(SSE_HEAD + chunk(b'data: {"n":1}\n\n') + chunk(b"data: "))
    piece = chunk(b"x" * 65536)
    try:
        for _ in range(40):
            sock.sendall(piece)
    except OSError:
        return  # the gateway gave up on it: what this case is about
    time.sleep(1)


def ends_without_done(sock: socket.socket) -> None:
    # A clean end of the body (the last chunk) before the protocol's own last event.
    sock.sendall(SSE_HEAD + chunk(b'data: {"n":1}\n\n') + b"0\r\n\r\n")


def done_without_blank_line(sock: socket.socket) -> None:
    sock.sendall(SSE_HEAD + chunk(b'data: {"n":1}\n\ndata: [DONE]\n') + b"0\r\n\r\n")


def _responses_event(kind: str, sequence: int) -> bytes:
    data = json.dumps({"type": kind, "sequence_number": sequence}).encode()
    return f"event: {kind}\n".encode() + b"data: " + data + b"\n\n"


def responses_completed_then_cut(sock: socket.socket) -> None:
    # The Responses API's last event, then the connection dies before the body's last chunk.
    events = _responses_event("response.created", 0) + _responses_event("response.completed", 1)
    sock.sendall(SSE_HEAD + chunk(events))
    time.sleep(0.2)


def responses_cut(sock: socket.socket) -> None:
    events = _responses_event("response.created", 0) + _responses_event(
        "response.output_text.delta", 1
    )
    sock.sendall(SSE_HEAD + chunk(events) + chunk(b"event: response.output_te"))
    time.sleep(0.2)


def done_then_cut(sock: socket.socket) -> None:
    sock.sendall(SSE_HEAD + chunk(b'data: {"n":1}\n\ndata: [DONE]\n\n'))
    time.sleep(0.2)


def json_cut(sock: socket.socket) -> None:
    body = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"Hel'
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )


def json_empty(sock: socket.socket) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n")


def html_page(sock: socket.socket) -> None:
    body = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )


def json_padded(sock: socket.socket) -> None:
    body = b'\n  {"a":1}\n'
    sock.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json; charset=utf-8\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


def garbage_stream(sock: socket.socket) -> None:
    sock.sendall(
        SSE_HEAD + chunk(b"<html>oops</html>\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    )


def dripped_event(sock: socket.socket) -> None:
    # The head at once, then the first event a byte at a time: 4 s for it, past every deadline.
    sock.sendall(SSE_HEAD)
    for byte in b'data: {"n":1}\n\n':
        try:
            sock.sendall(chunk(bytes([byte])))
        except OSError:
            return
        time.sleep(0.25)


SCRIPTS = {
    "json-cut": json_cut,
    "json-empty": json_empty,
    "html-page": html_page,
    "garbage-stream": garbage_stream,
    "json-padded": json_padded,
    "dripped-event": dripped_event,
    "responses-completed-then-cut": responses_completed_then_cut,
    "responses-cut": responses_cut,
    "done-then-cut": done_then_cut,
    "partial-event": partial_event,
    "control-char-header": control_char_header,
    "no-content": no_content,
    "spoofed-gateway-headers": spoofed_gateway_headers,
    "trickled-body": trickled_body,
    "trickled-headers": trickled_headers,
    "trickled-stream": trickled_stream,
    "gzip-stream-cut": gzip_stream_cut,
    "gzip-transfer-coded": gzip_transfer_coded,
    "status-600": status_600,
    "two-answers": two_answers,
    "with-trailers": with_trailers,
    "too-many-fields": too_many_fields,
    "cr-partial-event": cr_partial_event,
    "endless-event": endless_event,
    "ends-without-done": ends_without_done,
    "done-without-blank-line": done_without_blank_line,
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    upstream = ScriptedUpstream(SCRIPTS)
    models = ", ".join(SCRIPTS)
    policy = f"""
{LOOPBACK_LISTENERS}
pools:
  edge:
    models: [{models}]
    instances: [{{name: scripted, url: "{upstream.url}"}}]
    timeouts: {{initial: 1s, ceiling: 2s, floor: 100ms}}
    health: {{enabled: false}}  # the scripted backend only plays its scripts
    breaker: {{consecutive_timeouts: 1000, error_rate: 1.0}}  # every case must reach it
"""
    gw = start_gateway(tmp_path_factory.mktemp("edge") / "policy.yaml", policy)
    yield gw
    gw.stop()
    upstream.close()


@pytest.fixture
def client(gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=15) as http:
        yield http


def post(model: str) -> dict[str, object]:
    return {"model": model, "messages": [], "stream": True}


def test_stream_cut_mid_event_ends_with_a_clean_error_event(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/chat/completions", json=post("partial-event")) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[0] == 'data: {"n":1}'
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))  # valid JSON: no half event before it
    assert error["error"]["code"] == "upstream_reset"
    assert len(lines) == 3


def test_header_with_control_characters_is_dropped(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=post("control-char-header"))
    assert response.status_code == 200
    assert "x-weird" not in response.headers
    assert response.headers["x-fine"] == "yes"


def test_no_content_response_is_relayed(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=post("no-content"))
    assert response.status_code == 204
    assert response.content == b""


def test_upstream_cannot_speak_for_the_gateway(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=post("spoofed-gateway-headers"))
    assert response.headers.get_list("x-gateway-instance") == ["scripted"]
    assert response.headers.get_list("x-gateway-attempts") == ["1"]


@pytest.mark.parametrize("model", ["trickled-body", "trickled-headers"])
def test_trickling_backend_is_cut_at_the_ceiling(
    client: httpx.Client, gateway: Gateway, model: str
) -> None:
    before = timeouts_by_phase(gateway)
    started = time.monotonic()
    response = client.post("/v1/chat/completions", json=post(model))
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert elapsed >= 0.9  # the first-byte timeout (1 s) ran out, then the ceiling (2 s)
    # The whole head and body are under the first-byte deadline, which each trickled byte
    # does not move (the trickle would take 10 s or more): that deadline ran out, and no
    # gap between bytes was treated as an idle stream's.
    after = timeouts_by_phase(gateway)
    assert after.get("first_byte", 0) > before.get("first_byte", 0)
    assert after.get("idle", 0) == before.get("idle", 0)


def test_stream_is_cut_at_the_ceiling_with_an_error_event(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/chat/completions", json=post("trickled-stream")) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_timeout"
    # Cut by the request's ceiling (2 s), not by an idle gap: an event comes every 0.25 s.
    assert error["message"].endswith("(total)"), error
    assert len(lines) > 3  # events flowed until the ceiling


def timeouts_by_phase(gateway: Gateway) -> dict[str, int]:
    """The timeouts /admin/state counts against the scripted instance, by phase."""
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    (instance,) = state["pools"]["edge"]["instances"]
    counts: dict[str, int] = {}
    for entry in instance["timeouts_by_phase"]:
        counts[entry["phase"]] = counts.get(entry["phase"], 0) + entry["count"]
    return counts


def test_compressed_stream_is_aborted_not_corrupted(client: httpx.Client) -> None:
    with (
        pytest.raises(httpx.HTTPError),
        client.stream("POST", "/v1/chat/completions", json=post("gzip-stream-cut")) as response,
    ):
        b"".join(response.iter_bytes())


def test_a_gzip_transfer_coding_is_relayed_as_the_content_coding(client: httpx.Client) -> None:
    request = {"model": "gzip-transfer-coded", "messages": []}
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        raw = b"".join(response.iter_raw())  # as sent: httpx would undo the gzip itself
    assert response.status_code == 200
    assert response.headers.get_list("content-encoding") == ["gzip"]
    # The gateway frames the body its own way; the backend's codings are not repeated.
    assert response.headers.get("transfer-encoding", "chunked") == "chunked"
    assert gzip.decompress(raw) == GZIPPED_ANSWER


def protocol_attempts(gateway: Gateway) -> float:
    text = httpx.get(f"{gateway.admin_url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("gateway_upstream_attempts_total{") and 'outcome="protocol"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("model", ["status-600", "too-many-fields"])
def test_a_malformed_answer_is_a_502_never_an_empty_reply(
    client: httpx.Client, gateway: Gateway, model: str
) -> None:
    before = protocol_attempts(gateway)
    response = client.post("/v1/chat/completions", json={"model": model, "messages": []})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_protocol_error"
    assert response.headers["x-gateway-error"] == "upstream_protocol_error"
    # Counted as what it was (not retried: the same bytes would come again).
    assert protocol_attempts(gateway) == before + 1


def test_only_the_first_of_two_answers_in_one_read_reaches_the_client(
    client: httpx.Client,
) -> None:
    response = client.post("/v1/chat/completions", json={"model": "two-answers", "messages": []})
    assert response.status_code == 200
    assert response.content == b'{"a":1}'
    assert "x-second" not in response.headers
    # The tainted connection was not pooled: the next request gets its own answer.
    again = client.post("/v1/chat/completions", json={"model": "no-content", "messages": []})
    assert again.status_code == 204


def test_trailers_never_reach_the_client(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={"model": "with-trailers", "messages": []})
    assert response.status_code == 200
    assert response.content == b'{"a":1}'
    assert "x-checksum" not in response.headers


def test_a_stream_with_cr_line_ends_cut_mid_event_ends_with_a_clean_error_event(
    client: httpx.Client,
) -> None:
    with client.stream("POST", "/v1/chat/completions", json=post("cr-partial-event")) as response:
        body = response.read()
    first, rest = body.split(b"\r\r", 1)
    assert first == b'data: {"n":1}'
    assert b"cho" not in rest  # the half event was held back, not sent before the error
    error = json.loads(rest.strip().split(b"\n\n")[0].removeprefix(b"data: "))
    assert error["error"]["code"] == "upstream_reset"
    assert rest.strip().endswith(b"data: [DONE]")


def test_an_event_that_never_ends_is_cut_with_an_error_event(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/chat/completions", json=post("endless-event")) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[0] == 'data: {"n":1}'
    error = json.loads(lines[1].removeprefix("data: "))
    assert error["error"]["code"] == "upstream_protocol_error"
    assert lines[2:] == ["data: [DONE]"]


def test_a_stream_ending_before_its_last_event_is_no_silent_truncation(
    client: httpx.Client,
) -> None:
    # Token-id prompts cannot be continued: the break ends the stream with an error event.
    body = {"model": "ends-without-done", "prompt": [1, 2], "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[0] == 'data: {"n":1}'
    assert json.loads(lines[1].removeprefix("data: "))["error"]["code"] == "upstream_stream_cut"
    assert lines[2:] == ["data: [DONE]"]


def test_a_last_event_without_its_blank_line_still_ends_the_stream(client: httpx.Client) -> None:
    body = {"model": "done-without-blank-line", "prompt": [1, 2], "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        raw = response.read()
    assert raw == b'data: {"n":1}\n\ndata: [DONE]\n'


def test_a_stream_broken_after_its_last_event_ends_as_it_was(client: httpx.Client) -> None:
    # The client has its whole answer: nothing may follow the protocol's last event.
    body = {"model": "responses-completed-then-cut", "input": "x", "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as response:
        raw = response.read()
    assert raw.endswith(b'"sequence_number": 1}\n\n') and b"event: error" not in raw
    # Token ids cannot be continued (the resume refuses): [DONE] stays the last event.
    done = {"model": "done-then-cut", "prompt": [1, 2], "stream": True}
    with client.stream("POST", "/v1/completions", json=done) as response:
        raw = response.read()
    assert raw == b'data: {"n":1}\n\ndata: [DONE]\n\n'


def test_a_broken_responses_stream_ends_with_an_error_event_after_the_last_one_sent(
    client: httpx.Client,
) -> None:
    body = {"model": "responses-cut", "input": "x", "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as response:
        blocks = response.read().decode().strip().split("\n\n")
    assert [b.split("\n")[0] for b in blocks] == [
        "event: response.created",
        "event: response.output_text.delta",
        "event: error",
    ]
    error = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    # Numbered after the last event the client got (the half one held back was never sent).
    assert error["sequence_number"] == 2 and error["code"] == "upstream_reset"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["json-cut", "json-empty", "html-page", "garbage-stream"])
def test_a_200_that_cannot_be_an_answer_is_a_protocol_failure_not_a_success(
    client: httpx.Client, gateway: Gateway, model: str, stream: bool
) -> None:
    # A JSON body cut short, an empty one, a proxy's HTML page, an event stream that does
    # not begin with an event: what the client would take for a success is the upstream's
    # failure, before the commit point (where a fallback could still answer).
    before = protocol_attempts(gateway)
    request = {"model": model, "messages": [], "stream": stream}
    response = client.post("/v1/chat/completions", json=request)
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "upstream_protocol_error"
    assert protocol_attempts(gateway) == before + 1


def test_a_well_formed_json_answer_with_whitespace_around_it_is_relayed(
    client: httpx.Client,
) -> None:
    response = client.post("/v1/chat/completions", json={"model": "json-padded", "messages": []})
    assert response.status_code == 200
    assert response.content == b'\n  {"a":1}\n'  # as it came


def test_a_stream_whose_first_event_drips_in_is_not_committed_to(
    client: httpx.Client, gateway: Gateway
) -> None:
    # Not a 200 cut at the ceiling: its first event never arrived within the first-byte
    # deadline, so nothing went to the client and the request could still go elsewhere.
    before = timeouts_by_phase(gateway)
    with client.stream("POST", "/v1/chat/completions", json=post("dripped-event")) as response:
        status = response.status_code
        body = json.loads(response.read())
    assert status == 504
    assert body["error"]["code"] == "upstream_timeout"
    assert timeouts_by_phase(gateway).get("first_byte", 0) > before.get("first_byte", 0)
