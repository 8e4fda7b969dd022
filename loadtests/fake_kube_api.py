"""A fake Kubernetes API server for EndpointSlices: list and watch, over real HTTP, in-test.

It serves `GET /apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices` (and the
all-namespaces `GET /apis/discovery.k8s.io/v1/endpointslices`) on a loopback port with
`loadtests.asgi_server.ThreadedServer`, for a client such as `kubernetes_asyncio` configured by a
kubeconfig with a bearer token. The test thread changes the slices and injects failures through
thread-safe methods; each change bumps one global resource version, as etcd's revision does.

What it does as the real kube-apiserver (with its watch cache) does:
- **Authentication, then authorization**: a missing or wrong bearer token is 401 `Unauthorized`;
  a namespace in `forbidden_namespaces` is 403 `Forbidden` with RBAC's message. Errors are
  `Status` objects (`kind: Status`, `apiVersion: v1`, `status: Failure`, `reason`, `code`).
- **List**: an `EndpointSliceList` whose `metadata.resourceVersion` is the version the list was
  read at. Its items carry no `kind`/`apiVersion` (the real server omits them in lists; watch
  events carry them). A list is consistent at the current version when `resourceVersion` is
  unset; `resourceVersionMatch=Exact` reads the state at that version (410 `Expired` once
  compacted); a version newer than the server's is waited for up to 3 s, then 504 `Timeout`
  ("Too large resource version"). `limit` pages with `continue` tokens that pin the first page's
  version (410 once compacted), except with `resourceVersion=0`, which is served whole from the
  cache, `limit` ignored.
- **Watch** (`watch=true`): HTTP 200, `Content-Type: application/json`, a chunked body of one
  JSON event per line, `{"type": ..., "object": ...}`. From `resourceVersion=N`: every change
  after N, in order, then live ones. Unset or `0`: synthetic `ADDED` events for the current
  state first. N older than the compacted version: HTTP 200 with a single `ERROR` event (a 410
  `Expired` Status, "too old resource version: N (M)"), then the stream ends. N newer than the
  current version: the watch waits for the changes after N.
- **Label selectors** (`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`) filter
  lists and watch events alike; in a watch, a change that makes an object stop matching is sent
  as `DELETED` (its previous content at the change's version), one that makes it match as
  `ADDED`.
- **Bookmarks** (`allowWatchBookmarks=true`): an object of the watched kind holding only
  `metadata.resourceVersion`, the version up to which the watcher has been sent every change.
  They come every `bookmark_interval_s` (the real server: about a minute) and once 2 s before
  the watch's `timeoutSeconds` ends it; like the real server, none at all when the watch is
  shorter than that margin. `sendInitialEvents=true` (with `resourceVersionMatch=NotOlderThan`)
  ends the initial events with a bookmark annotated `k8s.io/initial-events-end: "true"`.
- **Deletions** are `DELETED` events whose object is the last state with the deletion's version.
- An update that changes nothing (the same endpoints, ports and labels) is a no-op: no new
  version, no event.
- Empty `endpoints` or `ports` are served as `null`, as Go encodes the decoded empty lists.

Failures a test injects: `fail_next` (the next requests get an error Status), `set_unavailable`
(every request 503), `drop_watches` (every open watch connection reset at the TCP level, with no
end to its chunked body, as when an API server or a load balancer in front of it restarts),
`compact` (every older version expires).
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import copy
import json
import re
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qs

import yaml
from starlette.types import Receive, Scope, Send

from loadtests.asgi_server import ThreadedServer

GROUP: Final = "discovery.k8s.io"
API_VERSION: Final = "discovery.k8s.io/v1"
KIND: Final = "EndpointSlice"
RESOURCE: Final = "endpointslices"
SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
MANAGED_BY_LABEL: Final = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY: Final = "endpointslice-controller.k8s.io"
INITIAL_EVENTS_END: Final = "k8s.io/initial-events-end"

_PREFIX: Final = f"/apis/{API_VERSION}"
_NAMESPACED_PATH: Final = re.compile(rf"^{re.escape(_PREFIX)}/namespaces/([^/]+)/{RESOURCE}/?$")
_CLUSTER_PATH: Final = re.compile(rf"^{re.escape(_PREFIX)}/{RESOURCE}/?$")
# The real server waits this long for its cache to reach a requested newer version.
_TOO_LARGE_RV_WAIT_S: Final = 3.0
# How long before a watch's timeoutSeconds the real server sends its last bookmark.
_PRETIMEOUT_BOOKMARK_S: Final = 2.0

_REASONS: Final = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
_MESSAGES: Final = {
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected failure",
    503: "the server is currently unable to handle the request",
    504: "Timeout: request did not complete within the allotted timeout",
}


def status_object(
    code: int, message: str, reason: str | None = None, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A `Status` as the API server sends for a failure (in a body, or in a watch ERROR)."""
    status: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, ""),
    }
    if details is not None:
        status["details"] = details
    status["code"] = code
    return status


