"""Canaries for the private parts of libraries that the gateway relies on.

uvicorn and OpenTelemetry are capped in pyproject.toml below their next minor release because
the gateway uses their internals: uvicorn's HTTP protocol class, its per-connection and
per-server state and its signal handling; the OTLP/HTTP exporter's private state and helper
module, the SDK's span attributes and the API's attribute mapping. Each test here checks one
such internal against the installed release (it exists, with the parameters and behaviour used)
and its failure names the internal and the gateway code that depends on it. Before raising a
cap, install the new release and run this file.

The gateway modules that use these internals are imported inside the tests, so that a missing
internal fails the tests that name it rather than the collection of the whole file.

redis, prometheus_client, httptools, starlette, aiohttp, yarl, pydantic and PyYAML are used
through their public API only: no cap, no canary, except one httptools behaviour that
HardenedProtocol's refusals depend on (public, but easy to miss).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import http.server
import importlib
import inspect
import logging
import signal
import textwrap
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import ModuleType
from typing import Any

import httptools
import pytest
import uvicorn
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config.models import LimitsPolicy
from gateway.ingress.refusals import IngressRefusals

PROTOCOL = "gateway/ingress/protocol.py (HardenedProtocol)"
DRAIN = "gateway/ingress/uvicorn_server.py (GatewayServer's view of requests, for the drain)"
SERVER = "gateway/ingress/uvicorn_server.py (GatewayServer), gateway/server.py (_uvicorn_config)"
SERVING = "loadtests/serving.py (the fake vLLM's server, also in the image's `fake` stage)"
EXPORTER = "gateway/telemetry/otlp_encoder.py (FastOtlpSpanExporter.export)"
ENCODER = "gateway/telemetry/otlp_encoder.py (OtlpSpanEncoder._attributes, _span)"
TRACING = "gateway/telemetry/otlp_encoder.py (fast_exporter), used by tracing._exporter"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
_MISSING = object()


def broken(internal: str, where: str) -> str:
    return f"{internal}, which {where} relies on, is missing or has changed"


def module(name: str, where: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if name.startswith("gateway."):  # one of the library's own imports failed in it
            pytest.fail(f"{name} no longer imports, so {where} is broken: {exc}")
        pytest.fail(f"{broken(f'the module {name}', where)}: {exc}")


def attr(owner: object, name: str, where: str, label: str | None = None) -> Any:
    """`owner.name`, failing with the internal's name and its user when it is not there."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        what = label or f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        pytest.fail(broken(what, where))
    return value


