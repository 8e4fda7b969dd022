"""The crash-test suite: backend faults, each behind a pool with a fallback, through the
official `openai` SDK.

    python -m loadtests.crash_suite [--slow-s 30 --hang-s 120 --drip-s 1 --rounds 2]

A faulty server (`loadtests.fault_server`, one per scenario: an instance is known by its URL)
plays each faulty instance, its fault picked by the model asked; a fake vLLM
(`loadtests.fake_vllm`) is the healthy fallback. The gateway
runs one policy: a pool per scenario, one instance each (the faulty server, or a refused port)
with `fallbacks: [healthy]`, defaults otherwise. Each scenario sends `--rounds` pairs of
requests (streamed, then whole) one after another, the scenarios side by side, and each
request is classified:

- `rescued`: a complete, well-formed answer (JSON that parses, with content and a finish; a
  stream of JSON events with content, a finish and `[DONE]`), from the primary or the fallback;
- `failed-cleanly`: a JSON error with an error status, or a stream that ended with an error
  event and its end;
- `failed-uncleanly`: an error the client cannot read as one (a dropped connection, an error
  status without a JSON error);
- `truncated`: a 200 whose body or stream is incomplete or malformed but looks like success;
- `hammered`: more than `HAMMER_LIMIT` attempts reached the faulty instance for one request,
  or it was still being asked after its requests ended;
- `hung`: no answer within `--cutoff` seconds.

A scenario's verdict is its worst request's. The table is printed and written with every
request's details as JSON under loadtests/out/.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2
import openai
from openai.types.chat import ChatCompletionMessageParam

from loadtests import fault_server as faults
from loadtests.fault_server import FaultServer, Timing
from loadtests.ports import hold_port
from loadtests.procs import ManagedProcess, gateway_process, python_module

OUT_DIR = Path(__file__).parent / "out"
HEALTHY_MODEL = "healthy-model"
# More attempts than this on the faulty instance for one request is hammering it.
HAMMER_LIMIT = 5
# Outcomes, best first: a scenario takes its worst request's.
OUTCOMES = ("rescued", "failed-cleanly", "failed-uncleanly", "truncated", "hammered", "hung")
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    script: faults.Script | None  # None: the instance's port refuses connections
    context_fallback: bool = False

    @property
    def model(self) -> str:
        return f"fault-{self.name}"


SCENARIOS = (
    Scenario("refused", "connection refused", None),
    Scenario("closed", "connection accepted, closed before any byte", faults.closed),
    Scenario("hang", "no byte at all", faults.hang),
    Scenario("slow-ttft", "first token after the slow time, then normal", faults.slow_first_token),
    Scenario("stall", "tokens, silence for the slow time, then the rest", faults.stall),
    Scenario("no-done", "stream cut cleanly before its end and [DONE]", faults.no_done),
    Scenario("reset", "TCP reset mid-stream", faults.reset),
    Scenario("500", "500", faults.status_500),
    Scenario("503-retry-after", "503 with Retry-After", faults.status_503_retry_after),
    Scenario("429-retry-after", "429 with Retry-After", faults.status_429_retry_after),
    Scenario("429", "429 without Retry-After", faults.status_429),
    Scenario("bad-json", "200 with a JSON body cut half-way", faults.malformed_json),
    Scenario("empty", "200 with an empty body", faults.empty_body),
    Scenario("html", "200 with an HTML error page (text/html)", faults.html_page),
    Scenario("bad-sse", "event stream of garbage lines and invalid JSON", faults.malformed_sse),
    Scenario("stream-error", "error event mid-stream (whole: 500)", faults.stream_error),
    Scenario("drip", "one byte per drip time", faults.drip),
    Scenario("context-400", "400 context length (context_fallbacks)", faults.context_length, True),
)


@dataclass
class Result:
    """One request's outcome."""

    scenario: str
    mode: str  # stream | whole
    outcome: str
    seconds: float
    status: int | None = None
    pool: str | None = None  # x-gateway-pool: the pool that answered
    hits: int = 0  # attempts that reached the faulty instance
    detail: str = ""


