"""Load a policy file, reporting every problem as `FILE:LINE: dotted.path: message`.

YAML is composed into nodes first so that each value keeps the line it came from; pydantic's error
locations are then mapped back to those lines (a missing key points at its parent).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gateway.config.checks import Loc, cross_field_errors
from gateway.config.models import BASE_DIR, RESOLVE, Policy


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int
    path: str
    message: str
    # Only when checking without the environment: a value written with `${NAME}` that could
    # not be checked without it (a note, not a failure: `--resolve` checks it).
    unchecked: bool = False

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}: {self.message}"


class PolicyError(Exception):
    """A policy that cannot be used; `problems` holds every error found, in file order."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(problems, key=lambda p: p.line)
        super().__init__("\n".join(str(p) for p in self.problems))


def load_policy(path: str | Path, resolve: bool = True) -> Policy:
    """Read and validate one policy file; raises PolicyError. `resolve=False`: checked without
    the environment or the secrets it names (see `parse_policy`)."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([Problem(name, 0, "(file)", f"cannot read: {exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise PolicyError([Problem(name, 0, "(file)", "cannot read: not UTF-8 text")]) from None
    return parse_policy(text, name, Path(path).absolute().parent, resolve)


def parse_policy(
    text: str, filename: str = "<policy>", base_dir: Path | None = None, resolve: bool = True
) -> Policy:
    """Validate policy text; raises PolicyError listing every problem. Relative file paths in
    it (CA bundles, secrets) are taken from `base_dir`, the policy file's folder when it was
    read from one.

    `resolve=False` checks the file alone, as a CI pipeline can: a `${NAME}` reference stands
    for the name itself (its default when it has one), and the secrets and CA files it names
    are not read. The policy it returns is for checking only: it holds no secret."""
    data, lines, problems, unresolved = _compose(text, filename, resolve)
    if problems:
        raise PolicyError(problems)
    context: dict[str, object] = {RESOLVE: resolve}
    if base_dir is not None:
        context[BASE_DIR] = str(base_dir)
    try:
        policy = Policy.model_validate(data, context=context)
    except ValidationError as exc:
        errors = _without_consequences(exc.errors())
        raise PolicyError(
            [
                _unresolved_hint(_problem_from_pydantic(err, lines, filename), err, unresolved)
                for err in errors
            ]
        ) from None
    cross = cross_field_errors(policy)
    if cross:
        raise PolicyError(
            [_unchecked(_problem(loc, msg, lines, filename), loc, unresolved) for loc, msg in cross]
        )
    return policy


def _unresolved_hint(problem: Problem, err: Any, unresolved: dict[Loc, list[str]]) -> Problem:
    loc: Loc = tuple(part for part in err["loc"] if part != "[key]")
    return _unchecked(problem, loc, unresolved)


def _unchecked(problem: Problem, loc: Loc, unresolved: dict[Loc, list[str]]) -> Problem:
    """A problem in a value written with `${NAME}`, checked without the environment, is not
    one: the value could not be checked (a note that says so, not the placeholder's error)."""
    names = unresolved.get(loc)
    if not names:
        return problem
    refs = ", ".join(f"${{{name}}}" for name in names)
    message = f"not checked: the value holds {refs} (check with --resolve to use the environment)"
    return Problem(problem.file, problem.line, problem.path, message, unchecked=True)


# --- YAML with line numbers ---------------------------------------------------------------


_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class _Builder:
    def __init__(self, filename: str, resolve: bool = True) -> None:
        self.filename = filename
        self.resolve = resolve
        self.lines: dict[Loc, int] = {}
        self.problems: list[Problem] = []
        self.unresolved: dict[Loc, list[str]] = {}  # values that hold a reference not resolved
        self._scalars = yaml.SafeLoader("")

    def build(self, node: yaml.Node, loc: Loc) -> Any:
        if isinstance(node, yaml.MappingNode):
            written = {id(key) for key, _ in node.value if key.tag != _MERGE_TAG}
            try:
                # Merge keys (`<<: *defaults`) come first; keys written here override them.
                self._scalars.flatten_mapping(node)
            except yaml.YAMLError as exc:
                self._fail(node, loc, f"invalid merge: {getattr(exc, 'problem', exc)}")
                return {}
            result: dict[Any, Any] = {}
            written_at: dict[str, int] = {}
            for key_node, value_node in node.value:
                # Keys are taken verbatim: YAML 1.1 would read `on:` (retries.on) as True.
                if not isinstance(key_node, yaml.ScalarNode):
                    self._fail(key_node, loc, "keys must be plain strings")
                    continue
                key = key_node.value
                child: Loc = (*loc, key)
                line = key_node.start_mark.line + 1
                if id(key_node) in written:
                    if key in written_at:
                        self._fail(
                            key_node, child, f"duplicate key (first at line {written_at[key]})"
                        )
                        continue
                    written_at[key] = line
                self.lines[child] = line
                result[key] = self.build(value_node, child)
            return result
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                child = (*loc, index)
                self.lines[child] = item.start_mark.line + 1
                items.append(self.build(item, child))
            return items
        try:
            value = self._scalars.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError) as exc:
            self._fail(node, loc, f"invalid value: {getattr(exc, 'problem', None) or exc}")
            return None
        if isinstance(value, str) and "${" in value:
            return self._expand(node, loc, value)
        if (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and isinstance(node, yaml.ScalarNode)
            and node.style is None
            and ":" in node.value
        ):
            # YAML 1.1 reads 1:30 as the base-60 number 90: almost never what was meant.
            self._fail(
                node,
                loc,
                f"{node.value!r} reads as the number {value}; write it with a unit, such as 90s",
            )
            return None
        return value

    def _expand(self, node: yaml.Node, loc: Loc, value: str) -> str | None:
        """`${NAME}` and `${NAME:-default}` in a string value, from the environment: one
        ConfigMap for every pod, each sidecar naming its own instance (`${POD_NAME}`), secrets
        such as a Redis password kept out of the file. Only whole string values are expanded,
        after YAML parsing, so a variable's value can never change the file's structure."""
        missing: list[str] = []

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if not self.resolve:
                # Checked alone: the reference stands for its default, else for "1", which
                # most places accept (a name, a host, a port, a number, a password); a value
                # that then fails is reported as not checked.
                if default is None:
                    self.unresolved.setdefault(loc, []).append(name)
                    return "1"
                return default
            found = os.environ.get(name)
            if found is None or (found == "" and default is not None):
                if default is None:
                    missing.append(name)
                    return ""
                return default
            return found

        expanded = _ENV_REFERENCE.sub(substitute, value)
        if missing:
            names = ", ".join(missing)
            self._fail(
                node,
                loc,
                f"environment variable {names} is not set (or give a default: ${{NAME:-value}})",
            )
            return None
        if "${" in _ENV_REFERENCE.sub("", value):
            self._fail(node, loc, "malformed ${...}: write ${NAME} or ${NAME:-default}")
            return None
        return expanded

    def _fail(self, node: yaml.Node, loc: Loc, message: str) -> None:
        self.problems.append(
            Problem(self.filename, node.start_mark.line + 1, _dotted(loc), message)
        )


