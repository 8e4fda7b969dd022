"""The work per request, counted: the whole gateway in one process on wires in memory, each
scenario's requests profiled, the calls counted per call site.

What runs is what serves: the gateway built from a policy (`gateway.app.Gateway`, its pipeline,
breakers, admission, hedging and resume as configured by default), behind uvicorn's HTTP/1.1
server protocol set up as `gateway run` sets it up, in front of its own HTTP/1.1 client. Only the
sockets are replaced (`wire`), and the clock is virtual, so a run counts the same calls on any
machine, busy or idle. The count is Python's profiler's: the function calls (Python's and
built-in ones) made while a measured request is under way, from its first byte written by the
client until the gateway has finished with it (after-response work included), by the gateway,
uvicorn's protocol and the libraries they use. Calls the event loop's own machinery makes
(`_MACHINERY`: in production uvloop schedules in C) and the in-memory peers' (`peers`) are left
out.

Tracing on, spans go to a batch processor whose exporter never runs during the measurement
(its thread wakes on a timer or a full batch): the cost on the request path is counted, the
export's, in its own thread, is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import http.server
import os
import random
import re
import sys
import sysconfig
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType

from uvicorn.server import ServerState

from gateway.app import Gateway
from gateway.config import parse_policy
from gateway.server import _uvicorn_config
from loadtests.cost import peers
from loadtests.cost.peers import Answer, Backends, Client, Script, chat_request
from loadtests.cost.wire import WireLoop

ROOT = Path(__file__).resolve().parent.parent.parent
GATEWAY = ("127.0.0.1", 8080)
INSTANCES = {"a": ("127.0.0.2", 8000), "b": ("127.0.0.3", 8000)}
# Requests before the counting starts: the latency model past its `min_samples`, every cache
# and connection warm.
WARMUP = 30
MEASURED = 20
# Between two retried requests, ones that succeed at once: the instances' error rates stay
# below the breaker's (15 % over the window), so a retry always finds the other instance.
BETWEEN_RETRIES = 10


@dataclass(frozen=True)
class Scenario:
    name: str
    script: Script
    tracing: bool = False

    @property
    def stream(self) -> bool:
        return self.script.chunks > 0


def policy_text(tracing: bool) -> str:
    """The default policy for a pool of two instances, health checks off (they would go to
    the network; they run beside requests, not in them)."""
    listed = ", ".join(
        f"{{name: {name}, url: 'http://{h}:{p}'}}" for name, (h, p) in INSTANCES.items()
    )
    return (
        f"telemetry: {{tracing: {'true' if tracing else 'false'}}}\n"
        "pools:\n"
        "  chat:\n"
        f"    models: [{peers.MODEL}]\n"
        f"    instances: [{listed}]\n"
        "    health: {enabled: false}\n"
    )


# Spans batched and never exported while requests are counted: the exporter's thread wakes
# after the delay (ms) or for a full batch, neither of which comes in a run. At the end the
# gateway's close exports them to `_SpanSink`.
TRACING_ENVIRONMENT = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_BSP_SCHEDULE_DELAY": "3600000",
    "OTEL_BSP_MAX_QUEUE_SIZE": "8192",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8192",
    "OTEL_TRACES_SAMPLER": "parentbased_always_on",
}


class _SpanSink(http.server.BaseHTTPRequestHandler):
    """Takes an OTLP/HTTP export and answers it as a collector does (an empty response)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _span_sink() -> Iterator[str]:
    """A span sink on a loopback port, in a thread, for one run: its traces endpoint."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SpanSink)
    thread = threading.Thread(target=server.serve_forever, name="span-sink", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def function_name(key: tuple[str, int, str]) -> str:
    """A profiled function by where it lives, with no path of this machine, no address and no
    line number (an edit elsewhere in its file must not rename it):
    `gateway/ingress/relay.py:relay`, `uvicorn/protocols/http/httptools_impl.py:send`,
    `asyncio/tasks.py:sleep`, `<method 'append' of 'list' objects>`."""
    filename, _, name = key
    if filename == "~":
        return _ADDRESS.sub("", name)
    path = Path(filename)
    paths = sysconfig.get_paths()
    for base in (Path(paths["purelib"]), ROOT, Path(paths["stdlib"])):
        if path.is_relative_to(base):
            return f"{path.relative_to(base)}:{name}"
    return f"{path.name}:{name}"


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")

# Callers whose calls are not counted: the event loop's own machinery (production runs uvloop,
# where scheduling, timers and callbacks are C, not Python calls) and this harness (the wire,
# the virtual clock, the peers). What the gateway, uvicorn's protocol and the libraries they use
# call is counted, calls into the loop's API (`call_soon`, `time`, a transport's `write`)
# included.
_MACHINERY = (
    "asyncio/base_events.py:",
    "asyncio/events.py:",
    "asyncio/selector_events.py:",
    "selectors.py:",
    "<method 'run' of '_contextvars.Context' objects>",
    "<built-in method _heapq.",
    "loadtests/",
)
# Callees never counted: the peers' own code (the parsers call it back from C).
_PEERS = ("loadtests/cost/peers.py:", "loadtests/virtual_time.py:select")


def _name(code: CodeType | str) -> str:
    if isinstance(code, str):  # a built-in function
        return function_name(("~", 0, code))
    return function_name((code.co_filename, code.co_firstlineno, code.co_name))


def _counts(profile: cProfile.Profile) -> Counter[str]:
    """Calls per caller and callee (`caller -> callee`), of the counted callers only
    (`_MACHINERY`): a call added anywhere shows where it was added."""
    counts: Counter[str] = Counter()
    for entry in profile.getstats():
        caller = _name(entry.code)
        if caller.startswith(_MACHINERY):
            continue
        for call in entry.calls or ():
            callee = _name(call.code)
            if not callee.startswith(_PEERS):
                counts[f"{caller} -> {callee}"] += call.callcount
    return counts


async def _run(scenario: Scenario) -> tuple[int, Counter[str]]:
    """The scenario's measured requests: how many, and the calls they made per function."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, WireLoop)
    gateway = Gateway(parse_policy(policy_text(scenario.tracing)), rng=random.Random(7))
    backends = Backends(scenario.script)
    for address in INSTANCES.values():
        loop.listen(address, backends.protocol)
    # The data plane's connections as `gateway run` serves them: uvicorn's config, loaded,
    # and the data plane's own protocol class (`_uvicorn_config` hands it to uvicorn).
    config = _uvicorn_config(gateway.data_app)
    config.load()
    assert config.http_protocol_class is gateway.data_app.protocol
    server = ServerState()
    protocol = gateway.data_app.protocol
    loop.listen(GATEWAY, lambda: protocol(config=config, server_state=server, app_state={}))
    client = Client()
    loop.dial(GATEWAY, client)
    profile = cProfile.Profile()
    ids = iter(range(1, 1_000_000))

    async def request(measured: bool) -> Answer:
        # In a retry scenario the measured requests are the ones the backends refuse once.
        retry = measured and scenario.script.fail_first
        data = chat_request(scenario.stream, f"{'retry-' if retry else ''}{next(ids)}")
        if measured:
            gc.collect()
            profile.enable()
        answer = await client.send(data)
        # The gateway's work after the answer's last byte: its request task, to the end.
        tasks = set(server.tasks)
        if tasks:
            await asyncio.wait(tasks)
        await asyncio.sleep(0)
        if measured:
            profile.disable()
        _check(scenario, answer, measured)
        return answer

    try:
        for _ in range(WARMUP):
            await request(measured=False)
        for _ in range(MEASURED):
            if scenario.script.fail_first:
                for _ in range(BETWEEN_RETRIES):
                    await request(measured=False)
            await request(measured=True)
    finally:
        await gateway.close()
    return MEASURED, _counts(profile)


