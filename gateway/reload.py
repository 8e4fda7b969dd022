"""Hot reload of the policy: what changed, what may not change without a restart, and the
file watcher.

A reload comes from `POST /admin/reload`, SIGHUP or a change of the policy file's content (a
Kubernetes ConfigMap update swaps the mounted file's `..data` symlink). The new file is validated
first; an invalid one, or one that changes a setting only a restart can apply, is refused and
the old policy keeps serving. `Reloader` decides; the gateway swaps the rest in one
synchronous step (`Gateway.swap`).

`pools` and `auth` (client API keys: rotated without a restart) change at run time; a
pool's `credentials` and `tls` are pool settings, and the secret and CA files they name are
read again by every reload (a rotated Secret with an unchanged policy is a changed pool).

So do `limits`, `drain` and `telemetry.access_log` (`RELOADABLE`). The limits apply to new
connections and requests (a connection already open follows them from its next request; see
`gateway.ingress.protocol`); `max_connections` counts at a new connection's arrival. The
drain settings are the ones in force when SIGTERM comes. The access log, on or off, applies
to the requests that end after the reload.

The rest is built once at startup, so a change there refuses the whole reload with the
dotted keys listed: `listen`, `admin` and `metrics` (the bound sockets; the admin token, read
when the admin plane is built, after the check that a non-loopback one has it), `shared` (the Redis
session and its subscription), `telemetry.tracing` and `telemetry.service_name` (the tracer
provider and its exporter, the pipeline's traced layers), `telemetry.log_format` (the log
handlers, and the access log's format with them).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gateway.config import Policy, PolicyError, load_policy
from gateway.runtime import cancel_and_wait

log = logging.getLogger("gateway.reload")

# How often the policy file is looked at (stat only; the content is read when the stat changes).
WATCH_INTERVAL_S = 1.0


class ReloadRefused(Exception):
    """A valid policy that cannot be applied without a restart."""


# The settings outside `pools` and `auth` that a reload applies (dotted key prefixes).
RELOADABLE = ("limits", "drain", "telemetry.access_log")


@dataclass(frozen=True)
class PolicyDiff:
    """What a reload changes. Instances are `pool/name`; one whose url changed is both removed
    and added (a different backend: no state carried over)."""

    restart_required: list[str] = field(default_factory=list)
    settings: list[str] = field(default_factory=list)  # changed `RELOADABLE` dotted keys
    pools_added: list[str] = field(default_factory=list)
    pools_removed: list[str] = field(default_factory=list)
    pools_changed: list[str] = field(default_factory=list)  # settings other than instances
    instances_added: list[str] = field(default_factory=list)
    instances_removed: list[str] = field(default_factory=list)
    auth_changed: bool = False  # the client API keys (or the `auth` section) changed

    @property
    def empty(self) -> bool:
        return not (self.settings or self.pools_or_auth)

    @property
    def pools_or_auth(self) -> bool:
        """Whether the pools or the client keys change (the registry and what follows it)."""
        return bool(
            self.auth_changed
            or self.pools_added
            or self.pools_removed
            or self.pools_changed
            or self.instances_added
            or self.instances_removed
        )

    def summary(self) -> dict[str, list[str]]:
        return {
            "pools_added": self.pools_added,
            "pools_removed": self.pools_removed,
            "pools_changed": self.pools_changed,
            "instances_added": self.instances_added,
            "instances_removed": self.instances_removed,
            "auth": ["api_keys"] if self.auth_changed else [],
            "settings": self.settings,
        }


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def setting_changes(old: Policy, new: Policy) -> list[str]:
    """Dotted keys outside `pools` and `auth` whose value differs (a whole section added or
    removed is named by the section)."""
    before = old.model_dump(exclude={"pools", "auth"})
    after = new.model_dump(exclude={"pools", "auth"})
    changed: list[str] = []
    for section in before.keys() | after.keys():
        a, b = before.get(section), after.get(section)
        if a == b:
            continue
        if not isinstance(a, dict) or not isinstance(b, dict):
            changed.append(section)
            continue
        left, right = _leaves(a, section), _leaves(b, section)
        changed.extend(k for k in left.keys() | right.keys() if left.get(k) != right.get(k))
    return sorted(changed)


def reloadable(key: str) -> bool:
    """Whether a reload applies this dotted key (one of `RELOADABLE` or below one)."""
    return any(key == prefix or key.startswith(prefix + ".") for prefix in RELOADABLE)


def diff_policies(old: Policy, new: Policy) -> PolicyDiff:
    """Compare two valid policies (pure: no state, no I/O)."""
    # Policies compare their secrets too (private attributes): a rotated key is a change.
    settings = setting_changes(old, new)
    diff = PolicyDiff(
        restart_required=[key for key in settings if not reloadable(key)],
        settings=[key for key in settings if reloadable(key)],
        auth_changed=old.auth != new.auth,
    )
    for name in sorted(old.pools.keys() - new.pools.keys()):
        diff.pools_removed.append(name)
        diff.instances_removed.extend(f"{name}/{i.name}" for i in old.pools[name].instances)
    for name, pool in new.pools.items():
        before = old.pools.get(name)
        if before is None:
            diff.pools_added.append(name)
            diff.instances_added.extend(f"{name}/{i.name}" for i in pool.instances)
            continue
        was = {(i.name, i.url) for i in before.instances}
        now = {(i.name, i.url) for i in pool.instances}
        diff.instances_removed.extend(f"{name}/{i}" for i, _ in sorted(was - now))
        diff.instances_added.extend(f"{name}/{i}" for i, _ in sorted(now - was))
        if before.model_copy(update={"instances": ()}) != pool.model_copy(update={"instances": ()}):
            diff.pools_changed.append(name)
    return diff


@dataclass
class ReloadResult:
    reloaded: bool
    version: int
    changes: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"reloaded": self.reloaded, "version": self.version}
        if self.reloaded:
            body["changes"] = self.changes
        else:
            body["error"] = self.error
        return body


@dataclass
class ReloadStats:
    """The reload history /metrics and /admin/state show."""

    version: int = 1
    loaded_at: float = 0.0  # wall clock
    source: str | None = None  # the policy file reloads read (None: none)
    ok: int = 0
    errors: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    last_ok: bool = True  # the last reload was applied (a refused file stays refused until fixed)

    def state(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "loaded_at": self.loaded_at,
            "source": self.source,
            "reloads": {"ok": self.ok, "error": self.errors},
            "last_reload_ok": self.last_ok,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
        }


def _fingerprint(path: str) -> tuple[int, int, int, int] | None:
    """(mtime_ns, size, inode, device) of the file the path leads to (symlinks followed)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


