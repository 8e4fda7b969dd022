"""uv.lock read as an installer reads it: which distributions, at which versions, installing the
project with some extras puts into an environment (`closure`), and what an environment holds
(`installed`), for the packaging and image tests to compare."""

from __future__ import annotations

import importlib.metadata
import re
import sysconfig
import tomllib
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from packaging.markers import Marker, default_environment

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "uv.lock"
PROJECT = "gateway"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def packages() -> list[dict[str, Any]]:
    return list(tomllib.loads(LOCK.read_text())["package"])


def versions(name: str) -> list[str]:
    """Every version the lock holds of a distribution (two where Python versions fork)."""
    return [p["version"] for p in packages() if p["name"] == canonical(name)]


def _applies(marker: str | None, environment: Mapping[str, str]) -> bool:
    return marker is None or Marker(marker).evaluate(dict(environment))


def _package(name: str, version: str | None, environment: Mapping[str, str]) -> dict[str, Any]:
    """The lock's entry for a dependency edge: by its version when the edge names one, else the
    only entry of that name whose resolution markers hold here."""
    candidates = [p for p in packages() if p["name"] == name]
    if version is not None:
        candidates = [p for p in candidates if p["version"] == version]
    if len(candidates) > 1:
        candidates = [
            p
            for p in candidates
            if any(_applies(m, environment) for m in p.get("resolution-markers", [None]))
        ]
    (package,) = candidates
    return package


def closure(extras: Iterable[str], environment: Mapping[str, str] | None = None) -> dict[str, str]:
    """Distribution name -> version: what the project with `extras` installs, per the lock, in
    `environment` (this interpreter's markers by default). The project itself included."""
    env: Mapping[str, str] = environment or default_environment()
    found: dict[str, str] = {}
    seen: set[tuple[str, str, frozenset[str]]] = set()
    todo: list[tuple[str, str | None, frozenset[str]]] = [(PROJECT, None, frozenset(extras))]
    while todo:
        name, version, wanted = todo.pop()
        package = _package(name, version, env)
        key = (name, package["version"], wanted)
        if key in seen:
            continue
        seen.add(key)
        found[name] = package["version"]
        edges = list(package.get("dependencies", []))
        for extra in wanted:
            edges += package.get("optional-dependencies", {}).get(extra, [])
        for edge in edges:
            if _applies(edge.get("marker"), env):
                todo.append((edge["name"], edge.get("version"), frozenset(edge.get("extra", []))))
    return found


def installed(site_packages: Path | None = None) -> dict[str, str]:
    """Distribution name -> version, of an environment's site-packages (this interpreter's by
    default; not sys.path, where a source checkout's `*.egg-info` would count as well)."""
    path = site_packages or Path(sysconfig.get_paths()["purelib"])
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=[str(path)]):
        name = canonical(dist.metadata["Name"])
        assert name not in found, f"{name} installed twice: {found[name]}, {dist.version}"
        found[name] = dist.version
    return found


def project_requirements() -> list[str]:
    """What the lock recorded of pyproject.toml's requirements (`requires-dist`), as PEP 508."""
    (project,) = [p for p in packages() if p["name"] == PROJECT]
    out = []
    for entry in project["metadata"]["requires-dist"]:
        extras = f"[{','.join(entry['extras'])}]" if entry.get("extras") else ""
        marker = f"; {entry['marker']}" if entry.get("marker") else ""
        out.append(f"{entry['name']}{extras}{entry.get('specifier', '')}{marker}")
    return out