@dataclass
class Verdict:
    scenario: str
    what: str
    outcome: str
    results: list[Result] = field(default_factory=list)
    trailing_hits: int = 0


def policy(urls: dict[str, str], healthy_url: str, pool_extra: str = "") -> str:
    """The gateway's policy: the healthy pool and one pool per scenario, its instance at
    `urls[scenario.name]` (`pool_extra`: a YAML line added to each faulty pool, e.g.
    `timeouts: {initial: 2s}`)."""
    lines = [
        "listen: 127.0.0.1:0",
        "admin: {listen: 127.0.0.1:0}",
        "pools:",
        "  healthy:",
        f"    models: [{HEALTHY_MODEL}]",
        f'    instances: [{{name: healthy, url: "{healthy_url}"}}]',
    ]
    for scenario in SCENARIOS:
        url = urls[scenario.name]
        lines += [
            f"  {scenario.model}:",
            f"    models: [{scenario.model}]",
            f'    instances: [{{name: "{scenario.name}", url: "{url}"}}]',
            "    fallbacks: [healthy]",
        ]
        if scenario.context_fallback:
            lines.append("    context_fallbacks: [healthy]")
        if pool_extra:
            lines.append(f"    {pool_extra}")
    return "\n".join(lines) + "\n"


@dataclass
class Setup:
    gateway_url: str
    # Each scenario's faulty instance, a server of its own: an instance is known by its URL,
    # and one that several pools share would be isolated in all of them by any one's faults.
    faults: dict[str, FaultServer]


@contextmanager
def running(timing: Timing, pool_extra: str = "") -> Iterator[Setup]:
    """The faulty server, the healthy fake vLLM and the gateway; every one stopped when the
    block ends, however it ends."""
    with ExitStack() as stack:
        servers: dict[str, FaultServer] = {}
        urls: dict[str, str] = {}
        for scenario in SCENARIOS:
            if scenario.script is None:
                refused = stack.enter_context(hold_port())  # bound, never listening
                servers[scenario.name] = FaultServer({}, timing)  # counts nothing: never asked
                urls[scenario.name] = f"http://127.0.0.1:{refused.port}"
            else:
                servers[scenario.name] = FaultServer({scenario.model: scenario.script}, timing)
                urls[scenario.name] = servers[scenario.name].url
            stack.callback(servers[scenario.name].close)
        healthy = ManagedProcess(
            python_module(
                "loadtests.fake_vllm",
                *("--port", "0", "--name", "healthy", "--models", HEALTHY_MODEL),
                *("--ttft", "0.01", "--per-token", "0.001"),
            )
        )
        stack.callback(healthy.stop)
        healthy_url = f"http://127.0.0.1:{healthy.port()}"
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        policy_path = directory / "crash-suite.yaml"
        policy_path.write_text(policy(urls, healthy_url, pool_extra))
        gateway = gateway_process(policy_path)
        stack.callback(gateway.stop)
        yield Setup(f"http://{gateway.ready['data']}", servers)


def run(
    setup: Setup, rounds: int = 2, cutoff_s: float = 60.0, only: tuple[str, ...] = ()
) -> list[Verdict]:
    """Every scenario (or those named in `only`) side by side; their verdicts in order."""
    chosen = [s for s in SCENARIOS if not only or s.name in only]
    with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
        verdicts = list(pool.map(lambda s: _scenario(setup, s, rounds, cutoff_s), chosen))
    time.sleep(1.0)  # anything still sent to a faulty instance after its requests is hammering
    for verdict, scenario in zip(verdicts, chosen, strict=True):
        verdict.trailing_hits = _trailing(setup.faults[scenario.name], scenario)
        if verdict.trailing_hits and _rank(verdict.outcome) < _rank("hammered"):
            verdict.outcome = "hammered"
    return verdicts


# When each scenario's last request ended (time.monotonic()), for the trailing hits.
_ends: dict[str, float] = {}
_ends_lock = threading.Lock()