def _uid(*parts: str) -> str:
    # Stable across runs so that failures are reproducible; unique per object.
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(("fake-kube-api", *parts))))


def _timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _encode(obj: Any) -> bytes:
    # Compact JSON, newline-terminated: what the API server's JSON encoder writes.
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _flag(params: Mapping[str, str], name: str) -> bool:
    # The API server's query conversion: present and not "false"/"0" (any case) is true, so the
    # Python clients' `True` counts.
    value = params.get(name)
    return value is not None and value.lower() not in ("false", "0")


def endpoint(
    ip: str,
    pod: str,
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
    *,
    namespace: str | None = None,
    node_name: str | None = None,
    hostname: str | None = None,
    zone: str | None = None,
) -> dict[str, Any]:
    """One entry of an EndpointSlice's `endpoints`, for a pod (`serving` defaults to `ready`).

    The target's namespace and uid, when not given, are filled in by `FakeKubeApi.put_slice`
    from the slice's namespace."""
    entry: dict[str, Any] = {
        "addresses": [ip],
        "conditions": {
            "ready": ready,
            "serving": ready if serving is None else serving,
            "terminating": terminating,
        },
    }
    if hostname is not None:
        entry["hostname"] = hostname
    ref: dict[str, Any] = {"kind": "Pod", "name": pod}
    if namespace is not None:
        ref = {
            "kind": "Pod",
            "namespace": namespace,
            "name": pod,
            "uid": _uid("pod", namespace, pod),
        }
    entry["targetRef"] = ref
    if node_name is not None:
        entry["nodeName"] = node_name
    if zone is not None:
        entry["zone"] = zone
    return entry


# --- label selectors ---------------------------------------------------------------------

_KEY = r"(?:[A-Za-z0-9][-A-Za-z0-9_./]*)?[A-Za-z0-9]"
_VALUE = r"(?:(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_EXISTS = re.compile(rf"^(!?)\s*({_KEY})$")
_EQUALS = re.compile(rf"^({_KEY})\s*(==|=|!=)\s*({_VALUE})$")
_SET = re.compile(rf"^({_KEY})\s+(in|notin)\s*\(([^()]*)\)$")


@dataclass(frozen=True)
class _Requirement:
    key: str
    op: str  # "exists", "!exists", "in", "notin"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op == "in":
            return present and labels[self.key] in self.values
        return not present or labels[self.key] not in self.values


