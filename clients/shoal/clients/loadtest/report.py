"""Results out: a table on the terminal, CSV with perf_analyzer's column names, JSON, and a plot."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

from shoal.clients.loadtest import plot
from shoal.clients.loadtest.measure import StepResult

# perf_analyzer's columns, in its order (µs), so existing spreadsheets read our files.
PERF_ANALYZER_COLUMNS = [
    "Inferences/Second",
    "Client Send",
    "Network+Server Send/Recv",
    "Server Queue",
    "Server Compute Input",
    "Server Compute Infer",
    "Server Compute Output",
    "Client Recv",
    "p50 latency",
    "p90 latency",
    "p95 latency",
    "p99 latency",
]
EXTRA_COLUMNS = ["Avg latency", "Max latency", "Requests", "Errors", "Stable"]


def step_label(step: StepResult) -> str:
    return f"rate {step.request_rate:g}/s" if step.request_rate else f"concurrency {step.concurrency}"


def csv_row(step: StepResult) -> dict[str, object]:
    server = step.server_us or {}
    phases = sum(server.get(k, 0.0) for k in ("queue", "compute_input", "compute_infer", "compute_output"))
    latency = step.latency_us
    row: dict[str, object] = {
        "Request Rate" if step.request_rate else "Concurrency": step.request_rate or step.concurrency,
        "Inferences/Second": round(step.throughput, 2),
        # Requests are serialized once before the run and replies are not decoded: no client cost.
        "Client Send": 0,
        "Network+Server Send/Recv": round(max(0.0, latency["avg"] - phases)) if server else "",
        "Server Queue": round(server.get("queue", 0)) if server else "",
        "Server Compute Input": round(server.get("compute_input", 0)) if server else "",
        "Server Compute Infer": round(server.get("compute_infer", 0)) if server else "",
        "Server Compute Output": round(server.get("compute_output", 0)) if server else "",
        "Client Recv": 0,
        "p50 latency": round(latency["p50"]),
        "p90 latency": round(latency["p90"]),
        "p95 latency": round(latency["p95"]),
        "p99 latency": round(latency["p99"]),
        "Avg latency": round(latency["avg"]),
        "Max latency": round(latency["max"]),
        "Requests": step.requests,
        "Errors": ";".join(f"{k}={v}" for k, v in sorted(step.errors.items())) or 0,  # 0 as in the table
        "Stable": step.stable,
    }
    return row


def write_csv(steps: list[StepResult], path: Path) -> None:
    rows = [csv_row(step) for step in steps]
    first = "Request Rate" if steps and steps[0].request_rate else "Concurrency"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[first, *PERF_ANALYZER_COLUMNS, *EXTRA_COLUMNS])
        writer.writeheader()
        writer.writerows(rows)


def write_json(steps: list[StepResult], path: Path, settings: dict[str, object]) -> None:
    path.write_text(json.dumps({"settings": settings, "steps": [asdict(s) for s in steps]}, indent=2))


def table_rows(steps: list[StepResult]) -> list[list[str]]:
    rows = []
    for step in steps:
        latency = step.latency_us
        server = step.server_us
        rows.append(
            [
                step_label(step) + (" (interrupted)" if step.interrupted else ""),
                f"{step.throughput:,.1f}",
                *(f"{latency[k] / 1000:.2f}" for k in ("p50", "p90", "p95", "p99", "max")),
                ", ".join(f"{k}: {v}" for k, v in sorted(step.errors.items())) or "0",
                f"{server['queue']:.0f} / {server['compute_infer']:.0f}" if server else "-",
                "yes" if step.stable else "no",
            ]
        )
    return rows


TABLE_HEADER = [
    "step",
    "infer/s",
    "p50 ms",
    "p90 ms",
    "p95 ms",
    "p99 ms",
    "max ms",
    "errors",
    "server queue / infer µs",
    "stable",
]


def curves(steps: list[StepResult]) -> list[plot.Curve]:
    """p50, p90 and p99 against throughput, one point per step; the p99 points carry the step."""
    result = []
    for key, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
        points = tuple(
            plot.Point(
                s.throughput,
                s.latency_us[key] / 1000,
                f"{s.request_rate:g}/s" if s.request_rate else f"c={s.concurrency}",
            )
            for s in steps
        )
        result.append(plot.Curve(key, points, style, annotate=key == "p99"))
    return result


def save_plot(steps: list[StepResult], path: Path, title: str) -> None:
    plot.save(curves(steps), path, title)
