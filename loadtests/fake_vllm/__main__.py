"""Command line: serve one fake backend on a socket it binds itself, then announce the port."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gateway.server import bind_listener
from loadtests.serving import rig_config, serve_announced

from .app import build_app
from .config import FakeConfig


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.fake_vllm", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--name", default="fake", help="shown in the READY line")
    parser.add_argument("--models", default="fake-model", help="comma-separated model ids")
    parser.add_argument("--ttft", type=float, default=0.02, help="seconds to the first token")
    parser.add_argument("--per-token", type=float, default=0.001, help="seconds per token")
    parser.add_argument(
        "--tokens-per-event",
        type=int,
        default=1,
        help="tokens per SSE event, as vLLM's stream interval (the last event may carry fewer)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault generator")
    parser.add_argument(
        "--fixed-body", action="store_true", help="answer every POST /v1/* with one fixed body"
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=0,
        help="requests generating at once, as vLLM's max_num_seqs; the rest wait (0: unlimited)",
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=0,
        help="KV-cache size in tokens; a request starting without room fails as OOM (0: unlimited)",
    )
    parser.add_argument(
        "--batch-slowdown",
        type=float,
        default=0.0,
        help="per-token time x (1 + this x running / max-running) as a request starts",
    )
    parser.add_argument(
        "--oom-above",
        type=int,
        default=0,
        help="no batch bound; a request starting past this many running fails as OOM (0: never)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="a prompt plus max_tokens over this many tokens is refused with a 400, worded as "
        "vLLM does (as Anthropic does on /v1/messages) (0: no limit)",
    )
    parser.add_argument(
        "--no-metrics",
        action="store_true",
        help="GET /metrics answers 404, as a server that exports no load gauges",
    )
    parser.add_argument(
        "--echo-prefill",
        action="store_true",
        help="stream an Anthropic prefill again before its continuation (llama.cpp's server)",
    )
    parser.add_argument(
        "--record-credentials",
        action="store_true",
        default=os.environ.get("FAKE_VLLM_RECORD_CREDENTIALS", "") not in ("", "0"),
        help="log the exact x-api-key and authorization of /v1/messages requests "
        "(also FAKE_VLLM_RECORD_CREDENTIALS=1); by default only presence and a short hash",
    )
    parser.add_argument(
        "--serve-when",
        type=Path,
        help="a replacement booted ahead of a restart: it makes PATH.booted once booted, opens "
        "the port once PATH exists (a restart back at the moment it is made, whatever an "
        "interpreter's start costs on a busy machine), and exits without serving once "
        "PATH.cancel exists or the process that started it is gone",
    )
    parser.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


class _IntendedAbort(logging.Filter):
    """Drop uvicorn's report of a response cut short: `die` and `stall` do it on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "ASGI callable returned without completing response."


# How often a replacement booted ahead looks for its signal to serve.
SERVE_WHEN_POLL_S = 0.005


def _serve_when(trigger: Path) -> bool:
    """Wait, booted, for `trigger` (True: serve) or `<trigger>.cancel` or the loss of the
    parent process (False: exit)."""
    parent = os.getppid()
    Path(f"{trigger}.booted").touch()
    cancel = Path(f"{trigger}.cancel")
    while not trigger.exists():
        if cancel.exists() or os.getppid() != parent:
            return False
        time.sleep(SERVE_WHEN_POLL_S)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models:
        print("--models needs at least one model id", file=sys.stderr)
        return 2
    if args.tokens_per_event < 1:
        print("--tokens-per-event must be >= 1", file=sys.stderr)
        return 2
    for flag, value in (
        ("--max-running", args.max_running),
        ("--kv-tokens", args.kv_tokens),
        ("--batch-slowdown", args.batch_slowdown),
        ("--oom-above", args.oom_above),
    ):
        if value < 0:
            print(f"{flag} must be >= 0", file=sys.stderr)
            return 2
    config = FakeConfig(
        name=args.name,
        models=models,
        ttft_s=args.ttft,
        per_token_s=args.per_token,
        seed=args.seed,
        tokens_per_event=args.tokens_per_event,
        fixed_body=args.fixed_body,
        max_running=args.max_running,
        kv_tokens=args.kv_tokens,
        batch_slowdown=args.batch_slowdown,
        oom_above=args.oom_above,
        metrics=not args.no_metrics,
        record_credentials=args.record_credentials,
        echo_prefill=args.echo_prefill,
        max_model_len=args.max_model_len,
    )
    server_config = rig_config(build_app(config), args.log_level)
    if args.serve_when is not None:
        server_config.load()  # what it can do before it serves, done while it waits
        if not _serve_when(args.serve_when):
            return 0
    sock = bind_listener(args.host, args.port)
    logging.getLogger("uvicorn.error").addFilter(_IntendedAbort())
    port = sock.getsockname()[1]
    serve_announced(server_config, sock, f"fake-vllm READY name={args.name} port={port}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