def accepts(function: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether `function` can be called with these arguments (only the signature is checked)."""
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


async def wait_for(condition: Callable[[], bool], what: str, polls: int = 3000) -> None:
    """Until `condition` holds, looking every 10 ms; a bounded number of looks only keeps a
    broken internal from hanging the test (how fast it holds is not what is checked)."""
    for _ in range(polls):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} never happened")


# --- uvicorn: the HTTP protocol (gateway/ingress/protocol.py) ---------------------------------


def httptools_impl() -> ModuleType:
    return module("uvicorn.protocols.http.httptools_impl", PROTOCOL)


def protocol_class() -> type[asyncio.Protocol]:
    cls = attr(httptools_impl(), "HttpToolsProtocol", PROTOCOL)
    assert inspect.isclass(cls) and issubclass(cls, asyncio.Protocol), broken(
        "uvicorn's HttpToolsProtocol as an asyncio.Protocol class", PROTOCOL
    )
    return cls


def server_state_class() -> type:
    return attr(module("uvicorn.server", DRAIN), "ServerState", DRAIN)  # type: ignore[no-any-return]


# Methods HardenedProtocol overrides or calls, and the arguments it (or uvicorn) passes them.
PROTOCOL_METHODS: dict[str, tuple[object, ...]] = {
    "connection_made": (object(),),
    "connection_lost": (None,),
    "data_received": (b"",),
    "on_headers_complete": (),
    "on_message_complete": (),
    "_unset_keepalive_if_required": (),
    "_should_upgrade": (),
    "handle_websocket_upgrade": (),
    "_unsupported_upgrade_warning": (),
    "send_400_response": ("message",),
}


def test_the_status_lines_the_refusals_are_built_from() -> None:
    status_line = attr(httptools_impl(), "STATUS_LINE", PROTOCOL)
    for status in (400, 408, 414, 431, 503):
        line = status_line.get(status)
        assert isinstance(line, bytes), broken(f"httptools_impl.STATUS_LINE[{status}]", PROTOCOL)
        assert line.startswith(b"HTTP/1.1 %d " % status) and line.endswith(b"\r\n"), broken(
            f"httptools_impl.STATUS_LINE[{status}] (a whole status line)", PROTOCOL
        )


@pytest.mark.parametrize("name", sorted(PROTOCOL_METHODS))
def test_the_protocol_methods_hardened_protocol_overrides_or_calls(name: str) -> None:
    method = attr(protocol_class(), name, PROTOCOL)
    # Plain functions: HardenedProtocol calls on_headers_complete and on_message_complete
    # through the class (`HttpToolsProtocol.on_headers_complete(self)`), the others via self.
    assert inspect.isfunction(method), broken(f"HttpToolsProtocol.{name} (a method)", PROTOCOL)
    args = PROTOCOL_METHODS[name]
    assert accepts(method, object(), *args), broken(
        f"HttpToolsProtocol.{name}{inspect.signature(method)} taking {len(args)} argument(s)",
        PROTOCOL,
    )


def test_the_protocol_is_subclassed_and_built_as_the_gateway_does() -> None:
    base = protocol_class()
    # uvicorn builds each connection's protocol with these keywords; HardenedProtocol.__init__
    # passes them on.
    assert accepts(
        base.__init__, object(), config=object(), server_state=object(), app_state={}, _loop=None
    ), broken("HttpToolsProtocol(config=, server_state=, app_state=, _loop=)", PROTOCOL)
    # HardenedProtocol.configured: a subclass made with type(), limits as class attributes.
    subclass = type("Configured", (base,), {"max_connections": 1})
    assert issubclass(subclass, base) and subclass.max_connections == 1  # type: ignore[attr-defined]
    hardened = module("gateway.ingress.protocol", PROTOCOL)
    assert issubclass(hardened.HardenedProtocol, base)


def calls_and_catches(function: Callable[..., Any]) -> tuple[set[str], set[str]]:
    """The method names `function` calls (`x.name(...)`) and the exception names it catches."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    caught = {
        node.type.attr if isinstance(node.type, ast.Attribute) else ast.unparse(node.type)
        for node in ast.walk(tree)
        if isinstance(node, ast.ExceptHandler) and node.type is not None
    }
    return calls, caught


def test_hardened_protocols_data_received_still_covers_uvicorns() -> None:
    # HardenedProtocol.data_received replaces uvicorn's instead of calling it (it measures the
    # head around the parser): whatever uvicorn's does, it must do too.
    theirs = attr(protocol_class(), "data_received", PROTOCOL)
    ours = module("gateway.ingress.protocol", PROTOCOL).HardenedProtocol.data_received
    their_calls, their_catches = calls_and_catches(theirs)
    our_calls, our_catches = calls_and_catches(ours)
    assert their_calls <= our_calls, (
        f"uvicorn's HttpToolsProtocol.data_received now calls {sorted(their_calls - our_calls)}:"
        f" {PROTOCOL} replaces that method, and its data_received does not"
    )
    assert their_catches <= our_catches, (
        f"uvicorn's HttpToolsProtocol.data_received now catches "
        f"{sorted(their_catches - our_catches)}: {PROTOCOL} replaces that method, and its "
        "data_received does not"
    )


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        extra = {"peername": ("192.0.2.7", 50000), "sockname": ("127.0.0.1", 8080)}
        return extra.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def never_answers(scope: Scope, receive: Receive, send: Send) -> None:
    await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def connection(
    protocol: type[asyncio.Protocol] | None = None,
) -> AsyncIterator[tuple[Any, FakeTransport, Any]]:
    """A protocol (uvicorn's, unless given) built as uvicorn builds one, on a fake transport;
    its app never answers."""
    base = protocol or protocol_class()
    config = uvicorn.Config(never_answers, http=base, ws="none", lifespan="off", log_config=None)
    config.load()
    state = server_state_class()()
    loop = asyncio.get_running_loop()
    protocol: Any = base(config=config, server_state=state, app_state={}, _loop=loop)  # type: ignore[call-arg]
    transport = FakeTransport()
    protocol.connection_made(transport)
    try:
        yield protocol, transport, state
    finally:
        for task in list(state.tasks):
            task.cancel()
        await asyncio.gather(*state.tasks, return_exceptions=True)