def _check(scenario: Scenario, answer: Answer, measured: bool) -> None:
    """Every counted request must have gone as the scenario says, or the count is of
    something else."""
    problems = []
    if answer.status != 200:
        problems.append(f"status {answer.status}: {answer.body[:300]!r}")
    if scenario.stream and not answer.body.endswith(b"data: [DONE]\n\n"):
        problems.append(f"the stream did not end with [DONE]: {answer.body[-200:]!r}")
    attempts = answer.headers.get("x-gateway-attempts")
    wanted = "2" if scenario.script.fail_first and measured else "1"
    if attempts != wanted:
        problems.append(f"{attempts} attempts, not {wanted}")
    if problems:
        raise AssertionError(f"{scenario.name}: " + "; ".join(problems))


def measure(scenario: Scenario) -> tuple[int, Counter[str]]:
    """Run one scenario on a fresh loop (tracing's variables set for it alone)."""
    saved = dict(os.environ)
    gc.disable()  # no collection inside a count: one before each measured request instead
    try:
        with contextlib.ExitStack() as stack:
            if scenario.tracing:
                os.environ.update(TRACING_ENVIRONMENT)
                os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = stack.enter_context(_span_sink())
            runner = stack.enter_context(asyncio.Runner(loop_factory=WireLoop))
            return runner.run(_run(scenario))
    finally:
        gc.enable()
        os.environ.clear()
        os.environ.update(saved)


# Each budget's scenario: a chat completion answered whole, or streamed (8 tokens: 10 events
# with the usage and [DONE]); traced; retried once (a 503 from one instance, then the other).
SCENARIOS = {
    "chat": Scenario("chat", Script()),
    "chat_traced": Scenario("chat_traced", Script(), tracing=True),
    "chat_retried": Scenario("chat_retried", Script(fail_first=True)),
    "stream": Scenario("stream", Script(chunks=8)),
    "stream_traced": Scenario("stream_traced", Script(chunks=8), tracing=True),
}
# Per relayed chunk: what a stream of 40 tokens costs beyond one of 8, per added token (one
# event, one chunk each way).
LONG_STREAM = Scenario("stream_long", Script(chunks=40))
PER_CHUNK = "stream_per_chunk"

Costs = dict[str, dict[str, float]]  # budget -> `caller -> callee` -> calls per request (chunk)


def costs(names: Iterable[str] | None = None) -> Costs:
    """Every budget's calls per function, per request (per chunk for `stream_per_chunk`);
    `names` picks some."""
    wanted = list(names) if names is not None else [*SCENARIOS, PER_CHUNK]
    found: dict[str, Counter[str]] = {}
    runs = {name: SCENARIOS[name] for name in wanted if name in SCENARIOS}
    if PER_CHUNK in wanted:
        runs |= {"stream": SCENARIOS["stream"], LONG_STREAM.name: LONG_STREAM}
    for name, scenario in runs.items():
        requests, counts = measure(scenario)
        found[name] = Counter({f: calls / requests for f, calls in counts.items()})
    if PER_CHUNK in wanted:
        added = LONG_STREAM.script.chunks - SCENARIOS["stream"].script.chunks
        long, short = found[LONG_STREAM.name], found["stream"]
        found[PER_CHUNK] = Counter(
            {f: (long[f] - short[f]) / added for f in long.keys() | short.keys()}
        )
    return {
        name: {f: round(c, 3) for f, c in sorted(found[name].items()) if round(c, 3)}
        for name in wanted
    }


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"