class LabelSelector:
    """A `labelSelector` query value, equality- and set-based, as the API server parses it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.requirements = [self._parse(term) for term in self._terms(text)]

    @staticmethod
    def _terms(text: str) -> Iterator[str]:
        # Commas separate requirements except inside the parentheses of a set.
        depth, start = 0, 0
        for i, char in enumerate(text):
            if char == "(":
                depth += 1
            elif char == ")":
                depth -= 1
            elif char == "," and depth == 0:
                yield text[start:i].strip()
                start = i + 1
        last = text[start:].strip()
        if last or start:
            yield last

    @staticmethod
    def _parse(term: str) -> _Requirement:
        if match := _EQUALS.match(term):
            key, op, value = match.groups()
            return _Requirement(key, "notin" if op == "!=" else "in", frozenset({value}))
        if match := _SET.match(term):
            key, op, values = match.groups()
            parsed = frozenset(v.strip() for v in values.split(","))
            return _Requirement(key, op, parsed)
        if match := _EXISTS.match(term):
            negated, key = match.groups()
            return _Requirement(key, "!exists" if negated else "exists")
        raise ValueError(f"unable to parse requirement: {term!r}")

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        return all(r.matches(labels or {}) for r in self.requirements)


# --- state --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Change:
    """One entry of the history: `obj` is the object after the change (for DELETED, its last
    state with the deletion's version); `prev` the object before it (None for ADDED)."""

    rv: int
    type: str
    obj: dict[str, Any]
    prev: dict[str, Any] | None


@dataclass
class KubeRequest:
    """A request the fake received: which endpoint, its query, what it answered. `error_code` is
    the code of the ERROR event a watch ended with (410 when its version had expired)."""

    kind: str  # "list", "watch", or "other" (any other path or method)
    path: str
    namespace: str | None
    params: dict[str, str]
    status: int = 0
    error_code: int | None = None

    @property
    def resource_version(self) -> str | None:
        return self.params.get("resourceVersion")


@dataclass(eq=False)
class _Watcher:
    loop: asyncio.AbstractEventLoop
    client: tuple[str, int] | None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    client_gone: bool = False
    dropped: bool = False
    # Set when the connection could not be reset from outside: the watch raises instead, which
    # makes uvicorn close the connection without ending the chunked body.
    must_raise: bool = False


class _Reply(Exception):
    """Ends a request early with a Status (and optional extra headers)."""

    def __init__(self, code: int, message: str, **kwargs: Any) -> None:
        super().__init__(message)
        self.code = code
        self.status = status_object(code, message, **kwargs)
        self.headers: list[tuple[bytes, bytes]] = []


def _key(obj: Mapping[str, Any]) -> str:
    # The object's place in the list order (etcd's key order: namespace, then name).
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


def _with_rv(obj: dict[str, Any], rv: int) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = str(rv)
    return out


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    labels: Mapping[str, str] = obj["metadata"].get("labels") or {}
    return labels


class FakeKubeApi:
    """The fake API server: its slices, its history of changes, its open watches.

    Use `with FakeKubeApi() as kube:` or `start()`/`stop()`. Every control method may be called
    from any thread (the tests' own, typically), while the server runs in its own thread."""

    endpoint = staticmethod(endpoint)

    def __init__(
        self,
        *,
        token: str = "fake-kube-token",
        bookmark_interval_s: float = 1.0,
        forbidden_namespaces: Iterable[str] = (),
        user: str = "system:serviceaccount:default:gateway",
        start_rv: int = 1000,
    ) -> None:
        self.token = token
        self.bookmark_interval_s = bookmark_interval_s
        self.user = user
        self._lock = threading.Lock()
        self._forbidden = frozenset(forbidden_namespaces)
        self._rv = start_rv
        # Versions before this are gone: watches and exact reads from them get 410.
        self._compacted_rv = start_rv
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        # Every change since the start: compaction only moves `_compacted_rv`, so the watches
        # already open go on reading it (the real watch cache keeps serving them too).
        self._history: list[_Change] = []
        self._watchers: set[_Watcher] = set()
        self._requests: list[KubeRequest] = []
        self._fail_next: list[int] = []
        self._unavailable = False
        self._closing = False
        self._server: ThreadedServer | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        if self._server is None:
            with self._lock:
                self._closing = False

            async def app(scope: Scope, receive: Receive, send: Send) -> None:
                await self._app(scope, receive, send)

            # A plain coroutine function: uvicorn takes a bound method for an ASGI2 app.
            self._server = ThreadedServer(app)
        return self

    def stop(self) -> None:
        """Ends every open watch cleanly, then stops the server."""
        server, self._server = self._server, None
        if server is None:
            return
        with self._lock:
            self._closing = True
            watchers = list(self._watchers)
        for watcher in watchers:
            self._wake(watcher)
        # uvicorn's graceful shutdown waits for open responses: let the watches end first.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self._lock:
                if not self._watchers:
                    break
            time.sleep(0.01)
        server.stop()

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the fake API server is not running")
        return self._server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path, namespace: str = "default", token: str | None = None) -> Path:
        """Writes a kubeconfig for this server (bearer `token`, default the server's) to `path`."""
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-user", "user": {"token": token or self.token}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake-user", "namespace": namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    # --- control (thread-safe) ------------------------------------------------------------

    @property
    def current_rv(self) -> int:
        with self._lock:
            return self._rv

    def put_slice(
        self,
        name: str,
        namespace: str,
        service: str,
        endpoints: list[dict[str, Any]],
        ports: list[dict[str, Any]],
        labels: dict[str, str] | None = None,
        *,
        address_type: str = "IPv4",
    ) -> int:
        """Creates (ADDED) or replaces (MODIFIED) a slice as the EndpointSlice controller writes
        it; returns its resource version. `labels` are merged over the controller's two."""
        merged = {SERVICE_NAME_LABEL: service, MANAGED_BY_LABEL: MANAGED_BY, **(labels or {})}
        entries = [self._complete_endpoint(e, namespace) for e in endpoints]
        port_list = [self._complete_port(p) for p in ports]
        with self._lock:
            prev = self._objects.get((namespace, name))
            if prev is not None and (
                prev["metadata"]["labels"] == merged
                and prev["addressType"] == address_type
                and (prev["endpoints"] or []) == entries
                and (prev["ports"] or []) == port_list
            ):
                # The real server keeps the version of an update that changes nothing.
                return int(prev["metadata"]["resourceVersion"])
            self._rv += 1
            rv = self._rv
            meta = prev["metadata"] if prev is not None else {}
            obj = {
                "kind": KIND,
                "apiVersion": API_VERSION,
                "metadata": {
                    "name": name,
                    "generateName": f"{service}-",
                    "namespace": namespace,
                    "uid": meta.get("uid") or str(uuid.uuid4()),
                    "resourceVersion": str(rv),
                    "generation": meta.get("generation", 0) + 1,
                    "creationTimestamp": meta.get("creationTimestamp") or _timestamp(),
                    "labels": merged,
                    "annotations": {
                        "endpoints.kubernetes.io/last-change-trigger-time": _timestamp()
                    },
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Service",
                            "name": service,
                            "uid": _uid("service", namespace, service),
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "addressType": address_type,
                # Go encodes the empty lists it decoded from etcd as null.
                "endpoints": entries or None,
                "ports": port_list or None,
            }
            self._objects[(namespace, name)] = obj
            self._history.append(
                _Change(rv, "MODIFIED" if prev is not None else "ADDED", copy.deepcopy(obj), prev)
            )
            watchers = list(self._watchers)
        self._wake_all(watchers)
        return rv

    def delete_slice(self, name: str, namespace: str) -> int:
        """Deletes a slice (DELETED, with the deletion's version); returns that version."""
        with self._lock:
            prev = self._objects.pop((namespace, name))
            self._rv += 1
            rv = self._rv
            self._history.append(_Change(rv, "DELETED", _with_rv(prev, rv), prev))
            watchers = list(self._watchers)
        self._wake_all(watchers)
        return rv

    def slices(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """The current slices (copies), in list order."""
        with self._lock:
            objs = [o for o in self._objects.values() if namespace in (None, _ns(o))]
            return copy.deepcopy(sorted(objs, key=_key))

    def compact(self) -> int:
        """Forgets every version before the current one, as etcd's compaction (or a watch cache
        that has moved on) does: a watch, an exact list or a `continue` from an older version
        gets 410 `Expired`. Open watches go on. Returns the compacted version."""
        with self._lock:
            self._compacted_rv = self._rv
            return self._rv

    def drop_watches(self) -> int:
        """Resets every open watch connection at the TCP level (no end to its chunked body) and
        waits until that is done; returns how many were dropped."""
        with self._lock:
            watchers = [w for w in self._watchers if not w.client_gone]
        if not watchers:
            return 0
        loop = watchers[0].loop

        async def drop() -> None:
            for watcher in watchers:
                watcher.dropped = True
                if not self._reset_connection(watcher):
                    watcher.must_raise = True
                watcher.wake.set()

        asyncio.run_coroutine_threadsafe(drop(), loop).result(timeout=10)
        return len(watchers)

    def fail_next(self, count: int, status: int = 500) -> None:
        """The next `count` requests of any kind (before authentication, as from a proxy or an
        overloaded server) get `status` with a Status body."""
        with self._lock:
            self._fail_next.extend([status] * count)

    def set_unavailable(self, unavailable: bool) -> None:
        """While set, every request gets 503 (open watches go on; `drop_watches` ends them)."""
        with self._lock:
            self._unavailable = unavailable

    def set_forbidden_namespaces(self, namespaces: Iterable[str]) -> None:
        """RBAC denies these namespaces (and the cluster scope, when any is denied) from now."""
        with self._lock:
            self._forbidden = frozenset(namespaces)

    @property
    def requests(self) -> list[KubeRequest]:
        """Every request so far (copies), in arrival order."""
        with self._lock:
            return [replace(r, params=dict(r.params)) for r in self._requests]

    @property
    def list_requests(self) -> list[KubeRequest]:
        return [r for r in self.requests if r.kind == "list"]

    @property
    def watch_requests(self) -> list[KubeRequest]:
        return [r for r in self.requests if r.kind == "watch"]

    @property
    def list_count(self) -> int:
        return len(self.list_requests)

    @property
    def watch_count(self) -> int:
        return len(self.watch_requests)

    @property
    def open_watches(self) -> int:
        """Watch streams being served now (their client still connected)."""
        with self._lock:
            return sum(1 for w in self._watchers if not w.client_gone and not w.dropped)

    async def until(self, predicate: Callable[[], bool], within_s: float = 10.0) -> None:
        """Waits (without blocking the caller's event loop) until `predicate()` is true, e.g.
        `await kube.until(lambda: kube.open_watches == 1)`; raises TimeoutError after `within_s`."""
        deadline = time.monotonic() + within_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError("the fake Kubernetes API did not reach the expected state")
            await asyncio.sleep(0.01)

    # --- internals: state ----------------------------------------------------------------

    @staticmethod
    def _complete_endpoint(entry: Mapping[str, Any], namespace: str) -> dict[str, Any]:
        out = copy.deepcopy(dict(entry))
        ref = out.get("targetRef")
        if ref is not None:
            ref_ns = ref.get("namespace") or namespace
            out["targetRef"] = {
                "kind": ref.get("kind", "Pod"),
                "namespace": ref_ns,
                "name": ref["name"],
                "uid": ref.get("uid") or _uid("pod", ref_ns, ref["name"]),
            }
        return out

    @staticmethod
    def _complete_port(port: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": port.get("name", ""),
            "protocol": port.get("protocol", "TCP"),
            "port": port["port"],
        }
        if port.get("appProtocol") is not None:
            out["appProtocol"] = port["appProtocol"]
        return out

    def _state_at(self, rv: int) -> dict[tuple[str, str], dict[str, Any]]:
        """The objects as they were at version `rv` (caller holds the lock)."""
        if rv >= self._rv:
            return dict(self._objects)
        state: dict[tuple[str, str], dict[str, Any]] = {}
        for change in self._history:
            if change.rv > rv:
                break
            key = (_ns(change.obj), change.obj["metadata"]["name"])
            if change.type == "DELETED":
                state.pop(key, None)
            else:
                state[key] = change.obj
        return state

    @staticmethod
    def _wake(watcher: _Watcher) -> None:
        # RuntimeError: the server's loop is already closed, nothing left to wake.
        with contextlib.suppress(RuntimeError):
            watcher.loop.call_soon_threadsafe(watcher.wake.set)

    def _wake_all(self, watchers: Iterable[_Watcher]) -> None:
        for watcher in watchers:
            self._wake(watcher)

    def _reset_connection(self, watcher: _Watcher) -> bool:
        """Aborts the watch's connection with a TCP reset (runs in the server's loop). uvicorn
        gives an ASGI app no handle on its connection, so it is found among the server's by the
        client's address."""
        if self._server is None or watcher.client is None:
            return False
        for protocol in list(self._server.server.server_state.connections):
            if getattr(protocol, "client", None) != watcher.client:
                continue
            transport = getattr(protocol, "transport", None)
            if transport is None:
                return False
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # Linger 0: close sends RST, not FIN, like a crashed or restarted peer.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return True
        return False

    # --- internals: HTTP ------------------------------------------------------------------

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        params = {
            k: v[0]
            for k, v in parse_qs(scope["query_string"].decode(), keep_blank_values=True).items()
        }
        path: str = scope["path"]
        namespaced = _NAMESPACED_PATH.match(path)
        route = namespaced or _CLUSTER_PATH.match(path)
        namespace = namespaced.group(1) if namespaced else None
        if route is None or scope["method"] != "GET":
            kind = "other"
        else:
            kind = "watch" if _flag(params, "watch") else "list"
        record = KubeRequest(kind, path, namespace, params)
        with self._lock:
            self._requests.append(record)
        try:
            self._admit(scope, record, route is not None)
            if kind == "watch":
                await self._serve_watch(scope, receive, send, record)
            else:
                await self._serve_list(send, record)
        except _Reply as reply:
            record.status = reply.code
            await _send_json(send, reply.code, reply.status, reply.headers)

    def _admit(self, scope: Scope, record: KubeRequest, routed: bool) -> None:
        """Injected failures, then authentication, then the route, then authorization: the
        order in which the real server (behind a proxy) refuses a request."""
        with self._lock:
            injected = self._fail_next.pop(0) if self._fail_next else None
            unavailable = self._unavailable or self._closing
            forbidden = self._forbidden
        if unavailable:
            raise _Reply(503, _MESSAGES[503])
        if injected is not None:
            reply = _Reply(injected, _MESSAGES.get(injected, f"injected failure ({injected})"))
            if injected == 429:
                reply.status["details"] = {"retryAfterSeconds": 1}
                reply.headers.append((b"retry-after", b"1"))
            raise reply
        headers = dict(scope["headers"])
        scheme, _, presented = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or presented.strip() != self.token:
            raise _Reply(401, "Unauthorized")
        if not routed:
            raise _Reply(404, "the server could not find the requested resource", details={})
        if record.kind == "other":
            raise _Reply(405, "the server does not allow this method on the requested resource")
        if record.namespace in forbidden or (record.namespace is None and forbidden):
            verb = "watch" if record.kind == "watch" else "list"
            where = (
                f'in the namespace "{record.namespace}"'
                if record.namespace is not None
                else "at the cluster scope"
            )
            raise _Reply(
                403,
                f'{RESOURCE}.{GROUP} is forbidden: User "{self.user}" cannot {verb} resource '
                f'"{RESOURCE}" in API group "{GROUP}" {where}',
                details={"group": GROUP, "kind": RESOURCE},
            )

    @staticmethod
    def _selector(params: Mapping[str, str]) -> LabelSelector:
        try:
            return LabelSelector(params.get("labelSelector", ""))
        except ValueError as exc:
            raise _Reply(400, str(exc)) from None

    @staticmethod
    def _version(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise _Reply(400, f"invalid resource version: {text!r}")
        return value

    async def _await_version(self, rv: int) -> None:
        """Waits for the server to reach `rv` as the real one waits for its cache; 504 after."""
        deadline = time.monotonic() + _TOO_LARGE_RV_WAIT_S
        while True:
            current = self.current_rv
            if current >= rv:
                return
            if time.monotonic() > deadline:
                raise _Reply(
                    504,
                    f"Timeout: Too large resource version: {rv}, current: {current}",
                    details={
                        "causes": [
                            {
                                "reason": "ResourceVersionTooLarge",
                                "message": "Too large resource version",
                            }
                        ],
                        "retryAfterSeconds": 1,
                    },
                )
            await asyncio.sleep(0.02)

    async def _serve_list(self, send: Send, record: KubeRequest) -> None:
        params = record.params
        selector = self._selector(params)
        rv_text = params.get("resourceVersion", "")
        match = params.get("resourceVersionMatch", "")
        token = params.get("continue", "")
        limit = self._limit(params)
        if token:
            if rv_text:
                raise _Reply(400, "specifying resource version is not allowed when using continue")
            at_rv, after = _decode_continue(token)
            with self._lock:
                if at_rv < self._compacted_rv:
                    raise _Reply(
                        410,
                        "The provided continue parameter is too old to display a consistent "
                        "list result. You can start a new list without the continue parameter.",
                    )
                state = self._state_at(at_rv)
        else:
            if match and not rv_text:
                raise _Reply(
                    422,
                    "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden "
                    "unless resourceVersion is provided",
                )
            if match not in ("", "Exact", "NotOlderThan"):
                raise _Reply(422, f'resourceVersionMatch: Unsupported value: "{match}"')
            if match == "Exact" and rv_text == "0":
                raise _Reply(
                    422,
                    'resourceVersionMatch: Forbidden: resourceVersionMatch "exact" is '
                    'forbidden for resourceVersion "0"',
                )
            requested = self._version(rv_text) if rv_text else 0
            await self._await_version(requested)
            with self._lock:
                if match == "Exact":
                    if requested < self._compacted_rv:
                        raise _Reply(410, "The resourceVersion for the provided list is too old.")
                    at_rv = requested
                else:
                    at_rv = self._rv
                state = self._state_at(at_rv)
            after = ""
            if rv_text == "0" and not match:
                limit = 0  # served whole from the watch cache: the real server ignores limit
        items = sorted(
            (
                o
                for o in state.values()
                if record.namespace in (None, _ns(o)) and selector.matches(_labels(o))
            ),
            key=_key,
        )
        items = [o for o in items if _key(o) > after] if after else items
        metadata: dict[str, Any] = {"resourceVersion": str(at_rv)}
        if limit and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            metadata["continue"] = _encode_continue(at_rv, _key(items[-1]))
            if not selector.requirements:
                metadata["remainingItemCount"] = len(rest)
        listing = {
            "kind": f"{KIND}List",
            "apiVersion": API_VERSION,
            "metadata": metadata,
            # List items carry no kind/apiVersion on the wire (kubernetes/kubernetes#3030).
            "items": [
                {k: v for k, v in copy.deepcopy(o).items() if k not in ("kind", "apiVersion")}
                for o in items
            ],
        }
        record.status = 200
        await _send_json(send, 200, listing)

    @staticmethod
    def _limit(params: Mapping[str, str]) -> int:
        text = params.get("limit", "")
        try:
            return max(0, int(text)) if text else 0
        except ValueError:
            raise _Reply(400, f"invalid limit: {text!r}") from None

    async def _serve_watch(
        self, scope: Scope, receive: Receive, send: Send, record: KubeRequest
    ) -> None:
        params = record.params
        selector = self._selector(params)
        rv_text = params.get("resourceVersion", "")
        bookmarks = _flag(params, "allowWatchBookmarks")
        explicit_initial = "sendInitialEvents" in params
        timeout_text = params.get("timeoutSeconds", "")
        try:
            timeout_s = int(timeout_text) if timeout_text else None
        except ValueError:
            raise _Reply(400, f"invalid timeoutSeconds: {timeout_text!r}") from None
        if explicit_initial:
            if params.get("resourceVersionMatch") != "NotOlderThan":
                raise _Reply(
                    422,
                    "resourceVersionMatch: Forbidden: sendInitialEvents requires setting "
                    "resourceVersionMatch to NotOlderThan",
                )
            if _flag(params, "sendInitialEvents") and not bookmarks:
                raise _Reply(
                    422,
                    "allowWatchBookmarks: Forbidden: sendInitialEvents requires setting "
                    "allowWatchBookmarks to true",
                )
            initial = _flag(params, "sendInitialEvents")
        else:
            if params.get("resourceVersionMatch"):
                raise _Reply(
                    422,
                    "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for "
                    "watch unless sendInitialEvents is provided",
                )
            # The legacy rule: unset or "0" starts with the current state as ADDED events.
            initial = rv_text in ("", "0")
        requested = self._version(rv_text) if rv_text not in ("", "0") else 0

        loop = asyncio.get_running_loop()
        client = scope.get("client")
        watcher = _Watcher(loop, tuple(client) if client else None)
        expired: str | None = None
        snapshot: list[dict[str, Any]] = []
        start_rv = next_index = 0
        with self._lock:
            if initial or requested == 0:
                # From the current state (sent as ADDED when `initial`), then what follows.
                start_rv = self._rv
                next_index = len(self._history)
                if initial:
                    snapshot = sorted(copy.deepcopy(list(self._objects.values())), key=_key)
            elif requested < self._compacted_rv:
                expired = f"too old resource version: {requested} ({self._compacted_rv})"
            else:
                start_rv = requested
                next_index = bisect.bisect_right(self._history, requested, key=lambda c: c.rv)
            if expired is None:
                self._watchers.add(watcher)

        record.status = 200
        await send({"type": "http.response.start", "status": 200, "headers": _headers()})
        if expired is not None:
            # The real server answers 200, then a single ERROR event, then ends the stream.
            record.error_code = 410
            error = {"type": "ERROR", "object": status_object(410, expired, "Expired")}
            await send({"type": "http.response.body", "body": _encode(error), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

        listener = loop.create_task(self._await_disconnect(receive, watcher))
        try:
            await self._stream(
                watcher,
                send,
                record,
                selector,
                snapshot,
                start_rv,
                next_index,
                bookmarks,
                timeout_s,
            )
        finally:
            listener.cancel()
            with self._lock:
                self._watchers.discard(watcher)

    async def _stream(
        self,
        watcher: _Watcher,
        send: Send,
        record: KubeRequest,
        selector: LabelSelector,
        snapshot: list[dict[str, Any]],
        start_rv: int,
        next_index: int,
        bookmarks: bool,
        timeout_s: int | None,
    ) -> None:
        async def emit(kind: str, obj: dict[str, Any]) -> None:
            line = _encode({"type": kind, "object": obj})
            await send({"type": "http.response.body", "body": line, "more_body": True})

        loop = watcher.loop
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        for obj in snapshot:
            if record.namespace in (None, _ns(obj)) and selector.matches(_labels(obj)):
                await emit("ADDED", obj)
        if _flag(record.params, "sendInitialEvents"):
            await emit("BOOKMARK", _bookmark(start_rv, initial_events_end=True))
        # The version up to which this watcher has been sent every change.
        sent_rv = start_rv
        next_bookmark = self._next_bookmark(loop.time(), deadline) if bookmarks else None
        while True:
            # Cleared before reading the history, so a change made meanwhile wakes us again.
            watcher.wake.clear()
            if watcher.dropped:
                if watcher.must_raise:
                    raise ConnectionAbortedError("watch dropped by the test")
                return
            if watcher.client_gone:
                return
            with self._lock:
                closing = self._closing
                changes = self._history[next_index:]
                next_index = len(self._history)
                current = self._rv
            for change in changes:
                for kind, obj in self._render(change, record.namespace, selector, start_rv):
                    await emit(kind, obj)
            sent_rv = max(sent_rv, current)
            now = loop.time()
            if closing or (deadline is not None and now >= deadline):
                break
            if next_bookmark is not None and now >= next_bookmark:
                await emit("BOOKMARK", _bookmark(sent_rv))
                next_bookmark = self._next_bookmark(now, deadline)
            wake_at = min((t for t in (deadline, next_bookmark) if t is not None), default=None)
            try:
                if wake_at is None:
                    await watcher.wake.wait()
                else:
                    await asyncio.wait_for(watcher.wake.wait(), max(0.0, wake_at - loop.time()))
            except TimeoutError:
                pass
        # A clean end: the terminating chunk, as at the real server's timeout.
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _next_bookmark(self, now: float, deadline: float | None) -> float | None:
        """When the next bookmark is due: periodically, and 2 s before the watch's deadline;
        none when that moment has already passed (the real cacher's `nextBookmarkTime`)."""
        due = now + self.bookmark_interval_s
        if deadline is None:
            return due
        due = min(due, deadline - _PRETIMEOUT_BOOKMARK_S)
        return due if due > now else None

    @staticmethod
    def _render(
        change: _Change, namespace: str | None, selector: LabelSelector, start_rv: int
    ) -> list[tuple[str, dict[str, Any]]]:
        """The events one change makes for a watcher: an object entering or leaving its
        selector is ADDED or DELETED, as the real server's cacheWatcher filters."""
        if change.rv <= start_rv or namespace not in (None, _ns(change.obj)):
            return []
        now_matches = change.type != "DELETED" and selector.matches(_labels(change.obj))
        was_matching = change.prev is not None and selector.matches(_labels(change.prev))
        if change.type == "DELETED":
            return [("DELETED", change.obj)] if was_matching else []
        if now_matches and was_matching:
            return [("MODIFIED", change.obj)]
        if now_matches:
            return [("ADDED", change.obj)]
        if was_matching and change.prev is not None:
            return [("DELETED", _with_rv(change.prev, change.rv))]
        return []

    @staticmethod
    async def _await_disconnect(receive: Receive, watcher: _Watcher) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        watcher.client_gone = True
        watcher.wake.set()


def _ns(obj: Mapping[str, Any]) -> str:
    namespace: str = obj["metadata"]["namespace"]
    return namespace


def _bookmark(rv: int, *, initial_events_end: bool = False) -> dict[str, Any]:
    # An empty object of the watched kind, as Go encodes it: only the version is meaningful.
    metadata: dict[str, Any] = {"resourceVersion": str(rv), "creationTimestamp": None}
    if initial_events_end:
        metadata["annotations"] = {INITIAL_EVENTS_END: "true"}
    return {
        "kind": KIND,
        "apiVersion": API_VERSION,
        "metadata": metadata,
        "addressType": "",
        "endpoints": None,
        "ports": None,
    }


def _encode_continue(rv: int, last_key: str) -> str:
    # The real token: unpadded base64url of {"v", "rv", "start"}; "start" is the next key.
    body = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": last_key + "\x00"})
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        decoded = json.loads(raw)
        rv, start = int(decoded["rv"]), str(decoded["start"])
    except (ValueError, KeyError, TypeError):
        raise _Reply(
            400, "continue key is not valid: incorrect encoded start resourceVersion"
        ) from None
    # Keys strictly after the last one sent: "start" is that key with a NUL appended.
    return rv, start.removesuffix("\x00")


def _headers(length: int | None = None) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"content-type", b"application/json"),
        (b"cache-control", b"no-cache, private"),
        (b"audit-id", str(uuid.uuid4()).encode()),
    ]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return headers


async def _send_json(
    send: Send, code: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    data = _encode(body)
    headers = _headers(len(data)) + (extra or [])
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": data})