async def test_the_connection_state_hardened_protocol_reads() -> None:
    async with connection() as (protocol, transport, state):
        connections = attr(protocol, "connections", PROTOCOL, "HttpToolsProtocol.connections")
        assert connections is state.connections and protocol in connections, broken(
            "HttpToolsProtocol.connections (the server's set, the connection in it)", PROTOCOL
        )
        assert attr(protocol, "transport", PROTOCOL) is transport
        assert attr(protocol, "loop", PROTOCOL) is asyncio.get_running_loop()
        assert attr(protocol, "client", PROTOCOL) == ("192.0.2.7", 50000), broken(
            "HttpToolsProtocol.client (host, port)", PROTOCOL
        )
        assert isinstance(attr(protocol, "logger", PROTOCOL), logging.Logger)
        assert attr(protocol, "cycle", PROTOCOL) is None
        assert len(attr(protocol, "pipeline", PROTOCOL)) == 0
        flow = attr(protocol, "flow", PROTOCOL)
        assert attr(flow, "read_paused", PROTOCOL, "HttpToolsProtocol.flow.read_paused") is False
        parser = attr(protocol, "parser", PROTOCOL)
        assert callable(attr(parser, "feed_data", PROTOCOL, "HttpToolsProtocol.parser.feed_data"))

        # Part of a head: what came so far is readable before it is complete.
        protocol.data_received(b"POST /v1/x?q=1 HTTP/1.1\r\nHost: a\r\nX-Long: bb\r\nContent-")
        assert attr(protocol, "url", PROTOCOL) == b"/v1/x?q=1", broken(
            "HttpToolsProtocol.url (the raw request target, as it comes)", PROTOCOL
        )
        assert attr(protocol, "headers", PROTOCOL) == [(b"host", b"a"), (b"x-long", b"bb")], broken(
            "HttpToolsProtocol.headers (a list of (name, value) bytes pairs)", PROTOCOL
        )
        assert protocol.cycle is None

        protocol.data_received(b"Length: 5\r\n\r\nab")
        cycle = protocol.cycle
        assert isinstance(cycle, attr(httptools_impl(), "RequestResponseCycle", PROTOCOL)), broken(
            "HttpToolsProtocol.cycle (set once the head is complete)", PROTOCOL
        )
        for flag in ("response_started", "response_complete", "disconnected"):
            assert attr(cycle, flag, PROTOCOL, f"RequestResponseCycle.{flag}") is False
        assert isinstance(attr(cycle, "message_event", PROTOCOL), asyncio.Event), broken(
            "RequestResponseCycle.message_event (an asyncio.Event)", PROTOCOL
        )
        assert attr(cycle, "scope", DRAIN)["path"] == "/v1/x", broken(
            "RequestResponseCycle.scope['path']", DRAIN
        )
        assert len(state.tasks) == 1, broken(
            "ServerState.tasks (one task per request being served)", DRAIN
        )

        # A pipelined request behind a response still running waits in `pipeline`, reading
        # paused: HardenedProtocol stops a body deadline while uvicorn holds the body back.
        protocol.data_received(b"cde" + b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n")
        assert len(protocol.pipeline) == 1 and flow.read_paused, broken(
            "HttpToolsProtocol.pipeline / flow.read_paused for a pipelined request", PROTOCOL
        )


async def test_a_cycle_told_it_is_disconnected_gives_the_app_a_disconnect() -> None:
    # HardenedProtocol._close sets `disconnected` and the event so that the app stops.
    async with connection() as (protocol, _, _):
        protocol.data_received(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\n")
        cycle = protocol.cycle
        cycle.disconnected = True
        cycle.message_event.set()
        message = await asyncio.wait_for(cycle.receive(), 1)
        assert message == {"type": "http.disconnect"}, broken(
            "RequestResponseCycle.disconnected + message_event.set() -> http.disconnect", PROTOCOL
        )


async def test_a_cycle_answers_through_send_and_counts_the_request() -> None:
    # The drain answers a request still without a response with two `cycle.send` calls, and
    # counts the requests answered meanwhile from ServerState.total_requests.
    async with connection() as (protocol, transport, state):
        protocol.data_received(b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n")
        cycle = protocol.cycle
        send = attr(cycle, "send", DRAIN, "RequestResponseCycle.send")
        assert inspect.iscoroutinefunction(send), broken(
            "RequestResponseCycle.send (a coroutine function)", DRAIN
        )
        headers = [(b"content-length", b"2"), (b"retry-after", b"1")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        assert cycle.response_started and not cycle.response_complete, broken(
            "RequestResponseCycle.response_started after http.response.start", DRAIN
        )
        await send({"type": "http.response.body", "body": b"{}"})
        assert cycle.response_complete, broken(
            "RequestResponseCycle.response_complete after the last body", DRAIN
        )
        assert bytes(transport.written).startswith(b"HTTP/1.1 503 "), bytes(transport.written)
        assert attr(state, "total_requests", DRAIN, "ServerState.total_requests") == 1, broken(
            "ServerState.total_requests (counted when a response completes)", DRAIN
        )


WRITER = "gateway/ingress/writer.py (ChunkedWriter, client_writer)"


async def test_a_response_without_a_length_is_chunked_and_takes_pieces_written_between() -> None:
    """The relay writes a stream's pieces to the client's transport itself, framed as HTTP/1.1
    chunks, between uvicorn's head and its last chunk: uvicorn must frame a response with no
    Content-Length that way, and keep nothing of its own between two `send` calls."""
    async with connection() as (protocol, transport, _):
        protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n\r\n")
        send = protocol.cycle.send
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        transport.write(b"%x\r\n%b\r\n" % (9, b"data: 2\n\n"))  # what ChunkedWriter writes
        await send({"type": "http.response.body", "body": b"data: 3\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        head, _, body = bytes(transport.written).partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower(), broken(
            "uvicorn's framing of a response with no Content-Length (chunked)", WRITER
        )
        chunks = b"".join(b"9\r\ndata: %d\n\n\r\n" % n for n in (1, 2, 3)) + b"0\r\n\r\n"
        assert body == chunks, broken(
            "RequestResponseCycle.send writing each body at once, in order", WRITER
        )


async def test_the_hardened_protocol_hands_the_app_its_transport() -> None:
    """`HardenedProtocol` puts the client's transport in each request's scope, where
    `client_writer` finds it: the scope uvicorn builds must reach the app as the protocol left
    it once the head is complete."""
    hardened = module("gateway.ingress.protocol", PROTOCOL)
    writer = module("gateway.ingress.writer", WRITER)
    limits = hardened.ConnectionLimits(LimitsPolicy())
    configured = hardened.HardenedProtocol.configured(limits, IngressRefusals())
    async with connection(configured) as (protocol, transport, _):
        protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n\r\n")
        scope = attr(protocol.cycle, "scope", WRITER)
        made = writer.client_writer(scope)
        assert made is not None, broken("the request's scope as the protocol left it", WRITER)
        made.write(b"data: 1\n\n")
        made.flush()
        assert bytes(transport.written) == b"9\r\ndata: 1\n\n\r\n"
        assert writer.client_writer({**scope, "extensions": {}}) is None  # another server


# --- uvicorn: the server (gateway/ingress/uvicorn_server.py, loadtests/serving.py) ------------


def test_the_server_state_and_flags_the_drain_uses() -> None:
    server = uvicorn.Server(uvicorn.Config(never_answers, lifespan="off", log_config=None))
    state = attr(server, "server_state", DRAIN, "Server.server_state")
    assert isinstance(state, server_state_class())
    for name in ("connections", "tasks"):
        value = attr(state, name, DRAIN, f"ServerState.{name}")
        assert isinstance(value, set), broken(f"ServerState.{name} (a set)", DRAIN)
    assert attr(state, "total_requests", DRAIN, "ServerState.total_requests") == 0
    for flag in ("should_exit", "force_exit", "started"):
        value = attr(server, flag, f"{SERVER} and {DRAIN}", f"Server.{flag}")
        assert value is False, broken(f"Server.{flag} (False at first)", f"{SERVER} and {DRAIN}")
    assert accepts(server.serve, sockets=[]), broken("Server.serve(sockets=...)", SERVER)
    assert accepts(server.startup, []), broken("Server.startup(sockets)", SERVING)
    assert accepts(server.run, sockets=[]), broken("Server.run(sockets=...)", SERVING)


def test_uvicorn_config_takes_the_settings_the_gateway_and_the_rig_pass() -> None:
    used = {
        SERVER: [
            "http",
            "ws",
            "lifespan",
            "server_header",
            "date_header",
            "access_log",
            "proxy_headers",
            "log_config",
            "timeout_keep_alive",
            "backlog",
        ],
        SERVING: ["http", "loop", "log_level", "timeout_graceful_shutdown"],
    }
    parameters = inspect.signature(uvicorn.Config.__init__).parameters
    for where, names in used.items():
        missing = [name for name in names if name not in parameters]
        assert not missing, broken(f"uvicorn.Config({', '.join(missing)}=...)", where)
    # A protocol class as `http`: uvicorn builds the server's connections with it.
    server = module("gateway.server", SERVER)
    hardened = module("gateway.ingress.protocol", PROTOCOL).HardenedProtocol
    config = server._uvicorn_config(never_answers)
    config.load()
    assert issubclass(attr(config, "http_protocol_class", SERVER), hardened), broken(
        "uvicorn.Config(http=<protocol class>) -> Config.http_protocol_class", SERVER
    )
    assert config.ws_protocol_class is None, broken("uvicorn.Config(ws='none')", SERVER)


async def test_uvicorn_installs_its_signal_handlers_in_capture_signals() -> None:
    # GatewayServer overrides capture_signals so that uvicorn leaves SIGTERM and SIGINT to the
    # gateway (the drain): that works only while uvicorn installs them there.
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM)
    server = uvicorn.Server(uvicorn.Config(never_answers, lifespan="off", log_config=None))
    assert inspect.isfunction(attr(uvicorn.Server, "capture_signals", SERVER))
    bind_listener = module("gateway.server", SERVER).bind_listener
    with bind_listener("127.0.0.1", 0) as sock:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            await wait_for(lambda: server.started or task.done(), "uvicorn to start")
            assert signal.getsignal(signal.SIGTERM) == server.handle_exit, broken(
                "Server.capture_signals (where uvicorn installs its SIGTERM handler)", SERVER
            )
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 5)
    assert signal.getsignal(signal.SIGTERM) == before


async def http_get(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def test_a_running_server_exposes_what_the_drain_reads_and_stops_as_it_expects() -> None:
    gates = {"/a": asyncio.Event(), "/b": asyncio.Event()}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await gates[scope["path"]].wait()
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    gateway_server = module("gateway.server", SERVER)
    server_class = module("gateway.ingress.uvicorn_server", SERVER).GatewayServer
    hardened = module("gateway.ingress.protocol", PROTOCOL).HardenedProtocol
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    # The gateway's own server class and settings.
    server = server_class(gateway_server._uvicorn_config(app))
    state = server.server_state
    writers: list[asyncio.StreamWriter] = []
    with gateway_server.bind_listener("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            await wait_for(lambda: server.started or serving.done(), "the server to start")
            assert server.started, serving
            assert {sig: signal.getsignal(sig) for sig in handlers} == handlers, broken(
                "Server.capture_signals (overridden to keep uvicorn off the signals)", SERVER
            )

            reader_a, writer_a = await http_get(port, "/a")
            writers.append(writer_a)
            await wait_for(lambda: len(state.tasks) == 1, "the request's task")
            (conn,) = state.connections
            assert isinstance(conn, hardened), broken(
                "ServerState.connections (the connections' protocol instances)", DRAIN
            )
            cycle = attr(conn, "cycle", DRAIN, "<connection>.cycle")
            assert cycle is not None and cycle.scope["path"] == "/a"
            assert not cycle.response_started and not cycle.response_complete, broken(
                "<connection>.cycle.response_started / response_complete", DRAIN
            )
            gates["/a"].set()
            head = await asyncio.wait_for(reader_a.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 ")
            assert await asyncio.wait_for(reader_a.readexactly(2), 5) == b"ok"
            await wait_for(lambda: state.total_requests == 1, "the request to be counted")
            assert cycle.response_complete

            # A request in flight: should_exit closes the listener and the idle connection,
            # and waits for the busy one ...
            _, writer_b = await http_get(port, "/b")
            writers.append(writer_b)
            await wait_for(lambda: len(state.tasks) == 1, "the second request's task")
            server.should_exit = True
            assert await asyncio.wait_for(reader_a.read(), 5) == b"", broken(
                "Server.should_exit (closes idle keep-alive connections)", DRAIN
            )
            await asyncio.sleep(0.3)
            assert not serving.done(), broken(
                "Server.should_exit (waits for the requests in flight)", DRAIN
            )
            # ... until force_exit ends the wait; the drain cancels what is left.
            server.force_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(serving), 5)
            except TimeoutError:
                pytest.fail(broken("Server.force_exit (stops waiting for requests)", DRAIN))
            assert len(state.tasks) == 1, broken("ServerState.tasks after force_exit", DRAIN)
            # The gateway's acceptors stand in uvicorn's `servers`: its shutdown closes them.
            acceptors = attr(server, "servers", SERVER, "Server.servers")
            assert [type(a).__name__ for a in acceptors] == ["BatchAcceptor"]
            assert acceptors[0].closed, broken("Server.shutdown (closes Server.servers)", SERVER)
        finally:
            server.should_exit = server.force_exit = True
            for task in list(state.tasks):
                task.cancel("the test is over")
            await asyncio.gather(serving, *state.tasks, return_exceptions=True)
            for writer in writers:
                writer.close()


# --- httptools (gateway/ingress/protocol.py) ---------------------------------------------------


def test_an_exception_in_a_parser_callback_surfaces_as_a_parser_error() -> None:
    # HardenedProtocol refuses a request by raising from on_headers_complete; data_received
    # then sees httptools.HttpParserError and stops parsing that connection.
    class Refused(Exception):
        pass

    class Callbacks:
        def on_headers_complete(self) -> None:
            raise Refused

    parser = httptools.HttpRequestParser(Callbacks())
    with pytest.raises(httptools.HttpParserError) as raised:
        parser.feed_data(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    assert isinstance(raised.value, httptools.HttpParserCallbackError), broken(
        "httptools.HttpParserCallbackError for an exception raised in a callback", PROTOCOL
    )
    assert isinstance(raised.value.__context__, Refused)


# --- OpenTelemetry (gateway/telemetry/otlp_encoder.py, gateway/telemetry/tracing.py) ---------


def trace_exporter() -> ModuleType:
    return module("opentelemetry.exporter.otlp.proto.http.trace_exporter", EXPORTER)


def test_the_gateway_uses_its_fast_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    # tracing._exporter falls back to the stock exporter, silently, when the internals below
    # are gone (about five times the CPU per span): it must not on this release.
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    exporter = module("gateway.telemetry.tracing", TRACING)._exporter("otlp")
    try:
        fast = module("gateway.telemetry.otlp_encoder", EXPORTER).FastOtlpSpanExporter
        assert isinstance(exporter, fast), broken(
            "the OTLP/HTTP exporter's private state (_client, _metrics, _max_request_size)",
            TRACING,
        )
    finally:
        exporter.shutdown()


def test_the_exporters_private_helper_module() -> None:
    common = module("opentelemetry.exporter.otlp.proto.http._common", EXPORTER)
    error = attr(common, "RequestPayloadTooLargeError", EXPORTER)
    assert issubclass(error, Exception)
    too_large = attr(common, "_is_request_too_large", EXPORTER)
    assert accepts(too_large, b"", 1), broken(
        "_common._is_request_too_large(serialized_data, max_request_size)", EXPORTER
    )
    assert too_large(b"12", 1) is True and too_large(b"1", 1) is False, broken(
        "_common._is_request_too_large (True above the limit)", EXPORTER
    )
    assert too_large(b"123", 0) is False, broken(
        "_common._is_request_too_large (a limit of 0 turns it off)", EXPORTER
    )


@pytest.mark.parametrize("internal_metrics", ["", "true"])
def test_the_exporters_private_state(
    monkeypatch: pytest.MonkeyPatch, internal_metrics: str
) -> None:
    # The exporter's metrics of itself are a no-op or real ones, by this variable.
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", internal_metrics)
    cls = attr(trace_exporter(), "OTLPSpanExporter", EXPORTER)
    exporter = cls(endpoint="http://127.0.0.1:9/v1/traces")
    assert accepts(cls.export, exporter, []), broken(
        "OTLPSpanExporter.export(spans) (overridden)", EXPORTER
    )
    assert attr(exporter, "_shutdown", EXPORTER) is False
    assert isinstance(attr(exporter, "_max_request_size", EXPORTER), int), broken(
        "OTLPSpanExporter._max_request_size (an int)", EXPORTER
    )
    metrics = attr(exporter, "_metrics", EXPORTER)
    export_operation = attr(metrics, "export_operation", EXPORTER, "_metrics.export_operation")
    with export_operation(3) as result:
        for name in ("error", "error_attrs"):
            attr(result, name, EXPORTER, f"_metrics.export_operation(n) -> result.{name}")
        result.error = RuntimeError("a failed batch")
        result.error_attrs = {"http.response.status_code": 400}
    client = attr(exporter, "_client", EXPORTER)
    assert accepts(attr(client, "export", EXPORTER, "_client.export"), b""), broken(
        "OTLPSpanExporter._client.export(body)", EXPORTER
    )
    exporter.shutdown()
    assert exporter._shutdown is True, broken(
        "OTLPSpanExporter._shutdown (True after shutdown())", EXPORTER
    )


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint answering 200 on /ok and 400 (not retried) elsewhere."""

    bodies: list[bytes] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        Collector.bodies.append(self.rfile.read(length))
        self.send_response(200 if self.path == "/ok" else 400)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_exporters_client_sends_the_bytes_and_reports_the_outcome(collector: str) -> None:
    cls = attr(trace_exporter(), "OTLPSpanExporter", EXPORTER)
    Collector.bodies.clear()
    exporter = cls(endpoint=f"{collector}/ok", timeout=5)
    try:
        sent = attr(exporter, "_client", EXPORTER).export(b"\x0a\x00")
        assert attr(sent, "success", EXPORTER, "_client.export(...).success") is True
        assert Collector.bodies == [b"\x0a\x00"], broken(
            "OTLPSpanExporter._client.export (posts the bytes as given)", EXPORTER
        )
    finally:
        exporter.shutdown()
    exporter = cls(endpoint=f"{collector}/refused", timeout=5)
    try:
        sent = exporter._client.export(b"")
        assert sent.success is False
        assert attr(sent, "status_code", EXPORTER, "_client.export(...).status_code") == 400
        attr(sent, "error", EXPORTER, "_client.export(...).error")
    finally:
        exporter.shutdown()


def test_bounded_attributes_wrap_a_plain_dict() -> None:
    attributes = BoundedAttributes(attributes={"a": 1, "b": "x"})
    inner = attr(attributes, "_dict", ENCODER, "opentelemetry.attributes.BoundedAttributes._dict")
    assert type(inner) is dict and list(inner.items()) == [("a", 1), ("b", "x")], broken(
        "BoundedAttributes._dict (a dict of the attributes, in order)", ENCODER
    )
    # Checked once at import: without it the encoder takes its slower path.
    encoder = module("gateway.telemetry.otlp_encoder", ENCODER)
    assert encoder._BOUNDED_ATTRIBUTES_HAVE_DICT is True, broken("BoundedAttributes._dict", ENCODER)


def test_finished_sdk_spans_keep_their_attributes_in_a_private_field() -> None:
    # What a span processor, and so the exporter, gets when a span ends.
    finished = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(finished))
    span = provider.get_tracer("canary").start_span("s", attributes={"k": "v"})
    span.set_attribute("n", 1)
    span.end()
    provider.shutdown()
    (exported,) = finished.get_finished_spans()
    # The encoder reads `_attributes` of exactly these types (their `attributes` property wraps
    # it in a read-only view, slower to iterate).
    encoder = module("gateway.telemetry.otlp_encoder", ENCODER)
    assert type(exported) in encoder._SDK_SPAN_TYPES, broken(
        f"the type of a finished SDK span ({type(exported).__qualname__}; the encoder expects "
        "ReadableSpan or Span of opentelemetry.sdk.trace)",
        ENCODER,
    )
    private = attr(
        exported, "_attributes", ENCODER, "opentelemetry.sdk.trace.ReadableSpan._attributes"
    )
    assert isinstance(private, BoundedAttributes), broken(
        "opentelemetry.sdk.trace.ReadableSpan._attributes (a BoundedAttributes)", ENCODER
    )
    assert dict(private) == dict(exported.attributes or {}) == {"k": "v", "n": 1}, broken(
        "opentelemetry.sdk.trace.ReadableSpan._attributes (the span's attributes)", ENCODER
    )
    readable = ReadableSpan(name="r", attributes={"a": 1})
    assert dict(readable._attributes or {}) == dict(readable.attributes or {}) == {"a": 1}, broken(
        "opentelemetry.sdk.trace.ReadableSpan._attributes", ENCODER
    )
