"""The benchmark's report: a plain-text rendering of the recorded figures, and the JSON file.

The text is built from the same dictionary that is written as JSON, so the two never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Data = Mapping[str, Any]


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def _signed(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:+.3f} {unit}"


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Columns sized to fit; the first is left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return indent + "  ".join([first, *rest]).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _throughput(section: Data) -> list[str]:
    runs = section["runs"]
    names = {
        "direct": "direct",
        "nginx": "nginx proxy_pass",
        "bare": "bare ASGI + aiohttp",
        "gateway": "gateway",
    }
    rows = []
    for key, label in names.items():
        run = runs.get(key)
        if run is None:
            rows.append([label, "skipped", "", "", ""])
            continue
        rows.append(
            [
                label,
                _num(run["rps"], 1),
                _num(run["p50_ms"], 3),
                _num(run["p99_ms"], 3),
                _num(run["errors"]),
            ]
        )
    ratios = section["ratios"]
    bar = section["bar"]
    out = [
        f"1. Throughput at fixed concurrency ({section['tool_description']})",
        f"   upstream: {section['upstream']}",
        table(["target", "req/s", "p50 ms", "p99 ms", "errors"], rows),
        f"  gateway / nginx proxy_pass: {_num(ratios['gateway_vs_nginx'], 3)}"
        f"   (bar >= {bar['gateway_vs_nginx_min']:.2f}: {_verdict(bar['met'])})",
        f"  gateway / direct:           {_num(ratios['gateway_vs_direct'], 3)}",
        f"  gateway / bare ASGI + aiohttp proxy (same stack, no resilience): "
        f"{_num(ratios.get('gateway_vs_bare'), 3)}",
    ]
    cpu = section.get("cpu")
    if cpu and cpu["per_proxy"]:
        cpu_rows = [
            [
                names[key],
                _num(run["requests"]),
                _num(run["us_per_request"], 1),
                _num(run["user_us_per_request"], 1),
                _num(run["system_us_per_request"], 1),
            ]
            for key, run in cpu["per_proxy"].items()
        ]
        out += [
            "  CPU time per request (the proxy's processes, utime+stime from /proc, over the "
            "requests of its warm-up and measured runs)",
            table(["proxy", "requests", "us/request", "user", "sys"], cpu_rows),
            f"  gateway CPU per request / nginx's: {_num(cpu['gateway_over_nginx'], 2)}"
            f"   (target <= {cpu['target_us']:g} us: {_verdict(cpu['met'])})",
        ]
    if section.get("note"):
        out.append(f"  note: {section['note']}")
    return out


def _open_loop(section: Data) -> list[str]:
    rows = []
    for key in ("direct", "gateway"):
        run = section["runs"][key]
        lat = run["latency"]
        rows.append(
            [
                key,
                _num(run["sent"]),
                _num(run["errors"]),
                _num(lat["p50_ms"], 3),
                _num(lat["p90_ms"], 3),
                _num(lat["p99_ms"], 3),
                _num(lat["max_ms"], 3),
                _num(run["send_lag"]["p99_ms"], 3),
            ]
        )
    added = section["added"]
    return [
        f"2. Latency at a fixed arrival rate ({section['rate']:g} req/s for "
        f"{section['duration_s']:g} s, open loop, Python/aiohttp)",
        table(
            ["target", "sent", "errors", "p50 ms", "p90 ms", "p99 ms", "max ms", "send lag p99 ms"],
            rows,
        ),
        f"  added by the gateway: p50 {_signed(added['p50_ms'], 'ms')}, "
        f"p99 {_signed(added['p99_ms'], 'ms')}",
    ]


def _stream_rows(label: str, phase: Data) -> list[list[str]]:
    rows = []
    for key in ("direct", "gateway"):
        run = phase[key]
        ttfb = run["ttfb"]
        rows.append(
            [
                label if key == "direct" else "",
                key,
                _num(run["requests"]),
                _num(run["errors"]),
                _num(run["events"]),
                _num(run["http_chunks"]),
                _num(ttfb["p50_ms"], 3),
                _num(ttfb["p99_ms"], 3),
                _num(run["wall_s"], 2),
            ]
        )
    return rows


def _streaming(section: Data) -> list[str]:
    seq, conc, cpu = section["sequential"], section["concurrent"], section["cpu"]
    bare = cpu["bare_proxy"]
    rows = _stream_rows("one at a time", seq) + _stream_rows(
        f"{conc['gateway']['concurrency']} concurrent", conc
    )
    target = section["added_ttfb_target_ms"]
    cpu_rows = [
        [
            name,
            _num(phase["http_chunks"]),
            _num(phase["events"]),
            _num(phase["cpu_ms"], 1),
            _num(phase["us_per_chunk"], 2),
            _num(phase["user_us_per_chunk"], 2),
            _num(phase["system_us_per_chunk"], 2),
            _num(phase["us_per_event"], 2),
        ]
        for name, phase in cpu["phases"].items()
    ]
    return [
        f"3. Streaming through the gateway (fake backend: ttft 0, "
        f"{section['per_token_s'] * 1000:g} ms/token, max_tokens {section['max_tokens']})",
        table(
            [
                "phase",
                "target",
                "streams",
                "errors",
                "SSE events",
                "HTTP chunks",
                "TTFB p50 ms",
                "TTFB p99 ms",
                "wall s",
            ],
            rows,
        ),
        f"  added TTFB, one at a time: p50 {_signed(seq['added_ttfb_p50_ms'], 'ms')}, "
        f"p99 {_signed(seq['added_ttfb_p99_ms'], 'ms')}"
        f"   (target p50 <= {target:g} ms: {_verdict(seq['met'])})",
        f"  added TTFB, concurrent:    p50 {_signed(conc['added_ttfb_p50_ms'], 'ms')}, "
        f"p99 {_signed(conc['added_ttfb_p99_ms'], 'ms')}",
        "",
        "  Gateway CPU time per relayed chunk (utime+stime from /proc, "
        f"tick {cpu['cpu_tick_s'] * 1000:g} ms; "
        f"idle {cpu['idle_cpu_ms_per_s']:.2f} ms/s subtracted)",
        table(
            [
                "phase",
                "chunks",
                "SSE events",
                "CPU ms",
                "us/chunk",
                "user",
                "sys",
                "us/event",
            ],
            cpu_rows,
        ),
        "  (one at a time, each chunk wakes an idle process, which also costs the backend about"
        " as much; the sustained phase keeps the loop busy: the per-chunk cost proper)",
        f"  per relayed chunk (sustained phase): {_num(cpu['us_per_chunk'], 2)} us"
        f"   (target <= {cpu['target_us']:g} us: {_verdict(cpu['met'])})",
        f"  the same streams through a bare ASGI + aiohttp proxy (no resilience), same core: "
        f"{_num(bare['us_per_chunk'], 2)} us/chunk (user {_num(bare['user_us_per_chunk'], 2)},"
        f" sys {_num(bare['system_us_per_chunk'], 2)}); gateway / bare: "
        f"{_num(cpu['over_bare'], 2)}",
        _nginx_chunks(cpu),
        f"  stream resume on vs off, the same long streams in alternate rounds (medians): "
        f"{_num(cpu.get('resume_on_us_per_chunk'), 2)} vs "
        f"{_num(cpu.get('resume_off_us_per_chunk'), 2)} us/chunk; resume costs "
        f"{_pct(cpu.get('resume_cost'))} per chunk (goal <= 10 %)",
    ]


def _nginx_chunks(cpu: Data) -> str:
    nginx = cpu.get("nginx")
    if not nginx:
        return "  the same streams through nginx proxy_pass: skipped (no nginx)"
    return (
        f"  the same streams through nginx proxy_pass (proxy_buffering off), same core: "
        f"{_num(nginx['us_per_chunk'], 2)} us/chunk (user {_num(nginx['user_us_per_chunk'], 2)},"
        f" sys {_num(nginx['system_us_per_chunk'], 2)}); gateway / nginx: "
        f"{_num(cpu.get('over_nginx'), 2)}"
    )


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f} %"


def render_memory(section: Data | None) -> list[str]:
    if not section:
        return []
    rows = [
        [
            name,
            _num(run["streams"]),
            _num(run["tokens"]),
            _num(run["errors"]),
            _num(run["baseline_mib"], 1),
            _num(run["peak_mib"], 1),
            _num(run["kib_per_stream"], 1),
        ]
        for name, run in (
            ("resume on", section["resume_on"]),
            ("resume off", section["resume_off"]),
        )
    ]
    return [
        "4. Memory per open stream (a fresh gateway each; resident memory at the peak of the "
        "streams, above the idle baseline)",
        table(
            ["gateway", "streams", "tokens", "errors", "idle MiB", "peak MiB", "KiB/stream"], rows
        ),
    ]


def render(data: Data) -> str:
    meta = data["meta"]
    lines = [
        "Gateway overhead benchmark",
        f"  {meta['started_at']}, {meta['cpu_placement']}",
        "",
        *_throughput(data["throughput"]),
        "",
        *_open_loop(data["open_loop"]),
        "",
        *_streaming(data["streaming"]),
        "",
        *render_memory(data.get("memory")),
    ]
    return "\n".join(lines) + "\n"


def write_json(path: Path, data: Data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
