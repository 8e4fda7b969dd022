"""Command line.

- `gateway run --policy FILE`: serve.
- `gateway check [--resolve] FILE...`: validate policy files. Alone, a file is checked as a CI
  pipeline can: `${NAME}` references are not resolved (a value only the environment can tell is
  noted, not failed) and the secrets and CA files it names are not read; `--resolve` checks it
  with this environment, as `run` would.
- `gateway state`, `gateway isolate POOL INSTANCE`, `gateway restore POOL INSTANCE`,
  `gateway reload`: the admin API of a running gateway (`--admin URL`, default
  `$GATEWAY_ADMIN_URL` or http://127.0.0.1:9901; the bearer token from `$GATEWAY_ADMIN_TOKEN`,
  or the variable `--token-env` names).
- `gateway --version`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gateway import __version__
from gateway.config import PolicyError, load_policy
from gateway.telemetry.logs import LogFormat, configure_logging

DEFAULT_ADMIN = "http://127.0.0.1:9901"
ADMIN_TIMEOUT_S = 10.0


def _check(files: list[str], resolve: bool) -> int:
    """Each file `ok` on stdout, or its problems on stderr (exit 1). Checked alone, values
    written with `${NAME}` that only the environment can tell are noted, not failed."""
    failed = False
    for path in files:
        try:
            policy = load_policy(path, resolve=resolve)
        except PolicyError as exc:
            for problem in exc.problems:
                print(problem, file=sys.stderr)
            if any(not problem.unchecked for problem in exc.problems):
                failed = True
                continue
            print(f"{path}: ok ({len(exc.problems)} value(s) not checked without the environment)")
            continue
        if resolve:
            from gateway.admin import admin_exposure_error

            refused = admin_exposure_error(policy)
            if refused is not None:
                print(f"{path}: admin.listen: {refused}", file=sys.stderr)
                failed = True
                continue
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


def _admin_token(args: argparse.Namespace) -> str | None:
    """The token, checked before it goes into a header (an error never shows it)."""
    token = (os.environ.get(args.token_env) or "").strip()
    if not token:
        return None
    if any(ord(c) < 32 or ord(c) == 127 for c in token) or not token.isascii():
        raise ValueError(f"${args.token_env} holds characters a header cannot carry")
    return token


def _admin_call(args: argparse.Namespace, method: str, path: str) -> tuple[int, Any]:
    """(status, JSON body) of one admin call; status 0 when no answer came (the body's error
    says why). Never through a proxy: the call carries the admin token."""
    url = args.admin.rstrip("/") + path
    try:
        token = _admin_token(args)
    except ValueError as exc:
        return 0, {"error": {"message": str(exc)}}
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=ADMIN_TIMEOUT_S) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        try:
            status, body = exc.code, exc.read()
        except (OSError, http.client.HTTPException):
            status, body = exc.code, b""
    except TimeoutError:
        message = f"no answer from {url} within {ADMIN_TIMEOUT_S:g} s"
        if method == "POST":
            message += ": whether it was done is unknown (see `gateway state`)"
        return 0, {"error": {"message": message}}
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        return 0, {"error": {"message": f"cannot reach the admin API at {args.admin}: {reason}"}}
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        text = body.decode("utf-8", "replace")[:300]
        # A 200 that is not the API's JSON is not the API answering (a proxy's page, say).
        return 0 if status == 200 else status, {
            "error": {"message": f"the answer is not JSON: {text!r}"}
        }


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
        pool, instance = (urllib.parse.quote(v, safe="") for v in (args.pool, args.instance))
        path = f"/admin/instances/{pool}/{instance}/{args.command}"
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
