"""Loading a run directory: the scenario, and per mode its meta, events and ledger columns.

The ledger is streamed once, one Record at a time, into flat columns (one float or small int
per request and field) so a run of millions of requests never holds its Records at once.
Everything is read defensively: a missing file, a malformed line or a missing key is never
fatal; what was skipped is counted and shown in the report.
"""

from __future__ import annotations

import contextlib
import json
import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml

from loadtests.ledger import Event, Record

KNOWN_MODES = ("direct", "gateway")
NO_INSTANCE = "(none)"  # records that no instance answered (e.g. the gateway's own 503)
MAX_REASONS = 500  # distinct failure reasons kept per mode; the rest are lumped together

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


@dataclass
class ModeData:
    """One mode's run: meta, fault events and the ledger as columns (index = record)."""

    name: str
    meta: dict[str, Any]
    events: list[Event]
    models: list[str]  # model index -> name
    instances: list[str]  # instance index -> name (NO_INSTANCE included when seen)
    t: Floats
    seq: Ints  # the request's order of sending: the same request in every mode
    total: Floats  # NaN when the record has none
    ttfb: Floats  # NaN when the record has none
    lag: Floats
    status: Ints
    attempts: Ints  # 0 when the record has none
    model: Ints
    instance: Ints
    ok: Bools
    stream: Bools
    oom: Bools
    proper: Bools
    error_event: Bools
    reasons: Counter[str] = field(default_factory=Counter)
    skipped_records: int = 0
    skipped_events: int = 0
    ledger_found: bool = False
    events_found: bool = False
    meta_found: bool = False

    @property
    def count(self) -> int:
        return int(self.t.size)

    def instance_index(self, name: str) -> int | None:
        try:
            return self.instances.index(name)
        except ValueError:
            return None