def _digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


class PolicyWatcher:
    """Polls the policy file every `interval_s`: when its stat changes (mtime, size, inode: a
    ConfigMap's symlink swap changes the inode), the content is hashed, and a different hash
    calls `reload` (once per content: a refused file is not retried until it changes again)."""

    def __init__(
        self,
        path: str,
        reload: Callable[[str], Awaitable[object]],
        interval_s: float = WATCH_INTERVAL_S,
    ) -> None:
        self._path = path
        self._reload = reload
        self._interval_s = interval_s
        self._stat = _fingerprint(path)
        self._hash = _digest(path)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    def seen(self) -> None:
        """The file was just read by another reload: do not reload the same content again."""
        self._stat = _fingerprint(self._path)
        self._hash = _digest(self._path)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the watcher die: the next poll tries again
                log.exception("policy watcher")

    async def poll(self) -> None:
        stat = _fingerprint(self._path)
        if stat is None or stat == self._stat:
            return  # missing for a moment (a swap in progress): wait for it to come back
        self._stat = stat
        digest = _digest(self._path)
        if digest is None or digest == self._hash:
            return
        self._hash = digest
        await self._reload("file change")


class Reloadable(Protocol):
    """What a reload changes: the policy in force, swapped in one synchronous step, and the
    background work that follows the pools (`gateway.app.Gateway`)."""

    policy: Policy

    def swap(self, policy: Policy, diff: PolicyDiff) -> list[Any]: ...

    async def follow(self, added: list[Any]) -> None: ...


class Reloader:
    """Decides when and whether a policy is applied: reloads are serialised, read from the
    file (`path`; None: a reload from a file is refused), refused when invalid or when they
    change what only a restart can, and counted in `stats`; a watcher follows the file."""

    def __init__(self, target: Reloadable, path: str | None, stats: ReloadStats) -> None:
        self._target = target
        self._path = path
        self.stats = stats
        # Serialises reloads, and the instance changes discovery makes (`gateway.app`).
        self.lock = asyncio.Lock()
        self._watcher: PolicyWatcher | None = None
        self._background: set[asyncio.Task[ReloadResult]] = set()

    def watch(self) -> None:
        """Reload when the policy file's content changes (no-op without a file)."""
        if self._path is not None and self._watcher is None:
            self._watcher = PolicyWatcher(self._path, self.reload_from_file)
            self._watcher.start()

    async def close(self) -> None:
        if self._watcher is not None:
            await self._watcher.close()
        await cancel_and_wait(list(self._background))

    def reload_in_background(self, source: str = "SIGHUP") -> None:
        """For a signal handler: reload from the policy file in a task of its own."""
        task = asyncio.get_running_loop().create_task(self.reload_from_file(source))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def reload_from_file(self, source: str = "api") -> ReloadResult:
        """Read, validate and apply the policy file; the old policy stays when it fails."""
        async with self.lock:
            if self._path is None:
                return self._refused("no policy file to reload from", source)
            try:
                policy = load_policy(self._path)
            except PolicyError as exc:
                return self._refused(str(exc), source)
            finally:
                if self._watcher is not None:
                    self._watcher.seen()  # this content is handled: not again by the watcher
            return await self._apply(policy, source)

    async def reload(self, policy: Policy, source: str = "api") -> ReloadResult:
        """Apply an already validated policy (reloads are serialised)."""
        async with self.lock:
            return await self._apply(policy, source)

    def _refused(self, message: str, source: str) -> ReloadResult:
        stats = self.stats
        stats.errors += 1
        stats.last_ok = False
        stats.last_error = message
        stats.last_error_at = time.time()
        log.error(
            "policy reload refused, the old policy keeps serving",
            extra={"fields": {"source": source, "version": stats.version, "error": message}},
        )
        return ReloadResult(False, stats.version, error=message)

    async def _apply(self, policy: Policy, source: str) -> ReloadResult:
        target = self._target
        diff = diff_policies(target.policy, policy)
        if diff.restart_required:
            return self._refused(
                "these settings take effect only after a restart (nothing was applied): "
                + ", ".join(diff.restart_required),
                source,
            )
        stats = self.stats
        stats.ok += 1
        stats.last_ok = True
        if diff.empty:
            target.policy = policy
            log.warning(
                "policy reloaded: no change",
                extra={"fields": {"source": source, "version": stats.version}},
            )
            return ReloadResult(True, stats.version, diff.summary())
        added = target.swap(policy, diff)
        stats.version += 1
        stats.loaded_at = time.time()
        fields: dict[str, Any] = {"source": source, "version": stats.version}
        fields.update({k: ",".join(v) for k, v in diff.summary().items() if v})
        log.warning("policy reloaded", extra={"fields": fields})
        if diff.pools_or_auth:
            await target.follow(added)
        return ReloadResult(True, stats.version, diff.summary())
