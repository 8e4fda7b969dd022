"""One owner per piece of state: an instance's fields (and those of the parts it owns: its
engine's pacing, its price, its last stall) and its breaker's are assigned only in the module
that defines them. Every other module reads them and calls their methods, so a rule such as
"this instance takes traffic" reads fields that one place keeps consistent.

Read from the source (the AST), since Python cannot tell at runtime who assigns a field
without a cost on every write."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each owned class, by the module that defines it (the one that may assign its fields).
OWNED = {
    "gateway/upstream/instance.py": "InstanceState",
    "gateway/upstream/engine_pacing.py": "EnginePacing",
    "gateway/upstream/price.py": "Price",
    "gateway/upstream/stall.py": "Stall",
    "gateway/core/breaker.py": "BreakerState",
}
# Fields whose names other classes' fields share, which a check by name cannot tell apart: a
# breaker's `instance` (its instance's name, set once when it is made) is also an `Attempt`'s.
UNCHECKED = {"BreakerState": frozenset({"instance"})}
# The gateway's own modules (the load tools' classes share field names with these).
SCANNED = ("gateway",)


def slots_of(module: Path, name: str) -> frozenset[str]:
    """The fields of class `name` in `module`: its `__slots__` (each owned class has them)."""
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and isinstance(item.targets[0], ast.Name)
                    and item.targets[0].id == "__slots__"
                    and isinstance(item.value, ast.Tuple)
                ):
                    return frozenset(
                        elt.value
                        for elt in item.value.elts
                        if isinstance(elt, ast.Constant) and isinstance(elt.value, str)
                    )
    raise AssertionError(f"{module}: no class {name} with a __slots__ tuple")


def _assigned(tree: ast.AST) -> Iterator[tuple[ast.Attribute, int]]:
    """Every attribute an assignment, augmented assignment or `del` writes."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store | ast.Del):
                    yield sub, sub.lineno


def violations(source: str, where: str, fields: dict[str, frozenset[str]]) -> list[str]:
    """Where `source` (a module other than the owners') assigns an owned class's field, or
    subclasses one. `fields`: each owned class's fields by its name. Assignments through
    `self` are another class's own (a subclass would be caught by its base)."""
    tree = ast.parse(source)
    found: list[str] = []
    owned_names = frozenset().union(*fields.values())
    for attribute, line in _assigned(tree):
        if attribute.attr not in owned_names:
            continue
        base = attribute.value
        if isinstance(base, ast.Name) and base.id == "self":
            continue
        found.append(f"{where}:{line}: assigns {ast.unparse(attribute)}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in owned_names:
                found.append(f"{where}:{node.lineno}: setattr of {name.value!r}")
        if isinstance(node, ast.ClassDef):
            for base_class in node.bases:
                if isinstance(base_class, ast.Name) and base_class.id in fields:
                    found.append(f"{where}:{node.lineno}: subclasses {base_class.id}")
    return found


def owned_fields() -> dict[str, frozenset[str]]:
    return {
        name: slots_of(ROOT / module, name) - UNCHECKED.get(name, frozenset())
        for module, name in OWNED.items()
    }


def test_only_the_owners_assign_their_fields() -> None:
    fields = owned_fields()
    found: list[str] = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative in OWNED:
                continue
            found.extend(violations(path.read_text(), relative, fields))
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "instance.in_flight += 1",
        "inst.not_before = now + pause",
        "self.instance.progress_at = arrived",
        "call.instance.engine.saturated = True",
        "instance.price.penalty = None",
        "pool.instances[0].ghosts = 0",
        "breaker.lease_until = 0.0",
        "inst.breaker.state = ADMITTING",
        "del inst.budget",
        "a.in_flight = b.in_flight = 4",
        "setattr(instance, 'races_lost', 0)",
        "class Patched(InstanceState): pass",
    ],
)
def test_an_assignment_from_elsewhere_is_caught(line: str) -> None:
    assert violations(line, "elsewhere.py", owned_fields()), line


@pytest.mark.parametrize(
    "line",
    [
        "self.in_flight = 0",  # a class of its own with a field of that name
        "instance.attempt_started(tokens)",
        "seen = instance.in_flight + 1",
        "call.instance = picked",
    ],
)
def test_reads_calls_and_own_fields_are_not(line: str) -> None:
    assert not violations(line, "elsewhere.py", owned_fields()), line


def test_every_owned_class_keeps_its_fields_in_slots() -> None:
    """The check knows a class's fields from its `__slots__`: an owned class without them (a
    field added in `__init__` only) would escape it."""
    for module, name in OWNED.items():
        assert slots_of(ROOT / module, name)
