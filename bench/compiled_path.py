"""Whether compiling Shoal's own Python pays: the request path built with mypyc against the same code interpreted.

    python bench/compiled_path.py [--rounds 2] [--window-ms 1500] [--label NAME]

Issue 24's Python-model goals stay below Triton with profiles that show Shoal's per-request Python
flat (docs/benchmarks.md, "The server's own Python per request"), which left one step untried: a
compiled request path. This measures what the cheapest such step gives. It copies Shoal as committed
at HEAD into a scratch folder (``bench._server.checked_out_server``), compiles there with mypyc (which
comes with mypy, the project's type checker, and needs a C compiler) every module of the hot path that
mypyc 2.x builds and imports as it is (``COMPILED``; the ones it refuses are in ``NOT_COMPILED``, with
why), and serves bench/python_backend.py's ``model.py`` and config from both copies on a thread
instance and on a process instance, alternately, with perf_analyzer 2.51 over gRPC at c=1 and c=16
(three windows each). Figures: throughput, p50 and the CPU per request of the server's whole process
tree, per copy; then compiled ÷ interpreted. Nothing here changes how Shoal is built or installed.
Prints a markdown table and writes bench/results/compiled_path[_<label>].csv (every round).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import install_perf_analyzer, save_results  # noqa: E402
from bench._server import REPO_ROOT, checked_out_server, shoal_server  # noqa: E402
from bench.python_backend import CONCURRENCIES, measure, write_repository  # noqa: E402

# The request path's modules mypyc builds as they are: the worker's side of a process instance's
# pipe, the runner of a Python model, and the host's decode, checks and batcher.
COMPILED = (
    "instances/python_worker.py",
    "instances/python_link.py",
    "backends/python/runner.py",
    "dataplane/packing.py",
    "dataplane/arena.py",
    "grpc/convert.py",
    "protocol/codec.py",
    "request_types.py",
    "lifecycle/model.py",
    "lifecycle/request_checks.py",
    "scheduling/base.py",
    "scheduling/batching.py",
    "scheduling/dynamic.py",
    "scheduling/sequence.py",
    "scheduling/sequence_lanes.py",
    "scheduling/sequence_slots.py",
)
NOT_COMPILED = {  # on the path too; mypyc 2.4 refuses them
    "grpc/servicer.py": "async generators are unimplemented",
    "core/local.py": "async generators are unimplemented",
    "instances/worker_pipe.py": "a NamedTuple field typed by a name imported only for type checking fails at import",
    "instances/pool.py": "an attribute named _thread becomes a C keyword",
    "scheduling/clock.py": "ctypes: the generated C does not build",
    "scheduling/rate_limiter.py": "a dataclass field typed object fails at import",
    "backends/python/pb_utils.py": "an internal mypyc error",
}
MYPY_INI = """[mypy]
ignore_missing_imports = True
[mypy-shoal.protocol.grpc_service_pb2]
ignore_errors = True
[mypy-shoal.protocol.model_config_pb2]
ignore_errors = True
"""
INSTANCE_KINDS = {
    "process": "",
    "thread": 'parameters { key: "process_instances" value: { string_value: "false" } }\n',
}


def compile_copy(folder: Path) -> None:
    """Build ``COMPILED`` in ``folder`` (a ``checked_out_server`` copy): each module's extension lands
    beside its source, which Python imports first."""
    mypyc = shutil.which("mypyc", path=str(Path(sys.executable).parent))
    if mypyc is None:
        raise SystemExit("mypyc not found beside this Python: pip install mypy (it comes with it)")
    (folder / "mypy.ini").write_text(MYPY_INI)
    for stub in (REPO_ROOT / "proto" / "shoal" / "protocol").glob("*_pb2.pyi"):  # generated, not in git
        shutil.copy(stub, folder / "shoal" / "protocol" / stub.name)
    built = subprocess.run(
        [mypyc, *(f"shoal/{module}" for module in COMPILED)], cwd=folder, capture_output=True, text=True
    )
    if built.returncode != 0:
        raise SystemExit(f"mypyc failed:\n{built.stdout[-4000:]}\n{built.stderr[-4000:]}")
    missing = [m for m in COMPILED if not list((folder / "shoal" / m).parent.glob(Path(m).stem + ".cpython-*.so"))]
    if missing:
        raise SystemExit(f"mypyc built no extension for {missing}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=1500)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        copies = {
            "interpreted": stack.enter_context(checked_out_server("HEAD")),
            "compiled": stack.enter_context(checked_out_server("HEAD")),
        }
        print("compiling with mypyc (a minute or two)...", flush=True)
        compile_copy(copies["compiled"])
        repositories = {}
        for kind, extra in INSTANCE_KINDS.items():
            repositories[kind] = root / kind
            repositories[kind].mkdir()
            write_repository(repositories[kind], extra)
        for round_number in range(args.rounds):
            order = list(copies) if round_number % 2 == 0 else list(reversed(copies))
            for copy in order:
                for kind, repository in repositories.items():
                    with shoal_server(repository, python_path=copies[copy]) as (url, pid):
                        for concurrency in CONCURRENCIES:
                            figures = measure(url, pid, concurrency, args.window_ms)
                            row = {"round": round_number, "copy": copy, "instance": kind, "concurrency": concurrency}
                            rows.append(row | figures)
                            print(
                                f"round {round_number} {copy} {kind} c={concurrency}: "
                                f"{figures['throughput']:.0f}/s p50 {figures['p50_us']:.0f} µs, "
                                f"{figures['cpu_us_per_request']:.0f} µs CPU/request",
                                flush=True,
                            )

    def median(copy: str, kind: str, concurrency: int, name: str) -> float:
        return float(
            statistics.median(
                r[name] for r in rows if (r["copy"], r["instance"], r["concurrency"]) == (copy, kind, concurrency)
            )
        )

    print(f"\nMedians of {args.rounds} round(s); ratios compiled ÷ interpreted.")
    print(
        "| instance | c | interpreted (infer/s) | compiled (infer/s) | throughput ratio "
        "| interpreted CPU µs/request | compiled CPU µs/request | CPU ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in INSTANCE_KINDS:
        for concurrency in CONCURRENCIES:
            speed = [median(copy, kind, concurrency, "throughput") for copy in copies]
            cpu = [median(copy, kind, concurrency, "cpu_us_per_request") for copy in copies]
            print(
                f"| {kind} | {concurrency} | {speed[0]:,.0f} | {speed[1]:,.0f} | {speed[1] / speed[0]:.2f}× "
                f"| {cpu[0]:.0f} | {cpu[1]:.0f} | {cpu[1] / cpu[0]:.2f}× |"
            )
    save_results(rows, f"compiled_path{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()
