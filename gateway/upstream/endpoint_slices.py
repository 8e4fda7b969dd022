"""Instances from Kubernetes EndpointSlices (`discovery.kubernetes`), listed then watched.

The client is `kubernetes_asyncio`, configured as any in-cluster client is: the pod's service
account (its token is read again as it rotates) when `KUBERNETES_SERVICE_HOST` is set, else the
kubeconfig (`KUBECONFIG`, `~/.kube/config`). It needs `get`, `list` and `watch` on
`endpointslices` (API group `discovery.k8s.io`) in the namespace, nothing more.

The protocol, as Kubernetes informers follow it:
- **list** the slices (a Service's: label `kubernetes.io/service-name`; or those matching the
  selector) and note the list's `resourceVersion`;
- **watch** from that version with bookmarks, so a quiet watch still learns the current version
  and resumes from it, not from an old one the server may have compacted;
- a watch that ends (its server-side timeout, a dropped connection) resumes from the last
  version seen; one refused with **410 Gone** (that version is compacted) lists again;
- any other failure (the API unreachable, 401/403, 5xx) is an error: the last known instances
  stay, and the source tries again with a backoff (0.5 s doubling to 10 s).

Endpoints become instances by `gateway.core.discovery.from_slices` (ready ones, named by their
pod). Events that come together (an endpoint moved between two slices is two events) are taken
as one answer, after `SETTLE_S`, so an instance that only moved is never dropped and re-added.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.watch import Watch

from gateway.config.models import KubernetesDiscoveryPolicy
from gateway.core.discovery import Endpoint, Slice, SliceEndpoint, from_slices
from gateway.runtime import Clock

Answered = Callable[[Sequence[Endpoint]], Awaitable[None]]
Failed = Callable[[str], None]

SERVICE_LABEL: Final = "kubernetes.io/service-name"
NAMESPACE_FILE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# The server ends each watch after this (a little randomised by the server itself).
WATCH_TIMEOUT_S: Final = 290
# A watch's limits: the whole of it a little longer than the server's timeout, and a silence
# longer than the API server's bookmarks leave (about one a minute) a dead connection.
WATCH_LIMITS: Final = aiohttp.ClientTimeout(
    total=WATCH_TIMEOUT_S + 30, sock_connect=10, sock_read=150
)
LIST_TIMEOUT_S: Final = 30
SETTLE_S: Final = 0.05
BACKOFF_FIRST_S: Final = 0.5
BACKOFF_MAX_S: Final = 10.0
# A watch that broke after this long was working: it resumes at once, without an error.
WORKING_WATCH_S: Final = 1.0


class KubernetesError(Exception):
    """The API could not be read (the last known instances stay)."""


def _to_slice(item: Any) -> Slice:
    """The parts of a `V1EndpointSlice` discovery reads."""
    endpoints = []
    for endpoint in item.endpoints or ():
        if not endpoint.addresses:
            continue
        conditions = endpoint.conditions
        ref = endpoint.target_ref
        endpoints.append(
            SliceEndpoint(
                address=endpoint.addresses[0],  # the API allows exactly one (as of v1)
                ready=conditions.ready if conditions else None,
                serving=conditions.serving if conditions else None,
                terminating=conditions.terminating if conditions else None,
                pod=ref.name if ref is not None and ref.kind == "Pod" else None,
                hostname=endpoint.hostname,
            )
        )
    ports = tuple((port.name or None, port.port) for port in item.ports or () if port.port)
    return Slice(item.address_type or "", ports, tuple(endpoints))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason or ''}".strip()
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}"


class EndpointSliceSource:
    """One pool's Service (or selector), its slices kept by name from the list and watch."""

    kind = "kubernetes"

    def __init__(self, policy: KubernetesDiscoveryPolicy) -> None:
        self.policy = policy
        self.namespace: str | None = policy.namespace
        if policy.service is not None:
            self.selector = f"{SERVICE_LABEL}={policy.service}"
        else:
            assert policy.selector is not None  # the policy has one of the two
            self.selector = policy.selector
        self._slices: dict[str, Slice] = {}
        self._changed = asyncio.Event()
        # What a list or a watch has told so far, for tests and /admin/state.
        self.resource_version: str | None = None
        self.lists = 0
        self.watches = 0

    @property
    def target(self) -> str:
        where = self.namespace or "(own namespace)"
        if self.policy.service is not None:
            return f"{where}/{self.policy.service}"
        return f"{where} {self.selector}"

    async def _client(self) -> client.ApiClient:
        """An API client configured as the environment says (in-cluster, else kubeconfig)."""
        configuration = client.Configuration()
        in_cluster = False
        try:
            load_incluster: Callable[..., None] = config.load_incluster_config  # untyped
            load_incluster(client_configuration=configuration)
            in_cluster = True
        except ConfigException:
            try:
                # KUBECONFIG read now (the library reads it once, at its import).
                await config.load_kube_config(
                    config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
                )
            except (ConfigException, OSError) as exc:
                raise KubernetesError(f"no Kubernetes configuration: {exc}") from None
        if self.namespace is None:
            self.namespace = _own_namespace(in_cluster)
        return client.ApiClient(configuration)

    async def run(self, answered: Answered, failed: Failed, clock: Clock) -> None:
        """List and watch, forever (until cancelled); answers go out as they settle."""
        reporter = asyncio.get_running_loop().create_task(self._report(answered, failed))
        try:
            await self._follow(failed, clock)
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter

    async def _report(self, answered: Answered, failed: Failed) -> None:
        port = self.policy.port
        while True:
            await self._changed.wait()
            await asyncio.sleep(SETTLE_S)  # take events that come together as one answer
            self._changed.clear()
            try:
                endpoints = from_slices(self._slices.values(), port)
            except ValueError as exc:  # the slices do not say which port: nothing changes
                failed(f"{self.target}: {exc}")
                continue
            await answered(endpoints)

    async def _follow(self, failed: Failed, clock: Clock) -> None:
        backoff = BACKOFF_FIRST_S
        gone = 0  # 410s in a row: one is the protocol, more are a server to go easy on
        api_client: client.ApiClient | None = None
        try:
            while True:
                try:
                    if api_client is None:
                        api_client = await self._client()
                    api = client.DiscoveryV1Api(api_client)
                    if self.resource_version is None:
                        await self._list(api)
                    await self._watch(api, clock)
                    backoff = BACKOFF_FIRST_S  # ended by the server's timeout: watch again
                    gone = 0
                    continue
                except ApiException as exc:
                    if exc.status == 410:
                        self.resource_version = None  # compacted: list again
                        gone += 1
                        if gone == 1:
                            continue  # at once
                    else:
                        failed(f"{self.target}: {_describe(exc)}")
                    if exc.status in (401, 403) and api_client is not None:
                        # The credentials may have expired (a kubeconfig's exec or OIDC
                        # token): read the configuration again for the next try.
                        await api_client.close()
                        api_client = None
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    failed(f"{self.target}: {_describe(exc)}")
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a malformed answer, no configuration: try again
                    failed(f"{self.target}: {_describe(exc)}")
                await asyncio.sleep(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)
        finally:
            if api_client is not None:
                await api_client.close()

    async def _list(self, api: client.DiscoveryV1Api) -> None:
        assert self.namespace is not None  # set with the client
        self.lists += 1
        listing = await api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.selector, _request_timeout=LIST_TIMEOUT_S
        )
        self._slices = {item.metadata.name: _to_slice(item) for item in listing.items}
        self.resource_version = listing.metadata.resource_version
        self._changed.set()

    async def _watch(self, api: client.DiscoveryV1Api, clock: Clock) -> None:
        """One watch, from `resource_version`, until the server ends it. A watch that worked
        (answered, and told something or lasted `WORKING_WATCH_S`) and then dropped returns
        as if ended: the next resumes from its version, no error."""
        self.watches += 1
        opened_at: float | None = None
        heard = False

        async def listing(*args: Any, **kwargs: Any) -> Any:
            nonlocal opened_at
            response = await api.list_namespaced_endpoint_slice(*args, **kwargs)
            opened_at = clock()
            return response

        def worked() -> bool:
            return opened_at is not None and (heard or clock() - opened_at >= WORKING_WATCH_S)

        # The client reads the result type and parameters from the function's docstring.
        functools.update_wrapper(listing, api.list_namespaced_endpoint_slice)
        watch = Watch()
        try:
            async with watch:
                stream = watch.stream(
                    listing,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=self.resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=WATCH_TIMEOUT_S,
                    _request_timeout=WATCH_LIMITS,
                )
                async for event in stream:
                    if not isinstance(event, dict):  # a body that is not an event (a proxy's)
                        raise KubernetesError(f"not a watch event: {str(event)[:100]!r}")
                    heard = True
                    kind = event["type"]
                    if kind != "BOOKMARK":
                        item = event["object"]
                        name = item.metadata.name
                        if kind == "DELETED":
                            self._slices.pop(name, None)
                        else:
                            self._slices[name] = _to_slice(item)
                        self._changed.set()
                    if watch.resource_version:
                        self.resource_version = watch.resource_version
        except (aiohttp.ClientError, TimeoutError, OSError):
            if not worked():
                raise
            return
        if not worked():  # an answer that ends at once, empty: not a watch (a proxy's page?)
            raise KubernetesError("the watch ended at once without an event")


def _own_namespace(in_cluster: bool) -> str:
    """The namespace of the gateway's service account (in-cluster), else of the kubeconfig's
    current context, else `default`."""
    if in_cluster:
        with contextlib.suppress(OSError):
            return NAMESPACE_FILE.read_text().strip() or "default"
    with contextlib.suppress(ConfigException, OSError, KeyError, TypeError):
        _, active = config.list_kube_config_contexts(os.environ.get("KUBECONFIG"))
        if active is not None:
            namespace = active.get("context", {}).get("namespace")
            if namespace:
                return str(namespace)
    return "default"
