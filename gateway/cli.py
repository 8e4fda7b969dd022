"""Command line.

- `gateway run --policy FILE`: serve.
- `gateway check [--resolve] FILE...`: validate policy files. Alone, a file is checked as a CI
  pipeline can: `${NAME}` references are not resolved and the secrets and CA files it names are
  not read; `--resolve` checks it with this environment, as `run` would.
- `gateway state`, `gateway isolate POOL INSTANCE`, `gateway restore POOL INSTANCE`,
  `gateway reload`: the admin API of a running gateway (`--admin URL`, default
  `$GATEWAY_ADMIN_URL` or http://127.0.0.1:9901; the bearer token from `$GATEWAY_ADMIN_TOKEN`,
  or the variable `--token-env` names).
- `gateway --version`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from gateway import __version__
from gateway.config import PolicyError, load_policy
from gateway.telemetry.logs import LogFormat, configure_logging

DEFAULT_ADMIN = "http://127.0.0.1:9901"
ADMIN_TIMEOUT_S = 10.0


def _check(files: list[str], resolve: bool) -> int:
    failed = False
    for path in files:
        try:
            load_policy(path, resolve=resolve)
        except PolicyError as exc:
            failed = True
            for problem in exc.problems:
                print(problem, file=sys.stderr)
        else:
            print(f"{path}: ok")
    return 1 if failed else 0


def _run(policy_path: str, log_level: str, log_format: LogFormat | None) -> int:
    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    chosen = log_format or policy.telemetry.log_format
    configure_logging(log_level, chosen)
    import uvloop

    from gateway.server import serve
    from gateway.telemetry.tracing import TracingConfigError

    try:
        uvloop.run(serve(policy, policy_path, chosen))
    except TracingConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    return 0


# -- the admin API ------------------------------------------------------------------------------


def _admin_call(args: argparse.Namespace, method: str, path: str) -> tuple[int, Any]:
    """(status, JSON body) of one admin call; status 0 when the gateway could not be reached."""
    url = args.admin.rstrip("/") + path
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    token = os.environ.get(args.token_env)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"error": {"message": body.decode("utf-8", "replace")[:500]}}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return 0, {"error": {"message": f"cannot reach the admin API at {url}: {reason}"}}


def _admin(args: argparse.Namespace) -> int:
    if args.command == "state":
        status, body = _admin_call(args, "GET", "/admin/state")
        if status == 200 and args.pool is not None:
            pools = body.get("pools", {})
            if args.pool not in pools:
                print(
                    f"gateway: no pool {args.pool!r} (pools: {', '.join(pools)})", file=sys.stderr
                )
                return 1
            body = pools[args.pool]
    elif args.command == "reload":
        status, body = _admin_call(args, "POST", "/admin/reload")
    else:
        path = f"/admin/instances/{args.pool}/{args.instance}/{args.command}"
        status, body = _admin_call(args, "POST", path)
    if status == 200:
        print(json.dumps(body, indent=2))
        return 0
    message = body.get("error") if isinstance(body, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    where = f"HTTP {status}" if status else "error"
    print(f"gateway {args.command}: {where}: {message or json.dumps(body)}", file=sys.stderr)
    if status == 401:
        print(f"  (the admin token is read from ${args.token_env})", file=sys.stderr)
    return 1


def _admin_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin",
        default=os.environ.get("GATEWAY_ADMIN_URL") or DEFAULT_ADMIN,
        help="the admin plane's URL (default: $GATEWAY_ADMIN_URL or %(default)s)",
    )
    parser.add_argument(
        "--token-env",
        default="GATEWAY_ADMIN_TOKEN",
        help="the environment variable holding the admin token (default: %(default)s)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gateway", description="A resilience gateway for LLM model backends."
    )
    parser.add_argument("--version", action="version", version=f"gateway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve the data plane and the admin plane")
    run.add_argument("--policy", required=True, help="policy file (YAML)")
    run.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    run.add_argument(
        "--log-format", choices=["text", "json"], help="overrides telemetry.log_format"
    )
    check = commands.add_parser("check", help="validate policy files")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument(
        "--resolve",
        action="store_true",
        help="resolve ${NAME} references from this environment and read the secrets and CA "
        "files the policy names, as `run` does (default: check the files alone)",
    )
    state = commands.add_parser("state", help="a running gateway's state (JSON)")
    state.add_argument("--pool", help="only this pool's")
    _admin_options(state)
    for action, text in (("isolate", "take an instance out"), ("restore", "bring it back")):
        command = commands.add_parser(action, help=f"{text} (an operator's decision)")
        command.add_argument("pool")
        command.add_argument("instance")
        _admin_options(command)
    reload = commands.add_parser("reload", help="reload a running gateway's policy file")
    _admin_options(reload)
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args.files, args.resolve)
    if args.command == "run":
        return _run(args.policy, args.log_level, args.log_format)
    return _admin(args)


if __name__ == "__main__":
    sys.exit(main())
