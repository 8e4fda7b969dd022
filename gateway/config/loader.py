"""Load a policy file, reporting every problem as `FILE:LINE: dotted.path: message`.

YAML is composed into nodes first so that each value keeps the line it came from; pydantic's error
locations are then mapped back to those lines (a missing key points at its parent).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gateway.config.checks import Loc, cross_field_errors
from gateway.config.models import Policy


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}: {self.message}"


class PolicyError(Exception):
    """A policy that cannot be used; `problems` holds every error found, in file order."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(problems, key=lambda p: p.line)
        super().__init__("\n".join(str(p) for p in self.problems))


def load_policy(path: str | Path) -> Policy:
    """Read and validate one policy file; raises PolicyError."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError([Problem(name, 0, "(file)", f"cannot read: {exc}")]) from None
    return parse_policy(text, name)


def parse_policy(text: str, filename: str = "<policy>") -> Policy:
    """Validate policy text; raises PolicyError listing every problem."""
    data, lines, problems = _compose(text, filename)
    if problems:
        raise PolicyError(problems)
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(
            [_problem_from_pydantic(err, lines, filename) for err in exc.errors()]
        ) from None
    cross = cross_field_errors(policy)
    if cross:
        raise PolicyError([_problem(loc, msg, lines, filename) for loc, msg in cross])
    return policy


# --- YAML with line numbers ---------------------------------------------------------------


class _Builder:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.lines: dict[Loc, int] = {}
        self.problems: list[Problem] = []
        self._scalars = yaml.SafeLoader("")

    def build(self, node: yaml.Node, loc: Loc) -> Any:
        if isinstance(node, yaml.MappingNode):
            result: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                # Keys are taken verbatim: YAML 1.1 would read `on:` (retries.on) as True.
                if not isinstance(key_node, yaml.ScalarNode):
                    self._fail(key_node, loc, "keys must be plain strings")
                    continue
                key = key_node.value
                child: Loc = (*loc, key)
                if key in result:
                    self._fail(key_node, child, "duplicate key")
                    continue
                self.lines[child] = key_node.start_mark.line + 1
                result[key] = self.build(value_node, child)
            return result
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                child = (*loc, index)
                self.lines[child] = item.start_mark.line + 1
                items.append(self.build(item, child))
            return items
        return self._scalars.construct_object(node, deep=True)

    def _fail(self, node: yaml.Node, loc: Loc, message: str) -> None:
        self.problems.append(
            Problem(self.filename, node.start_mark.line + 1, _dotted(loc), message)
        )


def _compose(text: str, filename: str) -> tuple[Any, dict[Loc, int], list[Problem]]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        return None, {}, [Problem(filename, line, "(yaml)", f"{exc.problem or exc}")]
    except yaml.YAMLError as exc:
        return None, {}, [Problem(filename, 0, "(yaml)", str(exc))]
    if root is None:
        return None, {}, [Problem(filename, 1, "(root)", "the policy is empty")]
    if not isinstance(root, yaml.MappingNode):
        line = root.start_mark.line + 1
        return None, {}, [Problem(filename, line, "(root)", "the policy must be a mapping")]
    builder = _Builder(filename)
    try:
        data = builder.build(root, ())
    except yaml.YAMLError as exc:
        return None, {}, [Problem(filename, 0, "(yaml)", str(exc))]
    builder.lines[()] = root.start_mark.line + 1
    return data, builder.lines, builder.problems


# --- mapping validation errors back to lines ------------------------------------------------


def _all_field_names(model: type[BaseModel], seen: set[type[BaseModel]] | None = None) -> set[str]:
    seen = seen if seen is not None else set()
    if model in seen:
        return set()
    seen.add(model)
    names = set(model.model_fields)
    for field in model.model_fields.values():
        for sub in _models_in(field.annotation):
            names |= _all_field_names(sub, seen)
    return names


def _models_in(annotation: object) -> Iterable[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in getattr(annotation, "__args__", ()):
        yield from _models_in(arg)


_KNOWN_KEYS = sorted(_all_field_names(Policy))


def _problem_from_pydantic(err: Any, lines: dict[Loc, int], filename: str) -> Problem:
    loc: Loc = tuple(part for part in err["loc"] if part != "[key]")
    kind = err["type"]
    message = str(err["msg"]).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        key = str(loc[-1]) if loc else ""
        guess = difflib.get_close_matches(key, _KNOWN_KEYS, n=1)
        message = f"unknown key {key!r}" + (f" (did you mean {guess[0]!r}?)" if guess else "")
    elif kind == "missing":
        message = "missing required key"
    elif kind == "too_short":
        message = f"needs at least {err['ctx']['min_length']} item(s)"
    return _problem(loc, message, lines, filename)


def _problem(loc: Loc, message: str, lines: dict[Loc, int], filename: str) -> Problem:
    # The nearest enclosing key that exists in the file: a missing key points at its parent.
    probe = loc
    while probe and probe not in lines:
        probe = probe[:-1]
    return Problem(filename, lines.get(probe, 1), _dotted(loc), message)


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"
