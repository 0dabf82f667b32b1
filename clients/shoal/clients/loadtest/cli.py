"""``shoal-load``: measure a KServe v2 / Triton model under load, over gRPC or HTTP/REST.

    shoal-load -m simple --concurrency 1:32:x2 --csv out.csv --plot out.png
    shoal-load -m mlp --request-rate 100,200,400 --distribution poisson --max-seconds 60
    shoal-load -i http -u localhost:8000 -m simple --concurrency 1,16

Closed loop (``--concurrency``: N requests always in flight) or open loop
(``--request-rate``: requests/s on a schedule). Each step warms up, then measures windows
until three agree within ``--stability`` (or ``--max-windows`` pass, or ``--request-count``
requests complete); the whole run stops at ``--max-seconds``. Prints a table (live progress
on a terminal), and writes CSV with perf_analyzer's column names, JSON and a plot on request.

Exit status: 0 when every request succeeded; 1 when any failed (the table, CSV and JSON are
still written; a step in which no request succeeded ends the sweep); 130 on Ctrl-C, after
printing and writing what was measured until then; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from shoal.clients.loadtest import http, report
from shoal.clients.loadtest.control import CONTROL_ERRORS, connect
from shoal.clients.loadtest.inputs import InputError, build_inputs, parse_shape, serialize_request
from shoal.clients.loadtest.measure import LoadTester, Settings, StepResult

MAX_STEPS = 1000  # a sweep longer than this is a typo (a tiny step), not a plan


def parse_steps(text: str, integer: bool) -> list[float]:
    """``4``, ``1,2,4``, ``1:8:2`` (start:end:step) or ``1:32:x2`` (start:end:×factor)."""
    convert = int if integer else float
    try:
        if ":" not in text:
            values = [convert(v) for v in text.split(",")]
        else:
            parts = text.split(":")
            if len(parts) not in (2, 3):
                raise ValueError
            start, end = convert(parts[0]), convert(parts[1])
            if not 0 < start <= end < math.inf:  # also refuses nan; bounds the sweep below
                raise ValueError
            step = parts[2] if len(parts) == 3 else "1"
            values = []
            current = start
            if step.startswith("x"):
                factor = float(step[1:])
                if factor <= 1:
                    raise ValueError
                while current <= end and len(values) <= MAX_STEPS:
                    values.append(current)
                    grown = convert(current * factor)
                    current = grown if grown > current else current + 1  # x1.5 from 1 is 2, not 1 forever
            else:
                increment = convert(step)
                if increment <= 0:
                    raise ValueError
                while current <= end and len(values) <= MAX_STEPS:
                    values.append(current)
                    current = current + increment
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected N, a list N,M,..., START:END:STEP or START:END:xFACTOR"
        ) from None
    if len(values) > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{text!r}: more than {MAX_STEPS} steps")
    if not values or not all(0 < v < math.inf for v in values):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive and finite")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal-load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-x", "--model-version", default="")
    parser.add_argument(
        "-i",
        "--protocol",
        choices=["grpc", "http"],
        default="grpc",
        help="grpc (default) or http (KServe v2 REST, binary tensor data as perf_analyzer sends)",
    )
    parser.add_argument("-u", "--url", help="server address (default localhost:8001 for grpc, localhost:8000 for http)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=lambda t: parse_steps(t, True), help="closed loop, e.g. 1:32:x2")
    load.add_argument("--request-rate", type=lambda t: parse_steps(t, False), help="open loop, requests/s")
    parser.add_argument("--distribution", choices=["constant", "poisson"], default="constant")
    parser.add_argument("-b", "--batch-size", type=_positive_int, default=1)
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME:DIMS",
        help="dims of an input with variable dims (without the batch dim), e.g. IN:3,224",
    )
    parser.add_argument("--input-data", default="random", help="random | zeros | FILE.json")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=2.0, help="measurement window (default 2 s)")
    parser.add_argument("--stability", type=float, default=10.0, help="percent (default 10)")
    parser.add_argument("--max-windows", type=_positive_int, default=10)
    parser.add_argument("--request-count", type=int, default=0, help="measure this many requests per step instead")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="bound on the whole run (default 300)")
    parser.add_argument("--processes", type=_positive_int, default=1, help="load processes (default 1)")
    parser.add_argument("--workers-per-channel", type=_positive_int, default=8)
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG of latency percentiles vs throughput (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="plain lines even on a terminal")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    finite = all(math.isfinite(v) for v in (args.window_s, args.warmup_s, args.max_seconds, args.stability))
    if not finite or args.window_s <= 0 or args.warmup_s < 0 or args.max_seconds <= 0 or not 0 < args.stability < 1000:
        parser.error("--window-s and --max-seconds must be positive, --warmup-s >= 0, --stability in (0, 1000)")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'shoal-client[plot]'")
    if args.request_rate and args.processes > 1 and any(r / args.processes < 1 for r in args.request_rate):
        parser.error("--request-rate per process must be at least 1/s")
    previous_handler = signal.signal(signal.SIGINT, _interrupt)
    try:
        return _run_main(parser, args)
    finally:
        signal.signal(signal.SIGINT, previous_handler)


def _run_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    steps = args.request_rate or args.concurrency or [1]
    if args.url is None:
        args.url = "localhost:8000" if args.protocol == "http" else "localhost:8001"
    try:
        shapes = dict(parse_shape(text) for text in args.shape)
        client = connect(args.protocol, args.url)
        try:
            inputs = build_inputs(client, args.model, args.model_version, args.batch_size, shapes, args.input_data)
        finally:
            client.close()
    except InputError as exc:
        parser.error(str(exc))
    except CONTROL_ERRORS as exc:
        print(
            f"shoal-load: error: cannot prepare the requests for model '{args.model}' at {args.url}: {exc}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("shoal-load: interrupted before the run started", file=sys.stderr)
        return 130
    settings = Settings(
        url=args.url,
        model=args.model,
        version=args.model_version,
        request=(
            http.infer_request(args.model, args.model_version, inputs)
            if args.protocol == "http"
            else serialize_request(args.model, args.model_version, inputs)
        ),
        batch_size=args.batch_size,
        protocol=args.protocol,
        processes=args.processes,
        workers_per_channel=args.workers_per_channel,
        warmup_s=args.warmup_s,
        window_s=args.window_s,
        stability=args.stability / 100,
        max_windows=args.max_windows,
        request_count=args.request_count,
        poisson=args.distribution == "poisson",
    )
    results, interrupted = run(
        settings, steps, bool(args.request_rate), args.max_seconds, progress=not args.no_progress
    )
    if args.csv:
        report.write_csv(results, args.csv)
    if args.json:
        described = {k: v for k, v in asdict(settings).items() if k != "request"}
        report.write_json(results, args.json, described)
    if args.plot and results:
        report.save_plot(results, args.plot, f"{args.model} @ {args.url}")
    if interrupted:
        print("shoal-load: interrupted; the table shows what was measured until then", file=sys.stderr)
        return 130
    failed = sum(sum(r.errors.values()) for r in results)
    if failed:
        print(f"shoal-load: {failed:,} request(s) failed", file=sys.stderr)
        return 1
    return 0


def _interrupt(signum: int, frame: object) -> None:
    """First Ctrl-C: stop the run (KeyboardInterrupt); later ones wait for the bounded cleanup."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def run(
    settings: Settings, steps: list[float], open_loop: bool, max_seconds: float, progress: bool
) -> tuple[list[StepResult], bool]:
    """Run the steps; returns their results and whether Ctrl-C stopped the run."""
    from rich.console import Console

    console = Console(stderr=True)
    live_display = progress and console.is_terminal
    deadline = time.monotonic() + max_seconds
    results: list[StepResult] = []
    interrupted = False

    def plain(result: StepResult, windows: int) -> None:
        print(
            f"{report.step_label(result)}: window {windows}: {result.throughput:,.1f} infer/s, "
            f"p99 {result.latency_us['p99'] / 1000:.2f} ms, errors {sum(result.errors.values())}",
            file=sys.stderr,
            flush=True,
        )

    try:
        with LoadTester(settings) as tester:
            if live_display:
                from rich.live import Live

                with Live(_table(results, None), console=console, refresh_per_second=4) as live:
                    tester.on_window = lambda result, windows: live.update(_table(results, (result, windows)))
                    _run_steps(tester, steps, open_loop, deadline, results, lambda: live.update(_table(results, None)))
            else:
                tester.on_window = plain
                _run_steps(tester, steps, open_loop, deadline, results, lambda: None)
    except KeyboardInterrupt:  # between steps, or while the load processes start or stop
        if len(results) < len(steps) and not (results and results[-1].interrupted):
            results.append(_nothing_measured(steps[len(results)], open_loop))
        interrupted = True
    if live_display:
        Console().print(_table(results, None))
    else:
        _print_plain(results)
    return results, interrupted or any(r.interrupted for r in results)


