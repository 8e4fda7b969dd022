"""Command line: `gateway run --policy FILE` and `gateway check FILE...`."""

from __future__ import annotations

import argparse
import sys

from gateway.config import PolicyError, load_policy
from gateway.telemetry.logs import LogFormat, configure_logging


def _check(files: list[str]) -> int:
    failed = False
    for path in files:
        try:
            load_policy(path)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
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
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args.files)
    return _run(args.policy, args.log_level, args.log_format)


if __name__ == "__main__":
    sys.exit(main())
