"""shoal-load against a real server: sweeps, CSV/JSON/PNG output, error accounting, bad arguments."""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shoal.clients import InferenceClient
from shoal.clients.loadtest.cli import parse_steps
from shoal.clients.loadtest.measure import LoadTester, Settings
from shoal.clients.loadtest.report import PERF_ANALYZER_COLUMNS
from tests import models
from tests.conftest import RunningServer
from tests.models import REPO_ROOT
from tests.polling import success_count, wait_until

FAST = ["--warmup-s", "0.3", "--window-s", "0.5", "--max-windows", "4", "--max-seconds", "60", "--no-progress"]


@pytest.fixture(scope="module")
def load_server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]):
    from tests.conftest import serving

    repo = tmp_path_factory.mktemp("repo")
    models.copy_example(repo, "simple")
    models.write_config(
        repo / "bounded",
        """
        backend: "identity"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        dynamic_batching { default_queue_policy { max_queue_size: 1 } }
        parameters { key: "execute_delay_ms" value: { string_value: "20" } }
        """,
    )
    (repo / "bounded" / "1").mkdir()
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as server:
        yield server


def shoal_load(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal.clients.loadtest", *args], capture_output=True, text=True, timeout=120
    )


def test_sweep_writes_csv_json_and_png(load_server: RunningServer, tmp_path: Path) -> None:
    out_csv, out_json, out_png = tmp_path / "r.csv", tmp_path / "r.json", tmp_path / "r.png"
    result = shoal_load(
        "-m",
        "simple",
        "-u",
        load_server.url,
        "--concurrency",
        "1:2:x2",
        "--input-data",
        "zeros",
        "--csv",
        str(out_csv),
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        *FAST,
    )
    assert result.returncode == 0, result.stderr
    assert "concurrency 1" in result.stdout and "concurrency 2" in result.stdout
    rows = list(csv.DictReader(out_csv.read_text().splitlines()))
    assert list(rows[0])[: 1 + len(PERF_ANALYZER_COLUMNS)] == ["Concurrency", *PERF_ANALYZER_COLUMNS]
    assert [r["Concurrency"] for r in rows] == ["1", "2"]
    for row in rows:
        assert float(row["Inferences/Second"]) > 0
        assert 0 < float(row["p50 latency"]) <= float(row["p99 latency"]) <= float(row["Max latency"])
        assert row["Errors"] == "0"  # as the table says: 0, not an empty cell
        assert float(row["Server Compute Infer"]) > 0  # breakdown from ModelStatistics deltas
    steps = json.loads(out_json.read_text())["steps"]
    assert steps[1]["concurrency"] == 2 and steps[1]["requests"] > 0
    assert all(step["client_cpu_us"] > 0 for step in steps)  # the load processes' own CPU per request
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    assert imread(out_png).shape[0] > 100


def test_the_same_load_runs_over_http(load_server: RunningServer, tmp_path: Path) -> None:
    """``-i http``: binary tensor data to the HTTP endpoint, counted by the server, breakdown from its stats."""
    out_json = tmp_path / "r.json"
    with InferenceClient(load_server.url, timeout_s=10) as client:
        before = success_count(client, "simple")
        result = shoal_load(
            "-i",
            "http",
            "-u",
            load_server.http_url,
            "-m",
            "simple",
            "--concurrency",
            "1,3",
            "--json",
            str(out_json),
            *FAST,
        )
        served = success_count(client, "simple") - before
    assert result.returncode == 0, result.stderr
    steps = json.loads(out_json.read_text())["steps"]
    assert [s["concurrency"] for s in steps] == [1, 3]
    assert all(s["requests"] > 0 and not s["errors"] for s in steps), (steps, result.stderr)
    assert served >= sum(s["requests"] for s in steps)  # every measured request reached the model
    assert any(s["server_us"] and s["server_us"]["compute_infer"] > 0 for s in steps)


