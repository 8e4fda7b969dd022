"""Send one planned request and describe, in a ledger `Record`, what the client saw.

One shared aiohttp session: no connection limit (a pool limit would queue requests inside the
client and turn an open loop back into a closed one), no automatic decompression, no proxy
settings from the environment. Bodies are read as they arrive: streams through an incremental
SSE scanner, plain responses kept (bounded) to check their JSON.

Anthropic Messages requests (kind "messages") carry `anthropic-version`; their streams are read
by the Anthropic scanner (proper: ends with `message_stop`, no `event: error`) and a plain answer
is proper when it is a `{"type": "message", ...}` object.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache

import aiohttp
from yarl import URL

from loadtests.ledger import Record
from loadtests.loadgen.sse import AnthropicSseScanner, SseScanner
from loadtests.loadgen.workload import PRIORITIES, RequestPlan

DEFAULT_TIMEOUT_S = 300.0
MAX_KEPT_BODY = 4 << 20  # a plain body is kept up to this size to parse it; longer is not proper
ERROR_TEXT_MAX = 200
SHED_CODE = "shed"  # the error code of the gateway's admission 429 (gateway/errors.py, Shed)
# The gateway marks its own error answers with their code, on every route (an Anthropic-shaped
# body has no code): that is what tells its shed from a backend's own 429.
ERROR_HEADER = "x-gateway-error"

# The constant headers, one dict per priority class, built once: a request copies its class's
# dict and adds its sequence number.
_JSON = {"Content-Type": "application/json"}
_HEADERS: dict[str | None, dict[str, str]] = {
    None: _JSON,
    **{name: {**_JSON, "x-gateway-priority": name} for name in PRIORITIES},
}
ANTHROPIC_VERSION = "2023-06-01"
_ANTHROPIC_HEADERS: dict[str | None, dict[str, str]] = {
    key: {**value, "anthropic-version": ANTHROPIC_VERSION} for key, value in _HEADERS.items()
}


@dataclass(frozen=True)
class Target:
    """Where requests go. `gateway`: instance and attempts come from the gateway's headers;
    otherwise (direct) the instance is this target's name."""

    name: str
    base_url: str
    gateway: bool = False
    api_key: str | None = None  # sent as `Authorization: Bearer` (a gateway's tenant)


def new_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=DEFAULT_TIMEOUT_S),
    )


def timeout_of(total_s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total_s)


@lru_cache(maxsize=256)
def _url(base_url: str, path: str) -> URL:
    # Parsed once per (target, path), not per request.
    return URL(base_url.rstrip("/") + path)


def new_record(plan: RequestPlan, target: Target, t: float, lag: float) -> Record:
    return Record(
        seq=plan.seq,
        t=round(t, 6),
        model=plan.model,
        kind=plan.kind,
        stream=plan.stream,
        prompt_tokens=plan.prompt_tokens,
        max_tokens=plan.max_tokens,
        target=target.name,
        lag=round(lag, 6),
        priority=plan.priority,
    )


def describe(exc: BaseException) -> str:
    """`ExceptionClass: short message`, for the ledger's error field."""
    text = str(exc).replace("\n", " ").strip()
    name = type(exc).__name__
    return f"{name}: {text}"[:ERROR_TEXT_MAX] if text else name


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    plan: RequestPlan,
    record: Record,
    client_timeout: aiohttp.ClientTimeout,
) -> None:
    """Send `plan` to `target`, filling `record` in as things happen.

    Never raises for a failed request (the failure goes into `record.error`), only when cancelled;
    a cancelled request's record still holds what was seen so far (status, ttfb, bytes, ...).
    Times are from the moment of sending, not from the scheduled time (add `record.lag` for that).
    """
    messages = plan.kind == "messages"
    base = (_ANTHROPIC_HEADERS if messages else _HEADERS).get(plan.priority)
    if base is None:  # a hand-made plan with a class the workload would refuse: send it as is
        base = {**_JSON, "x-gateway-priority": str(plan.priority)}
        if messages:
            base["anthropic-version"] = ANTHROPIC_VERSION
    headers = base.copy()
    headers["x-loadgen-seq"] = str(plan.seq)
    if target.api_key is not None:
        headers["authorization"] = f"Bearer {target.api_key}"
    scanner: SseScanner | None = None
    nbytes = 0
    started = time.perf_counter()
    try:
        url = _url(target.base_url, plan.path)
        async with session.post(
            url, data=plan.body, headers=headers, timeout=client_timeout
        ) as response:
            status = response.status
            record.status = status
            response_headers = response.headers
            attempts = response_headers.get("x-gateway-attempts")
            if attempts is not None and attempts.isdigit():
                record.attempts = int(attempts)
            instance = response_headers.get("x-gateway-instance")
            record.instance = instance if instance or target.gateway else target.name
            oom_header = "x-oom-count" in response_headers
            kept: list[bytes] = []
            kept_size = 0
            if plan.stream and status == 200:
                scanner = AnthropicSseScanner() if messages else SseScanner()
            async for chunk in response.content.iter_any():
                if not nbytes:
                    record.ttfb = round(time.perf_counter() - started, 6)
                nbytes += len(chunk)
                if scanner is not None:
                    scanner.feed(chunk)
                elif kept_size < MAX_KEPT_BODY:
                    kept.append(chunk)
                    kept_size += len(chunk)
            if scanner is not None:
                scanner.finish()
                record.proper = scanner.done and not scanner.error_event
                record.oom = scanner.oom or oom_header
            else:
                body = b"".join(kept)
                whole = kept_size < MAX_KEPT_BODY
                record.proper = status == 200 and whole and _proper(body, messages)
                record.oom = oom_header or (status == 500 and b"out of memory" in body.lower())
                if status == 429:
                    record.shed = is_shed(response_headers.get(ERROR_HEADER), body)
                    record.retry_after = response_headers.get("retry-after")
    except Exception as exc:  # any failure, ours included, ends in the record, never lost
        record.error = describe(exc)
        record.proper = False
    finally:
        record.total = round(time.perf_counter() - started, 6)
        record.bytes = nbytes
        if scanner is not None:
            record.chunks = scanner.events
            record.error_event = scanner.error_event
            record.oom = record.oom or scanner.oom


def is_shed(error_header: str | None, body: bytes) -> bool:
    """Whether a 429 is the gateway's admission shed: its `x-gateway-error` header says so.
    Without the header (a gateway from before it), the OpenAI-shaped body's code, which only
    429s pay to parse."""
    if error_header is not None:
        return error_header == SHED_CODE
    return _error_code(body) == SHED_CODE


def _error_code(body: bytes) -> str | None:
    """`error.code` of an OpenAI-style error body, None when there is none."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    error = value.get("error") if isinstance(value, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _proper(body: bytes, messages: bool = False) -> bool:
    try:
        value = json.loads(body)
    except ValueError:
        return False
    if not isinstance(value, dict):
        return False
    if messages:
        return value.get("type") == "message"
    return "choices" in value or "data" in value
