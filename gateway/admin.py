"""The admin plane (Starlette): operator endpoints behind a bearer token."""

from __future__ import annotations

import hmac
import ipaddress
import os
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import Policy, split_host_port
from gateway.metrics import Observed, build_registry
from gateway.operations import Operations
from gateway.reload import ReloadResult


class Reloads(Protocol):
    """A reload from the policy file (serialised with every other reload)."""

    async def reload_from_file(self, source: str = "api") -> ReloadResult: ...


def admin_token(token_env: str) -> str | None:
    """The bearer token from the environment variable the policy names (None when unset)."""
    return os.environ.get(token_env) or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_exposure_error(policy: Policy) -> str | None:
    """Why the admin plane may not be served as the policy says: off loopback, it needs its
    token (None: it may)."""
    host, _ = split_host_port(policy.admin.listen)
    if not _is_loopback(host) and admin_token(policy.admin.token_env) is None:
        return (
            f"refusing to serve the admin plane on {policy.admin.listen} without a token: "
            f"set {policy.admin.token_env}"
        )
    return None


class BearerAuth:
    """Pure-ASGI guard: every admin request must carry `Authorization: Bearer <token>`."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None and scope["type"] == "http":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):  # constant time
                response = JSONResponse(
                    {
                        "error": {
                            "message": "missing or wrong admin token",
                            "type": "authentication_error",
                            "code": "unauthorized",
                        }
                    },
                    status_code=401,
                    headers={"www-authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_metrics_app(observed: Observed) -> ASGIApp:
    """The metrics listener (`metrics.listen`): `GET /metrics` only, no token (what Prometheus
    scrapes from the pod; the admin plane's actions and state stay behind theirs)."""
    registry = build_registry(observed)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


def build_admin_app(
    operations: Operations, reloads: Reloads, observed: Observed, token: str | None
) -> ASGIApp:
    """The admin routes: the state view and the operator's actions (`operations`), reloads,
    /metrics reading `observed`; `token`: the bearer token every call must carry (None: none
    asked)."""

    async def state(request: Request) -> Response:
        return JSONResponse(operations.state())

    metrics_registry = build_registry(observed)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def operate(request: Request) -> Response:
        params = request.path_params
        action = params["action"]
        result = (
            operations.operator(params["pool"], params["name"], action)
            if action in ("isolate", "restore")
            else None
        )
        if result is None:
            error = {
                "message": "no such instance or action (isolate, restore)",
                "type": "not_found",
                "code": "not_found",
            }
            return JSONResponse({"error": error}, status_code=404)
        return JSONResponse(result)

    async def reload(request: Request) -> Response:
        result = await reloads.reload_from_file("admin")
        return JSONResponse(result.as_json(), status_code=200 if result.reloaded else 400)

    app = Starlette(
        routes=[
            Route("/admin/reload", reload, methods=["POST"]),
            Route("/admin/state", state, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route(
                "/admin/instances/{pool}/{name}/{action:str}",
                operate,
                methods=["POST"],
            ),
        ]
    )
    return BearerAuth(app, token)