@dataclass
class Run:
    directory: Path
    scenario: dict[str, Any]
    modes: dict[str, ModeData]  # in display order: direct, gateway, then any other
    date: datetime | None


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_scenario(run_dir: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load((run_dir / "scenario.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def read_events_tolerant(path: Path) -> tuple[list[Event], int]:
    """Like `ledger.read_events`, but a malformed line (a run killed mid-write) is skipped."""
    events: list[Event] = []
    skipped = 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            event = Event.from_json(line)
            event.t = float(event.t)
            if not isinstance(event.detail, dict):
                event.detail = {"value": event.detail}
            events.append(event)
        except (ValueError, KeyError, TypeError, AttributeError):
            skipped += 1
    events.sort(key=lambda e: e.t)
    return events, skipped


def _reason(record: Record) -> str:
    if record.status == 0:
        text = (record.error or "no response").split(":", 1)[0].strip()[:60]
        return f"no response: {text or 'unknown'}"
    if record.status == 200:
        if record.error_event:
            return "200 with a stream error event"
        return "200 truncated / improper body"
    return f"HTTP {record.status}" + (" (OOM)" if record.oom else "")


def _float_or_nan(value: Any) -> float:
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def load_mode(name: str, directory: Path) -> ModeData:
    meta_path = directory / "meta.json"
    events_path = directory / "events.jsonl"
    ledger_path = directory / "ledger.jsonl"
    meta = _read_json_object(meta_path)
    events, skipped_events = read_events_tolerant(events_path)

    models: dict[str, int] = {}
    instances: dict[str, int] = {}
    # Seed instance order from meta so the tables and charts follow the scenario's order.
    declared = meta.get("instances")
    if isinstance(declared, dict):
        for inst in declared:
            instances.setdefault(str(inst), len(instances))

    col_f: dict[str, array[float]] = {k: array("d") for k in ("t", "total", "ttfb", "lag")}
    col_i: dict[str, array[int]] = {
        k: array("q") for k in ("seq", "status", "attempts", "model", "inst")
    }
    col_b: dict[str, array[int]] = {
        k: array("b") for k in ("ok", "stream", "oom", "proper", "error_event")
    }
    reasons: Counter[str] = Counter()
    skipped = 0
    if ledger_path.exists():
        with ledger_path.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if not line.strip():
                    continue
                try:
                    rec = Record.from_json(line)
                    t = float(rec.t)
                    status = int(rec.status or 0)
                    int(rec.seq)
                except (ValueError, TypeError, AttributeError):
                    skipped += 1
                    continue
                model = str(rec.model)
                inst = NO_INSTANCE if rec.instance is None else str(rec.instance)
                ok = status == 200 and bool(rec.proper)
                col_f["t"].append(t)
                col_f["total"].append(_float_or_nan(rec.total))
                col_f["ttfb"].append(_float_or_nan(rec.ttfb))
                col_f["lag"].append(_float_or_nan(rec.lag))
                col_i["seq"].append(int(rec.seq))
                col_i["status"].append(status)
                col_i["attempts"].append(int(rec.attempts) if rec.attempts else 0)
                col_i["model"].append(models.setdefault(model, len(models)))
                col_i["inst"].append(instances.setdefault(inst, len(instances)))
                col_b["ok"].append(ok)
                col_b["stream"].append(bool(rec.stream))
                col_b["oom"].append(bool(rec.oom))
                col_b["proper"].append(bool(rec.proper))
                col_b["error_event"].append(bool(rec.error_event))
                if not ok:
                    reason = _reason(rec)
                    if reason in reasons or len(reasons) < MAX_REASONS:
                        reasons[reason] += 1
                    else:
                        reasons["other"] += 1

    def floats(key: str) -> Floats:
        return np.array(col_f[key], dtype=np.float64)

    def ints(key: str) -> Ints:
        return np.array(col_i[key], dtype=np.int64)

    def bools(key: str) -> Bools:
        return np.array(col_b[key], dtype=np.bool_)

    return ModeData(
        name=name,
        meta=meta,
        events=events,
        models=list(models),
        instances=list(instances),
        t=floats("t"),
        seq=ints("seq"),
        total=floats("total"),
        ttfb=floats("ttfb"),
        lag=floats("lag"),
        status=ints("status"),
        attempts=ints("attempts"),
        model=ints("model"),
        instance=ints("inst"),
        ok=bools("ok"),
        stream=bools("stream"),
        oom=bools("oom"),
        proper=bools("proper"),
        error_event=bools("error_event"),
        reasons=reasons,
        skipped_records=skipped,
        skipped_events=skipped_events,
        ledger_found=ledger_path.exists(),
        events_found=events_path.exists(),
        meta_found=meta_path.exists(),
    )


def _mode_dirs(run_dir: Path) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    names = [m for m in KNOWN_MODES if (run_dir / m).is_dir()]
    if run_dir.is_dir():
        extra = sorted(
            p.name
            for p in run_dir.iterdir()
            if p.is_dir()
            and p.name not in KNOWN_MODES
            and ((p / "ledger.jsonl").exists() or (p / "meta.json").exists())
        )
        names.extend(extra)
    for name in names:
        found.append((name, run_dir / name))
    return found


def _run_date(run_dir: Path, modes: dict[str, ModeData]) -> datetime | None:
    for mode in modes.values():
        for key in ("started_at", "date", "start_time"):
            value = mode.meta.get(key)
            if isinstance(value, int | float) and value > 0:
                return datetime.fromtimestamp(value, UTC)
            if isinstance(value, str):
                try:
                    parsed = datetime.fromisoformat(value)
                except ValueError:
                    continue
                return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    times = []
    for name in modes:
        for file in ("ledger.jsonl", "meta.json"):
            with contextlib.suppress(OSError):
                times.append((run_dir / name / file).stat().st_mtime)
    return datetime.fromtimestamp(min(times), UTC) if times else None


def load_run(run_dir: Path) -> Run:
    modes = {name: load_mode(name, path) for name, path in _mode_dirs(run_dir)}
    return Run(run_dir, read_scenario(run_dir), modes, _run_date(run_dir, modes))