def _trailing(server: FaultServer, scenario: Scenario) -> int:
    """Attempts that reached the faulty instance more than half a second after the scenario's
    last request ended (a request cut at its end may still have one on the wire)."""
    with _ends_lock:
        end = _ends.get(scenario.name)
    if end is None:
        return 0
    return sum(1 for at in server.hits(scenario.model) if at > end + 0.5)


def _scenario(setup: Setup, scenario: Scenario, rounds: int, cutoff_s: float) -> Verdict:
    verdict = Verdict(scenario.name, scenario.what, "rescued")
    for _ in range(rounds):
        for mode in ("stream", "whole"):
            result = _one(setup, scenario, mode, cutoff_s)
            verdict.results.append(result)
            if _rank(result.outcome) > _rank(verdict.outcome):
                verdict.outcome = result.outcome
    with _ends_lock:
        _ends[scenario.name] = time.monotonic()
    return verdict


def _rank(outcome: str) -> int:
    return OUTCOMES.index(outcome)


def _one(setup: Setup, scenario: Scenario, mode: str, cutoff_s: float) -> Result:
    """One request, given `cutoff_s` in all: past it the client is closed (which ends a
    request still dripping in) and the request counts as hung."""
    sdk = openai.OpenAI(
        base_url=f"{setup.gateway_url}/v1",
        api_key="k",
        max_retries=0,  # whatever is retried or handed over is the gateway's doing
        timeout=httpx2.Timeout(cutoff_s + 5.0),
    )
    ask = _ask_stream if mode == "stream" else _ask_whole
    server = setup.faults[scenario.name]
    before = len(server.hits(scenario.model))
    box: list[Result] = []
    started = time.monotonic()
    worker = threading.Thread(
        target=lambda: box.append(_guarded(ask, sdk, scenario, started)), daemon=True
    )
    worker.start()
    worker.join(cutoff_s)
    if worker.is_alive():
        sdk.close()  # ends the request under way
        worker.join(10.0)
        result = Result(scenario.name, mode, "hung", time.monotonic() - started)
    else:
        sdk.close()
        result = box[0]
        result.mode = mode
    result.hits = len(server.hits(scenario.model)) - before
    if result.hits > HAMMER_LIMIT and _rank(result.outcome) < _rank("hammered"):
        result.outcome = "hammered"
    return result


Ask = Callable[[openai.OpenAI, Scenario, float], Result]


def _guarded(ask: Ask, sdk: openai.OpenAI, scenario: Scenario, started: float) -> Result:
    try:
        return ask(sdk, scenario, started)
    except openai.APIStatusError as error:
        result = _error_result(scenario, error.response, started)
        return result
    except (openai.APIError, httpx2.HTTPError) as error:
        seconds = time.monotonic() - started
        return Result(scenario.name, "", "failed-uncleanly", seconds, detail=repr(error)[:200])


def _error_result(scenario: Scenario, response: httpx2.Response, started: float) -> Result:
    """An error status: clean when its body is a JSON error."""
    seconds = time.monotonic() - started
    pool = response.headers.get("x-gateway-pool")
    try:
        body = json.loads(response.read())
        clean = isinstance(body, dict) and isinstance(body.get("error"), dict)
    except (ValueError, httpx2.HTTPError):
        clean = False
    outcome = "failed-cleanly" if clean else "failed-uncleanly"
    detail = response.headers.get("x-gateway-error", "") or "backend's error"
    return Result(scenario.name, "", outcome, seconds, response.status_code, pool, detail=detail)


def _ask_whole(sdk: openai.OpenAI, scenario: Scenario, started: float) -> Result:
    raw = sdk.chat.completions.with_raw_response.create(
        model=scenario.model, messages=MESSAGES, max_tokens=8
    )
    response = raw.http_response
    seconds = time.monotonic() - started
    pool = response.headers.get("x-gateway-pool")
    problem = _whole_problem(response)
    outcome = "rescued" if problem is None else "truncated"
    return Result(
        scenario.name, "whole", outcome, seconds, response.status_code, pool, detail=problem or ""
    )


