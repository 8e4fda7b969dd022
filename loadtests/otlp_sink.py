"""A standalone OTLP/HTTP trace receiver that counts what arrives, for the benchmarks.

    python -m loadtests.otlp_sink --port 0

Binds 127.0.0.1 (port 0: the kernel picks one) and prints `otlp-sink READY port=<port>` once
serving. It speaks the protobuf flavour of OTLP/HTTP:

- `POST /v1/traces` with `Content-Type: application/x-protobuf` (and optionally
  `Content-Encoding: gzip` or `deflate`): the body is decoded as an `ExportTraceServiceRequest`,
  its spans are counted (by kind too), and the answer is 200 with an empty
  `ExportTraceServiceResponse`. A body that does not decode gets 400, and is not counted.
- `GET /stats`: `{"requests": n, "spans": m, "spans_by_kind": {...}, "rejected": k}`, where
  `requests` counts the accepted exports.

Spans are counted, not kept, so memory stays flat however long the run. One asyncio event loop
(uvloop when available) serves every connection; nothing runs in a thread per request.
SIGTERM or SIGINT stops it with exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Sequence

from aiohttp import web
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

HOST = "127.0.0.1"
TRACES_PATH = "/v1/traces"
STATS_PATH = "/stats"
PROTOBUF = "application/x-protobuf"
MAX_BODY_BYTES = 64 * 1024 * 1024  # compressed and decompressed alike
_KIND_PREFIX = "SPAN_KIND_"


class BadExport(Exception):
    """Not a well-formed OTLP/HTTP protobuf trace export; `status` is the HTTP answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def decompress(body: bytes, encoding: str) -> bytes:
    """The body without its `Content-Encoding`, at most MAX_BODY_BYTES of it."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise BadExport(415, f"unsupported Content-Encoding {encoding!r}")
    inflater = zlib.decompressobj(wbits)
    try:
        raw = inflater.decompress(body, MAX_BODY_BYTES)
    except zlib.error as error:
        raise BadExport(400, f"cannot decode the {encoding} body: {error}") from error
    if inflater.unconsumed_tail:
        raise BadExport(413, "decoded body too large")
    if not inflater.eof:
        raise BadExport(400, f"truncated {encoding} body")
    return raw


def _kind_name(kind: int) -> str:
    try:
        return str(Span.SpanKind.Name(kind)).removeprefix(_KIND_PREFIX)
    except ValueError:
        return str(kind)


class SpanCounter:
    """The counts `/stats` reports."""

    def __init__(self) -> None:
        self.requests = 0
        self.spans = 0
        self.rejected = 0
        self.by_kind: Counter[str] = Counter()

    def accept(self, raw: bytes) -> None:
        """Count the spans of one decoded export body, or raise BadExport."""
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(raw)
        except DecodeError as error:
            raise BadExport(400, f"not an ExportTraceServiceRequest: {error}") from error
        kinds: Counter[int] = Counter()
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                kinds.update(span.kind for span in scope_spans.spans)
        self.requests += 1
        self.spans += sum(kinds.values())
        for kind, count in kinds.items():
            self.by_kind[_kind_name(kind)] += count

    def snapshot(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "spans": self.spans,
            "spans_by_kind": dict(sorted(self.by_kind.items())),
            "rejected": self.rejected,
        }


EMPTY_RESPONSE: bytes = ExportTraceServiceResponse().SerializeToString()


def build_app(counter: SpanCounter) -> web.Application:
    async def traces(request: web.Request) -> web.Response:
        try:
            media_type = request.content_type.lower()
            if media_type != PROTOBUF:
                raise BadExport(415, f"unsupported Content-Type {media_type!r}: use {PROTOBUF}")
            body = await request.read()
            counter.accept(decompress(body, request.headers.get("Content-Encoding", "")))
        except BadExport as error:
            counter.rejected += 1
            return web.Response(status=error.status, text=f"{error}\n")
        return web.Response(body=EMPTY_RESPONSE, content_type=PROTOBUF)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counter.snapshot())

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post(TRACES_PATH, traces)
    app.router.add_get(STATS_PATH, stats)
    return app


async def serve(port: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The body is decompressed here, under the size bound, not by the server beforehand.
    runner = web.AppRunner(build_app(SpanCounter()), access_log=None, auto_decompress=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, HOST, port, backlog=1024)
        await site.start()
        bound = runner.addresses[0][1]
        print(f"otlp-sink READY port={bound}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the gateway
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.otlp_sink",
        description="An OTLP/HTTP (protobuf) trace receiver on 127.0.0.1 that counts spans.",
    )
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error("--port must be within 0..65535")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