def test_http_rejections_are_counted_by_http_status(load_server: RunningServer, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    result = shoal_load(
        "-i", "http", "-u", load_server.http_url, "-m", "bounded", "--concurrency", "6", "--json", str(out_json), *FAST
    )
    assert result.returncode == 1, result.stderr
    errors = json.loads(out_json.read_text())["steps"][0]["errors"]
    assert set(errors) == {"HTTP_503"} or set(errors) == {"HTTP_400"}, errors  # the queue is full


def test_an_unknown_model_over_http_is_a_clear_error(load_server: RunningServer) -> None:
    result = shoal_load("-i", "http", "-u", load_server.http_url, "-m", "nope", *FAST)
    assert result.returncode == 1
    assert "[HTTP 404]" in result.stderr and "'nope'" in result.stderr and "Traceback" not in result.stderr


def test_rejections_are_counted_by_status_and_fail_the_run(load_server: RunningServer, tmp_path: Path) -> None:
    out_csv = tmp_path / "r.csv"
    result = shoal_load("-m", "bounded", "-u", load_server.url, "--concurrency", "6", "--csv", str(out_csv), *FAST)
    assert result.returncode == 1, result.stderr
    row = next(csv.DictReader(out_csv.read_text().splitlines()))
    errors = dict(item.split("=") for item in row["Errors"].split(";"))
    assert set(errors) == {"UNAVAILABLE"} and int(errors["UNAVAILABLE"]) > 0
    assert f"{int(errors['UNAVAILABLE']):,} request(s) failed" in result.stderr
    assert float(row["Inferences/Second"]) > 0  # the accepted requests still complete


def test_a_server_killed_mid_run_fails_the_run_with_bounded_retries(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo)
    out_json = tmp_path / "r.json"
    concurrency = 4
    load = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal.clients.loadtest",
            "-m",
            "simple",
            "-u",
            server.url,
            "--concurrency",
            f"{concurrency},8,16",
            "--warmup-s",
            "0",
            "--window-s",
            "0.5",
            "--max-windows",
            "8",
            "--stability",
            "0.001",
            "--json",
            str(out_json),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with InferenceClient(server.url, timeout_s=10) as client:
            assert wait_until(lambda: success_count(client, "simple") >= 200), "no load reached the server"
            served_before_kill = success_count(client, "simple")
        server.process.kill()
        stdout, stderr = load.communicate(timeout=60)
    finally:
        load.kill()
        load.wait()
    assert load.returncode == 1, stderr
    steps = json.loads(out_json.read_text())["steps"]
    # Step 2 found the server dead: no request succeeded, so the sweep ended there.
    assert [s["concurrency"] for s in steps] == [concurrency, 8], stderr
    assert steps[1]["requests"] == 0 and "no request succeeded in concurrency 8" in stderr
    assert "1 step(s) not run" in stderr
    step = steps[0]
    # The totals cover the whole step: every success before the kill (the server may have counted
    # at most `concurrency` replies the client never received), every failure after it.
    assert step["requests"] >= served_before_kill - concurrency
    failures = sum(step["errors"].values())
    assert failures > 0 and set(step["errors"]) <= {"UNAVAILABLE", "CANCELLED", "INTERNAL", "UNKNOWN"}
    # Back-off: a few failures per second per coroutine, not a busy loop (~70,000/s before).
    assert failures / step["seconds"] < 30 * concurrency, (failures, step["seconds"])
    assert "request(s) failed" in stderr and "concurrency 4" in stdout
    assert "Traceback" not in stderr


def test_ctrl_c_prints_the_partial_table_and_exits_130(load_server: RunningServer, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    load = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal.clients.loadtest",
            "-m",
            "simple",
            "-u",
            load_server.url,
            "--concurrency",
            "1,2",
            "--processes",
            "2",
            "--warmup-s",
            "0",
            "--window-s",
            "0.5",
            "--max-windows",
            "100",
            "--stability",
            "0.001",
            "--json",
            str(out_json),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lines: list[str] = []
        assert load.stderr is not None
        for line in load.stderr:  # bounded: the step runs 100 windows of 0.5 s at most
            lines.append(line)
            if "window 2:" in line:
                break
        os.killpg(load.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
        stdout, stderr = load.communicate(timeout=60)
    finally:
        if load.poll() is None:
            load.kill()
        load.wait()
    stderr = "".join(lines) + stderr
    assert load.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert "interrupted" in stderr
    assert "concurrency 1 (interrupted)" in stdout
    step = json.loads(out_json.read_text())["steps"][0]
    assert step["interrupted"] and step["requests"] > 0 and step["windows"] >= 2 and not step["errors"]


def test_open_loop_with_two_processes(load_server: RunningServer, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    result = shoal_load(
        "-m",
        "simple",
        "-u",
        load_server.url,
        "--request-rate",
        "200",
        "--distribution",
        "poisson",
        "--processes",
        "2",
        "--json",
        str(out_json),
        *FAST,
    )
    step = json.loads(out_json.read_text())["steps"][0]
    assert result.returncode == 0, (step["errors"], result.stderr)
    assert step["request_rate"] == 200 and not step["errors"]
    assert 120 < step["throughput"] < 280  # a Poisson schedule at 200/s over ~1.5 s


def test_the_first_window_counts_load_though_the_processes_start_slowly(
    load_server: RunningServer, tmp_path: Path
) -> None:
    """The step starts once every load process is ready: no warm-up, yet the first window is loaded.
    Before, the clock started 0.5 s after the processes were spawned, while they still imported: with
    ``--warmup-s 0.5`` the first windows read 0 infer/s."""
    out_json = tmp_path / "r.json"
    result = shoal_load(
        "-m",
        "simple",
        "-u",
        load_server.url,
        "--concurrency",
        "2",
        "--processes",
        "2",
        "--warmup-s",
        "0",
        "--window-s",
        "0.3",
        "--max-windows",
        "3",
        "--stability",
        "0.001",
        "--max-seconds",
        "60",
        "--json",
        str(out_json),
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    windows = json.loads(out_json.read_text())["steps"][0]["window_throughputs"]
    assert len(windows) == 3 and min(windows) > 0.1 * max(windows), windows


def test_an_open_loop_starts_on_schedule_without_a_burst(load_server: RunningServer, tmp_path: Path) -> None:
    """An open loop's schedule starts when its process is ready. Before, a process that was still
    importing found its schedule seconds in the past and sent the backlog at once: past the server's
    100 concurrent streams per connection (``--grpc-max-concurrent-streams``) they were refused
    (RST_STREAM REFUSED_STREAM: UNAVAILABLE), and the first window read far above the rate."""
    out_json = tmp_path / "r.json"
    result = shoal_load(
        "-m",
        "simple",
        "-u",
        load_server.url,
        "--request-rate",
        "300",
        "--processes",
        "2",
        "--warmup-s",
        "0",
        "--window-s",
        "0.5",
        "--max-windows",
        "3",
        "--stability",
        "0.001",
        "--max-seconds",
        "60",
        "--json",
        str(out_json),
        "--no-progress",
    )
    step = json.loads(out_json.read_text())["steps"][0]
    assert result.returncode == 0 and not step["errors"], (step["errors"], result.stderr)
    assert max(step["window_throughputs"]) < 2 * 300, step["window_throughputs"]


def test_a_ctrl_c_while_the_load_processes_start_is_raised_not_lost() -> None:
    """The parent blocks SIGINT while it spawns (so the children are born blocking it) and raises the
    Ctrl-C that came meanwhile. Ignoring it instead lost it: the tuner then ran to its end, exit 0."""
    main_thread = threading.main_thread().ident
    assert main_thread is not None

    class InterruptingRequest(bytes):
        """A request that, as the load process's arguments are pickled in ``start()``, delivers a Ctrl-C."""

        def __reduce__(self) -> tuple[type[bytes], tuple[bytes]]:
            signal.pthread_kill(main_thread, signal.SIGINT)
            return bytes, (bytes(self),)

    settings = Settings("127.0.0.1:1", "m", "", InterruptingRequest(b"x"), 1, processes=2)
    with pytest.raises(KeyboardInterrupt):
        with LoadTester(settings):
            for _ in range(1000):  # where the interrupt lands: in __enter__, or at the latest here
                pass
    assert wait_until(lambda: not multiprocessing.active_children(), timeout_s=30, what="the load processes to end")


def _readme_commands() -> list[str]:
    """The shoal-load commands of its section in docs/clients.md."""
    text = (REPO_ROOT / "docs" / "clients.md").read_text()
    start = text.index("\n## Load testing: `shoal-load`\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end >= 0 else len(text)]
    return [
        line
        for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
        for line in block.splitlines()
        if line.startswith(".venv/bin/shoal-load ")
    ]


def test_the_readme_examples_run_and_finish_quickly(load_server: RunningServer, tmp_path: Path) -> None:
    """Each documented command is bounded (--max-seconds) and completes every step, as written."""
    commands = _readme_commands()
    assert len(commands) == 2
    for command in commands:
        args = shlex.split(command)[1:]
        assert "--max-seconds" in args, command
        if "-u" in args:
            args[args.index("-u") + 1] = load_server.http_url if "http" in args else load_server.url
        else:
            args += ["-u", load_server.url]  # the documented server listens on the default port
        result = subprocess.run(
            [sys.executable, "-m", "shoal.clients.loadtest", *args, "--no-progress"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert result.returncode == 0 and "not run" not in result.stderr, (command, result.stderr)
    assert (tmp_path / "simple.csv").is_file() and (tmp_path / "simple.png").is_file()


def test_fixed_request_count(load_server: RunningServer, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    result = shoal_load(
        "-m",
        "simple",
        "-u",
        load_server.url,
        "--concurrency",
        "2",
        "--request-count",
        "300",
        "--json",
        str(out_json),
        *FAST,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out_json.read_text())["steps"][0]["requests"] >= 300


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--concurrency", "0"], "every value must be positive"),
        (["--concurrency", "1:8:x1"], "START:END:xFACTOR"),
        (["--concurrency", "many"], "expected N"),
        (["--concurrency", "1", "--request-rate", "5"], "not allowed with argument"),
        (["--batch-size", "9"], "exceeds model 'simple' max_batch_size 8"),
        (["--shape", "NOPE:3"], "unknown input(s) ['NOPE']"),
        (["--window-s", "0"], "--window-s and --max-seconds must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(load_server: RunningServer, args: list[str], phrase: str) -> None:
    result = shoal_load("-m", "simple", "-u", load_server.url, *args)
    assert result.returncode == 2
    assert phrase in result.stderr


def test_unknown_model_exits_1(load_server: RunningServer) -> None:
    result = shoal_load("-m", "nope", "-u", load_server.url)
    assert result.returncode == 1
    assert "Request for unknown model: 'nope'" in result.stderr


def test_step_specs() -> None:
    assert parse_steps("1:32:x2", True) == [1, 2, 4, 8, 16, 32]
    assert parse_steps("1:7:3", True) == [1, 4, 7]
    assert parse_steps("1,3", True) == [1, 3]
    assert parse_steps("50:100:25", False) == [50.0, 75.0, 100.0]
    assert parse_steps("1:4:x1.5", True) == [1, 2, 3, 4]  # a factor that rounds back to the same value steps by 1
    assert parse_steps("100:300:x1.5", False) == [100.0, 150.0, 225.0]
    for text in ("nan", "inf", "1:inf:x2", "nan:4", "0", "1:100:1e-300"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_steps(text, False)


def test_non_finite_durations_are_refused() -> None:
    result = shoal_load("-m", "simple", "-u", "127.0.0.1:1", "--window-s", "nan")
    assert result.returncode == 2 and "--window-s" in result.stderr


def test_more_processes_than_concurrency(load_server: RunningServer, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    result = shoal_load(
        "-m", "simple", "-u", load_server.url, "--concurrency", "1", "--processes", "2", "--json", str(out_json), *FAST
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out_json.read_text())["steps"][0]["throughput"] > 0


def test_one_plot_convention_for_shoal_load_and_the_tuner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.clients.loadtest import plot, report
    from shoal.clients.loadtest.measure import StepResult
    from shoal.tools import tune

    def step(concurrency: int, throughput: float, p99_ms: float) -> StepResult:
        latency = {
            k: p99_ms * 1000 * f
            for k, f in (("avg", 0.5), ("p50", 0.5), ("p90", 0.8), ("p95", 0.9), ("p99", 1.0), ("max", 1.2))
        }
        return StepResult(concurrency, 0.0, throughput, 100, latency, {}, True, 3)

    # Throughput falls at concurrency 8: joined in step order the line would turn back (zig-zag).
    steps = [step(1, 100.0, 2.0), step(4, 900.0, 4.0), step(8, 700.0, 9.0), step(16, 950.0, 30.0)]
    measured = [
        tune.Measured(
            tune.Candidate(n, 8),
            [
                {"concurrency": c, "throughput": s.throughput * n, "p99_ms": s.latency_us["p99"] / 1000}
                for c, s in zip((1, 4, 8, 16), steps, strict=True)
            ],
        )
        for n in (1, 2)
    ]
    captured = {}
    real_save = plot.save

    def spy(curves, path, title, budget_ms=None, ylabel=plot.YLABEL):
        captured[path.name] = plot.figure(curves, title, budget_ms, ylabel)
        real_save(curves, path, title, budget_ms, ylabel)

    monkeypatch.setattr(plot, "save", spy)  # keep each figure to inspect it
    report.save_plot(steps, tmp_path / "load.png", "shoal-load: a rather long title for a model @ 127.0.0.1:1")
    assert tune.plot(measured, tmp_path / "tune.png", 20.0, "shoal config tune: simple")
    for name, fig in captured.items():
        axes = fig.axes[0]
        assert axes.get_xlabel() == plot.XLABEL and "latency (ms)" in axes.get_ylabel(), name
        for line in axes.get_lines():
            xs = list(line.get_xdata())
            assert xs == sorted(xs), f"{name}: {line.get_label()} is not drawn in order of throughput"
        fig.canvas.draw()
        box = fig.bbox
        texts = [*axes.texts, *axes.get_legend().get_texts(), axes.title]
        assert len(axes.texts) == 4, name  # one label per step (p99 curve / best candidate)
        for text in texts:
            extent = text.get_window_extent()
            assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1, (
                f"{name}: {text.get_text()!r} is clipped"
            )
        plot.pyplot().close(fig)
    assert (tmp_path / "load.png").read_bytes()[:4] == (tmp_path / "tune.png").read_bytes()[:4] == b"\x89PNG"
