"""``shoal config tune``: find the config with the highest throughput whose p99 stays in a budget.

Each candidate (instance count, max_batch_size, preferred_batch_size, max_queue_delay) is
served by a private Shoal server on a free loopback port and measured with the load
tester at a few concurrencies; its score is the best throughput among the concurrencies
whose p99 latency is within the budget. The search is a hill climb from the starting
config (as Model Analyzer's quick mode): measure every unmeasured neighbour of the best
candidate (one knob one step away), move to the best of them while it improves the score
by more than 2%, stop when none does or the time is up. Every measured point goes to a
CSV, the top candidates to a PNG, and the winner to ``config.tuned.pbtxt`` beside the
original, which is kept.

A candidate's config is the original config.pbtxt with only the tuned fields changed, in
place (``shoal.repository.config_text.ConfigEditor``): every instance group's ``count``,
``max_batch_size``, and ``dynamic_batching``'s ``max_queue_delay_microseconds`` and
``preferred_batch_size``. Everything else (priority levels, queue policies,
``preserve_ordering``, ``gpus``, parameters) and the comments stay as they were.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from shoal.clients import ClientError, InferenceClient
from shoal.clients.loadtest import plot as loadplot
from shoal.clients.loadtest.inputs import InputError, build_inputs, serialize_request
from shoal.clients.loadtest.measure import LoadTester, Settings
from shoal.configuring.pipeline import configure
from shoal.errors import invalid, shown
from shoal.protocol import config_pb2
from shoal.repository import scanner
from shoal.repository.config import CONFIG_FILENAME, parse_config
from shoal.repository.config_text import ConfigEditor, format_config
from shoal.tools import local_server, nvidia_smi

DELAYS_US = (0, 100, 500, 2000)
MAX_INSTANCES = 4
MAX_BATCH_LIMIT = 64
MIN_GAIN = 0.02
HEADER_PREFIX = "# shoal config tune:"


@dataclass(frozen=True)
class Candidate:
    instances: int
    max_batch_size: int
    delay_us: int = 0
    preferred_half: bool = False  # preferred_batch_size [max/2, max] instead of [max]

    def label(self) -> str:
        batching = (
            (
                f", batch ≤{self.max_batch_size}, delay {self.delay_us} µs"
                f"{', preferred half' if self.preferred_half else ''}"
            )
            if self.max_batch_size > 1
            else ""
        )
        return f"{self.instances} instance(s){batching}"


@dataclass
class Measured:
    candidate: Candidate
    points: list[dict[str, float]] = field(default_factory=list)  # per concurrency
    rss_mb: float = 0.0
    gpu_mb: float | None = None  # None without a GPU

    def score(self, budget_ms: float) -> float:
        within = [p["throughput"] for p in self.points if p["p99_ms"] <= budget_ms]
        return max(within, default=0.0)


def candidate_config(original: config_pb2.ModelConfig, candidate: Candidate, can_batch: bool) -> config_pb2.ModelConfig:
    """What ``candidate`` means for the parsed original config: the tuned fields, nothing else."""
    config = config_pb2.ModelConfig()
    config.CopyFrom(original)
    for group in config.instance_group:
        group.count = candidate.instances
    if not config.instance_group:
        config.instance_group.add(count=candidate.instances)
    if can_batch:
        config.max_batch_size = candidate.max_batch_size
        if candidate.max_batch_size > 1:
            batching = config.dynamic_batching
            batching.max_queue_delay_microseconds = candidate.delay_us
            del batching.preferred_batch_size[:]
            batching.preferred_batch_size.extend(_preferred(candidate))
        elif config.HasField("dynamic_batching"):  # queue policies and priorities stay; no preferred size > 1
            del config.dynamic_batching.preferred_batch_size[:]
    return config


def _preferred(candidate: Candidate) -> list[int]:
    if candidate.preferred_half and candidate.max_batch_size >= 4:
        return [candidate.max_batch_size // 2, candidate.max_batch_size]
    return [candidate.max_batch_size]


def candidate_text(original_text: str, candidate: Candidate, can_batch: bool) -> str:
    """The original config text with the tuned fields edited in place; comments and the rest kept."""
    editor = ConfigEditor(original_text)
    top = editor.top
    groups = editor.messages(top, "instance_group")
    for group in groups:
        editor.set_scalar(group, "count", str(candidate.instances))
    if not groups:
        editor.insert(top, f"instance_group [ {{ count: {candidate.instances} kind: KIND_AUTO }} ]")
    if can_batch:
        editor.set_scalar(top, "max_batch_size", str(candidate.max_batch_size))
        batching = editor.messages(top, "dynamic_batching")
        if candidate.max_batch_size > 1:
            preferred = [str(b) for b in _preferred(candidate)]
            if batching:
                editor.set_list(batching[0], "preferred_batch_size", preferred)
                editor.set_scalar(batching[0], "max_queue_delay_microseconds", str(candidate.delay_us))
            else:
                editor.insert(
                    top,
                    f"dynamic_batching {{\n  preferred_batch_size: [ {', '.join(preferred)} ]\n"
                    f"  max_queue_delay_microseconds: {candidate.delay_us}\n}}",
                )
        elif batching:
            editor.remove(batching[0], "preferred_batch_size")
    text = editor.text()
    expected = candidate_config(parse_config(original_text), candidate, can_batch)
    if parse_config(text) != expected:  # the editor must change exactly what the candidate means
        raise RuntimeError(f"editing the config for {candidate.label()} went wrong:\n{text}")
    return text


def _original_text(model_dir: Path, base: config_pb2.ModelConfig) -> str:
    """The model's config.pbtxt without an earlier tuning header; the completed config if there is none."""
    path = model_dir / CONFIG_FILENAME
    if not path.is_file():
        return format_config(base)
    lines = path.read_text().splitlines(keepends=True)
    while lines and lines[0].startswith(HEADER_PREFIX):
        lines.pop(0)
    return "".join(lines)


