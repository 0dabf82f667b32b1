"""shoal-load beside Triton's perf_analyzer on the same server, model and concurrencies, one run.

    python bench/loadtest_vs_perf_analyzer.py [--concurrency 1 2 4 8 16] [--window-s 2]

Starts Shoal on model_repository/, measures `simple` and `mlp` with perf_analyzer and with
shoal-load (1 and 2 processes) at each concurrency, and prints throughputs and their ratios.
Then measures the load tester's own ceiling: requests/s it drives against a model that does
no work (identity backend, 4 floats) at concurrency 32. Writes
bench/results/loadtest_vs_perf_analyzer.csv.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import install_perf_analyzer, perf_analyzer, save_results, shoal_load  # noqa: E402
from bench._server import REPO_ROOT, shoal_server  # noqa: E402

NOOP_CONFIG = """
backend: "identity"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--window-s", type=float, default=2.0)
    args = parser.parse_args()
    install_perf_analyzer()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        for name in ("simple", "mlp"):
            shutil.copytree(REPO_ROOT / "model_repository" / name, repo / name)
        (repo / "noop" / "1").mkdir(parents=True)
        (repo / "noop" / "config.pbtxt").write_text(NOOP_CONFIG)
        with shoal_server(repo) as (url, _):
            for model in ("simple", "mlp"):
                for concurrency in args.concurrency:
                    pa = perf_analyzer(url, model, concurrency, int(args.window_s * 1000))["throughput"]
                    one = shoal_load(url, model, concurrency, args.window_s, processes=1)
                    two = shoal_load(url, model, concurrency, args.window_s, processes=2)
                    rows.append({"model": model, "concurrency": concurrency, "perf_analyzer": pa,
                                 "shoal_load_1proc": one, "shoal_load_2proc": two})
            ceiling = {p: shoal_load(url, "noop", 32, args.window_s, processes=p) for p in (1, 2)}
            pa_noop = perf_analyzer(url, "noop", 32, int(args.window_s * 1000))["throughput"]
    print(f"{'model':<7} {'conc':>4} | {'perf_analyzer':>13} | {'shoal-load 1p':>13} {'ratio':>6} | "
          f"{'shoal-load 2p':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:<7} {r['concurrency']:>4} | {r['perf_analyzer']:>13.0f} | {r['shoal_load_1proc']:>13.0f} "
              f"{r['shoal_load_1proc'] / r['perf_analyzer']:>6.2f} | {r['shoal_load_2proc']:>13.0f} "
              f"{r['shoal_load_2proc'] / r['perf_analyzer']:>6.2f}")
    print(f"\nno-op model at concurrency 32: shoal-load 1 process {ceiling[1]:.0f}/s, 2 processes {ceiling[2]:.0f}/s, "
          f"perf_analyzer {pa_noop:.0f}/s")
    save_results(rows, "loadtest_vs_perf_analyzer.csv")


if __name__ == "__main__":
    main()