def _run_steps(
    tester: LoadTester, steps: list[float], open_loop: bool, deadline: float, results: list[StepResult], refresh: object
) -> None:
    for value in steps:
        if time.monotonic() >= deadline:
            print(f"shoal-load: --max-seconds reached; {len(steps) - len(results)} step(s) not run", file=sys.stderr)
            break
        if open_loop:
            result = tester.run_step(request_rate=float(value), deadline=deadline)
        else:
            result = tester.run_step(concurrency=int(value), deadline=deadline)
        results.append(result)
        if callable(refresh):
            refresh()
        if result.interrupted:
            break
        if result.errors and not result.requests:
            print(
                f"shoal-load: no request succeeded in {report.step_label(result)} "
                f"({', '.join(f'{k}: {v}' for k, v in sorted(result.errors.items()))}); "
                f"{len(steps) - len(results)} step(s) not run",
                file=sys.stderr,
            )
            break


def _nothing_measured(value: float, open_loop: bool) -> StepResult:
    """The row of a step interrupted before it measured anything."""
    return StepResult(
        concurrency=0 if open_loop else int(value),
        request_rate=float(value) if open_loop else 0.0,
        throughput=0.0,
        requests=0,
        latency_us=dict.fromkeys(("avg", "p50", "p90", "p95", "p99", "max"), 0.0),
        errors={},
        stable=False,
        windows=0,
        interrupted=True,
    )


def _table(results: list[StepResult], current: tuple[StepResult, int] | None) -> Table:
    table = Table(title="shoal-load")
    for name in report.TABLE_HEADER:
        table.add_column(name, justify="left" if name in {"step", "errors"} else "right")
    for row in report.table_rows(results):
        table.add_row(*row)
    if current is not None:
        result, windows = current
        row = report.table_rows([result])[0]
        row[0] = f"{row[0]} (window {windows})"
        table.add_row(*row, style="dim")
    return table


def _print_plain(results: list[StepResult]) -> None:
    rows = [report.TABLE_HEADER, *report.table_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (c.ljust(w) if i in (0, 7) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        print("  ".join(cells))