def neighbours(candidate: Candidate, can_batch: bool) -> list[Candidate]:
    options = [
        replace(candidate, instances=n)
        for n in (candidate.instances - 1, candidate.instances + 1)
        if 1 <= n <= MAX_INSTANCES
    ]
    if can_batch:
        options += [
            replace(candidate, max_batch_size=b)
            for b in (candidate.max_batch_size // 2, candidate.max_batch_size * 2)
            if 1 <= b <= MAX_BATCH_LIMIT
        ]
        if candidate.max_batch_size > 1:
            index = DELAYS_US.index(candidate.delay_us)
            options += [
                replace(candidate, delay_us=DELAYS_US[i]) for i in (index - 1, index + 1) if 0 <= i < len(DELAYS_US)
            ]
            if candidate.max_batch_size >= 4:
                options.append(replace(candidate, preferred_half=not candidate.preferred_half))
    return options


Shapes = Mapping[str, tuple[int, ...]]


def format_shapes(shapes: Shapes) -> str:
    return " ".join(f"{name}:{','.join(map(str, dims))}" for name, dims in shapes.items())


def check_shapes(config: config_pb2.ModelConfig, shapes: Shapes) -> None:
    """Every variable dim of an input has a ``--shape``, and each ``--shape`` fits an input's dims.

    ``dims`` in the config are what a client sends for one sample (the batch dim aside), so a
    given shape must have as many dims and agree with every fixed one.
    """
    inputs = {tensor.name: list(tensor.dims) for tensor in config.input}
    for name, given in shapes.items():
        if name not in inputs:
            raise invalid(
                f"--shape {shown(name)}: model '{config.name}' has no such input; "
                f"its inputs: {', '.join(map(shown, inputs))}"
            )
        dims = inputs[name]
        if len(given) != len(dims) or any(d not in (-1, g) for d, g in zip(dims, given, strict=True)):
            raise invalid(
                f"--shape {format_shapes({shown(name): given})} does not fit input '{shown(name)}', "
                f"whose dims are {dims} (-1 is variable)"
            )
    for name, dims in inputs.items():
        if -1 in dims and name not in shapes:
            example = ",".join("16" if d == -1 else str(d) for d in dims)
            raise invalid(
                f"input '{shown(name)}' has variable dims {dims}: give one sample's dims with "
                f"--shape {shown(name)}:D1,D2,... (e.g. --shape {shown(name)}:{example})"
            )


class Tuner:
    def __init__(
        self,
        model_dir: Path,
        budget_ms: float,
        concurrencies: list[int],
        window_s: float,
        deadline: float,
        shapes: Shapes | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.budget_ms = budget_ms
        self.concurrencies = concurrencies
        self.window_s = window_s
        self.deadline = deadline
        self.base = configure(model_dir, strict=False).config
        self.shapes = dict(shapes or {})
        check_shapes(self.base, self.shapes)  # before any server starts: the load needs a shape per input
        self.name = self.base.name
        self.original_text = _original_text(model_dir, self.base)
        self.can_batch = self.base.max_batch_size > 0
        self.measured: dict[Candidate, Measured] = {}

    def start(self) -> Candidate:
        mbs = self.base.max_batch_size
        delay = self.base.dynamic_batching.max_queue_delay_microseconds if self.base.HasField("dynamic_batching") else 0
        instances = max((g.count for g in self.base.instance_group), default=1) or 1  # count per group
        return Candidate(min(instances, MAX_INSTANCES), mbs, delay if delay in DELAYS_US else 0)

    def search(self) -> Measured:
        best = self.evaluate(self.start())
        while time.monotonic() < self.deadline:
            fresh = [n for n in neighbours(best.candidate, self.can_batch) if n not in self.measured]
            if not fresh:
                break
            results = [self.evaluate(n) for n in fresh if time.monotonic() < self.deadline]
            if not results:
                break
            challenger = max(results, key=lambda m: m.score(self.budget_ms))
            if challenger.score(self.budget_ms) <= best.score(self.budget_ms) * (1 + MIN_GAIN):
                break
            best = challenger
        return max(self.measured.values(), key=lambda m: m.score(self.budget_ms))

    def text(self, candidate: Candidate) -> str:
        return candidate_text(self.original_text, candidate, self.can_batch)

    def evaluate(self, candidate: Candidate) -> Measured:
        measured = Measured(candidate)
        self.measured[candidate] = measured
        try:
            self._measure(candidate, measured)
        except (RuntimeError, ClientError) as exc:  # a candidate that cannot serve scores 0
            print(f"  {candidate.label():<58} failed: {str(exc).splitlines()[0]}", flush=True)
            return measured
        score = measured.score(self.budget_ms)
        gpu = "" if measured.gpu_mb is None else f"   GPU {measured.gpu_mb:>6.0f} MB"
        print(
            f"  {candidate.label():<58} best in budget {score:>9.1f} infer/s   RSS {measured.rss_mb:>6.0f} MB{gpu}",
            flush=True,
        )
        return measured

    def _measure(self, candidate: Candidate, measured: Measured) -> None:
        with tempfile.TemporaryDirectory() as folder:
            repo = Path(folder)
            target = repo / self.name
            target.mkdir()
            for version in scanner.list_versions(self.model_dir):
                # Hard links (copies across file systems): the server refuses symlinks out of its repository.
                shutil.copytree(self.model_dir / str(version), target / str(version), copy_function=_link_or_copy)
            (target / CONFIG_FILENAME).write_text(self.text(candidate))
            with local_server.running(repo) as server:
                with InferenceClient(server.url, timeout_s=30) as client:
                    try:
                        inputs = build_inputs(client, self.name, "", 1, self.shapes, "random")
                    except InputError as exc:  # the user's to fix, not the candidate's: stop the search
                        raise invalid(str(exc)) from None
                settings = Settings(
                    server.url,
                    self.name,
                    "",
                    serialize_request(self.name, "", inputs),
                    1,
                    warmup_s=0.3,
                    window_s=self.window_s,
                    stability=0.15,
                    max_windows=5,
                )
                with LoadTester(settings) as tester:
                    for concurrency in self.concurrencies:
                        if time.monotonic() >= self.deadline and measured.points:
                            break
                        step = tester.run_step(concurrency=concurrency, deadline=self.deadline + 30)
                        if step.interrupted:  # Ctrl-C: the load tester stopped the step; stop the search
                            raise KeyboardInterrupt
                        measured.points.append(
                            {
                                "concurrency": concurrency,
                                "throughput": step.throughput,
                                "p50_ms": step.latency_us["p50"] / 1000,
                                "p99_ms": step.latency_us["p99"] / 1000,
                                "errors": sum(step.errors.values()),
                            }
                        )
                measured.rss_mb = _rss_mb(server.pid)
                measured.gpu_mb = nvidia_smi.used_mb([server.pid])


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def write_csv(measured: list[Measured], path: Path, budget_ms: float) -> None:
    with path.open("w", newline="") as handle:
        fields = [
            "instances",
            "max_batch_size",
            "delay_us",
            "preferred_half",
            "concurrency",
            "throughput",
            "p50_ms",
            "p99_ms",
            "errors",
            "within_budget",
            "rss_mb",
            "gpu_mb",
        ]
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for m in measured:
            for point in m.points:
                writer.writerow(
                    {
                        **asdict(m.candidate),
                        **point,
                        "within_budget": point["p99_ms"] <= budget_ms,
                        "rss_mb": round(m.rss_mb, 1),
                        "gpu_mb": "" if m.gpu_mb is None else m.gpu_mb,
                    }
                )


def plot(measured: list[Measured], path: Path, budget_ms: float, title: str) -> bool:
    """p99 latency against throughput of the five best candidates, in shoal-load's convention."""
    if loadplot.pyplot() is None:
        return False
    top = sorted(measured, key=lambda m: m.score(budget_ms), reverse=True)[:5]
    curves = [
        loadplot.Curve(
            m.candidate.label(),
            tuple(loadplot.Point(p["throughput"], p["p99_ms"], f"c={p['concurrency']:g}") for p in m.points),
            annotate=index == 0,
        )
        for index, m in enumerate(top)
        if m.points
    ]
    loadplot.save(curves, path, title, budget_ms=budget_ms, ylabel="p99 latency (ms)")
    return True


def run_tune(args: argparse.Namespace) -> int:
    model_dir: Path = args.model_dir.resolve()
    concurrencies: list[int] = args.concurrency
    shapes = dict(args.shape)
    deadline = time.monotonic() + args.max_minutes * 60
    tuner = Tuner(model_dir, args.latency_budget_ms, concurrencies, args.window_s, deadline, shapes)
    out_dir: Path = args.output_dir or model_dir / "tuning"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"tuning '{tuner.name}' for p99 ≤ {args.latency_budget_ms:g} ms at concurrencies {concurrencies}, "
        + (f"inputs {format_shapes(shapes)}, " if shapes else "")
        + f"at most {args.max_minutes:g} min",
        flush=True,
    )
    try:
        best = tuner.search()
    except KeyboardInterrupt:
        measured = [m for m in tuner.measured.values() if m.points]
        if measured:
            write_csv(measured, out_dir / "tune.csv", args.latency_budget_ms)
            plot(measured, out_dir / "tune.png", args.latency_budget_ms, f"shoal config tune: {tuner.name}")
        print(
            f"interrupted: {len(measured)} candidate(s) measured"
            + (f", see {out_dir / 'tune.csv'}" if measured else "")
            + "; no config.tuned.pbtxt written",
            file=sys.stderr,
        )
        return 130
    measured = list(tuner.measured.values())
    start = tuner.measured[tuner.start()]
    write_csv(measured, out_dir / "tune.csv", args.latency_budget_ms)
    plotted = plot(measured, out_dir / "tune.png", args.latency_budget_ms, f"shoal config tune: {tuner.name}")
    score, base_score = best.score(args.latency_budget_ms), start.score(args.latency_budget_ms)
    if score == 0:
        print(
            f"no candidate kept p99 within {args.latency_budget_ms:g} ms; see {out_dir / 'tune.csv'}", file=sys.stderr
        )
        return 1
    tuned = model_dir / "config.tuned.pbtxt"
    gain = f"{score / base_score:.2f}x the starting config" if base_score else "the starting config met no budget"
    where = os.path.relpath(out_dir, model_dir)  # no absolute path: the folder may move, or be shared
    header = "".join(
        f"{HEADER_PREFIX} {line}\n"
        for line in (
            f"p99 <= {args.latency_budget_ms:g} ms: {best.candidate.label()}",
            f"{score:.1f} inferences/s within the budget ({gain}, {start.candidate.label()}),",
            f"server RSS {best.rss_mb:.0f} MB. {len(measured)} candidates measured; see {where}/tune.csv.",
            *([f"Measured with one sample of --shape {format_shapes(shapes)} per request."] if shapes else []),
            "Only the tuned fields differ from config.pbtxt. To use it: cp config.tuned.pbtxt config.pbtxt",
        )
    )
    tuned.write_text(header + tuner.text(best.candidate))
    print(f"\nbest: {best.candidate.label()}: {score:.1f} infer/s within budget ({gain})")
    print(f"wrote {tuned}, {out_dir / 'tune.csv'}" + (f", {out_dir / 'tune.png'}" if plotted else ""))
    return 0