def _whole_problem(response: httpx2.Response) -> str | None:
    """What is wrong with a 200 whole answer (None: nothing)."""
    if not response.headers.get("content-type", "").startswith("application/json"):
        return f"content-type {response.headers.get('content-type')!r}"
    try:
        answer = json.loads(response.content)
        choice = answer["choices"][0]
        content = choice["message"]["content"]
        finish = choice["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return f"not a chat completion: {error!r}"[:200]
    if not content or not finish:
        return f"content {content!r}, finish_reason {finish!r}"
    return None


def _ask_stream(sdk: openai.OpenAI, scenario: Scenario, started: float) -> Result:
    with sdk.chat.completions.with_streaming_response.create(
        model=scenario.model,
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
    ) as response:
        pool = response.headers.get("x-gateway-pool")
        status = response.status_code
        kind = response.headers.get("content-type", "")
        lines = list(response.iter_lines())
    seconds = time.monotonic() - started
    if not kind.startswith("text/event-stream"):
        detail = f"a 200 stream answered with content-type {kind!r}"
        return Result(scenario.name, "stream", "truncated", seconds, status, pool, detail=detail)
    outcome, detail = _read_stream(lines)
    return Result(scenario.name, "stream", outcome, seconds, status, pool, detail=detail)


def _read_stream(lines: list[str]) -> tuple[str, str]:
    """A 200 stream's outcome from its lines, and what was wrong with it."""
    content, finish, done, error = "", None, False, None
    for line in lines:
        if not line or line.startswith((":", "event:", "id:", "retry:")):
            continue
        if not line.startswith("data:"):
            return "truncated", f"not an SSE line: {line[:60]!r}"
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            return "truncated", f"invalid JSON in an event: {data[:60]!r}"
        if "error" in event:
            error = event["error"]
            continue
        for choice in event.get("choices") or ():
            content += (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else error
        return "failed-cleanly", f"error event: {message}"[:200]
    if not done or not content or not finish:
        return "truncated", f"[DONE] {done}, content {content!r}, finish {finish!r}"
    return "rescued", ""


def table(verdicts: list[Verdict]) -> str:
    rows = [
        "| scenario | fault | verdict | requests (mode: outcome, s, hits, pool) |",
        "|---|---|---|---|",
    ]
    for verdict in verdicts:
        cells = "; ".join(
            f"{r.mode}: {r.outcome} {r.seconds:.1f}s h{r.hits} {r.pool or '-'}"
            for r in verdict.results
        )
        trailing = f" (+{verdict.trailing_hits} after)" if verdict.trailing_hits else ""
        rows.append(
            f"| {verdict.scenario} | {verdict.what} | {verdict.outcome}{trailing} | {cells} |"
        )
    counts = {o: sum(1 for v in verdicts if v.outcome == o) for o in OUTCOMES}
    summary = ", ".join(f"{count} {outcome}" for outcome, count in counts.items() if count)
    return "\n".join(rows) + f"\n\n{len(verdicts)} scenarios: {summary}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow-s", type=float, default=30.0, help="slow first token, stall")
    parser.add_argument("--hang-s", type=float, default=120.0, help="how long a hang lasts")
    parser.add_argument("--drip-s", type=float, default=1.0, help="seconds between two bytes")
    parser.add_argument("--rounds", type=int, default=2, help="stream+whole pairs per scenario")
    parser.add_argument("--cutoff", type=float, default=60.0, help="a request is hung after it")
    parser.add_argument("--pool-extra", default="", help="YAML line added to each faulty pool")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    timing = Timing(args.slow_s, args.hang_s, args.drip_s)
    only = tuple(name for name in args.only.split(",") if name)
    with running(timing, args.pool_extra) as setup:
        verdicts = run(setup, args.rounds, args.cutoff, only)
    text = table(verdicts)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"crash-suite-{time.strftime('%Y%m%d-%H%M%S')}.json"
    payload = {
        "timing": asdict(timing),
        "rounds": args.rounds,
        "cutoff_s": args.cutoff,
        "verdicts": [asdict(v) for v in verdicts],
    }
    path.write_text(json.dumps(payload, indent=2))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