def _compose(
    text: str, filename: str, resolve: bool = True
) -> tuple[Any, dict[Loc, int], list[Problem], dict[Loc, list[str]]]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        message = str(exc.problem or exc)
        if exc.context and exc.context_mark and exc.context_mark is not mark:
            message += f" ({exc.context} at line {exc.context_mark.line + 1})"
        return None, {}, [Problem(filename, line, "(yaml)", message)], {}
    except yaml.YAMLError as exc:
        return None, {}, [Problem(filename, 0, "(yaml)", str(exc))], {}
    if root is None:
        return None, {}, [Problem(filename, 1, "(root)", "the policy is empty")], {}
    if not isinstance(root, yaml.MappingNode):
        line = root.start_mark.line + 1
        return None, {}, [Problem(filename, line, "(root)", "the policy must be a mapping")], {}
    builder = _Builder(filename, resolve)
    try:
        data = builder.build(root, ())
    except yaml.YAMLError as exc:
        return None, {}, [Problem(filename, 0, "(yaml)", str(exc))], {}
    builder.lines[()] = root.start_mark.line + 1
    return data, builder.lines, builder.problems, builder.unresolved


# --- mapping validation errors back to lines ------------------------------------------------


def _without_consequences(errors: list[Any]) -> list[Any]:
    """Drop a list's "too short" error when its items failed: the items' errors say why."""
    kept = []
    for err in errors:
        loc = tuple(err["loc"])
        if err["type"] == "too_short" and any(
            len(other["loc"]) > len(loc) and tuple(other["loc"][: len(loc)]) == loc
            for other in errors
        ):
            continue
        kept.append(err)
    return kept


def _models_in(annotation: object) -> Iterable[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in getattr(annotation, "__args__", ()):
        yield from _models_in(arg)


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The policy model that the mapping at `loc` is validated against."""
    model: type[BaseModel] | None = Policy
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int) or part not in model.model_fields:
            continue  # a list index or a dict key (pool name): same element model
        found = list(_models_in(model.model_fields[part].annotation))
        model = found[0] if found else None
    return model


def _where_valid(key: str, model: type[BaseModel] = Policy, path: str = "") -> list[str]:
    """Dotted places (in model terms) where `key` is a valid key."""
    places = []
    for name, field in model.model_fields.items():
        here = f"{path}.{name}" if path else name
        if name == key:
            places.append(path or "the top level")
        for sub in _models_in(field.annotation):
            places.extend(_where_valid(key, sub, here))
    return places


def _unknown_key_message(loc: Loc) -> str:
    key = str(loc[-1]) if loc else ""
    model = _model_at(loc[:-1])
    allowed = sorted(model.model_fields) if model else []
    guess = difflib.get_close_matches(key, allowed, n=1)
    if guess:
        return f"unknown key {key!r} (did you mean {guess[0]!r}?)"
    elsewhere = _where_valid(key)
    if elsewhere:
        return f"{key!r} is not valid here; it belongs under {elsewhere[0]}"
    return f"unknown key {key!r}" + (f"; valid keys: {', '.join(allowed)}" if allowed else "")


def _problem_from_pydantic(err: Any, lines: dict[Loc, int], filename: str) -> Problem:
    loc: Loc = tuple(part for part in err["loc"] if part != "[key]")
    kind = err["type"]
    message = str(err["msg"]).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        message = _unknown_key_message(loc)
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
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _PLAIN_KEY.match(part):
            out += f"[{part!r}]"  # keeps the path one token even for a name with spaces
        else:
            out += f".{part}" if out else part
    return out or "(root)"


_MERGE_TAG = "tag:yaml.org,2002:merge"
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")
