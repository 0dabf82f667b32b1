"""deploy/grafana/shoal-dashboard.json (issue 28 item 5): every panel's query names series a running Shoal
exports, with the labels it groups and filters by; a panel whose query names a missing series or label fails.

The server runs as an operator would run it for the dashboard (``--metrics-config summary_latencies=true``)
and has served and failed requests, so every family the panels read has samples.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests import ensemble_models
from tests.conftest import RunningServer, start_server
from tests.models import REPO_ROOT
from tests.polling import wait_until
from tests.prometheus_text import Family, parse, scrape

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "shoal-dashboard.json"
SERIES = re.compile(r"\b((?:nv|shoal)_[a-z0-9_]+)\b(?:\{([^}]*)\})?")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
MATCHER = re.compile(r'([a-z_]+)\s*=~?\s*"')


def queries() -> list[tuple[str, str]]:
    """(panel title, query) of every panel target and template variable."""
    board = json.loads(DASHBOARD.read_text())
    found = [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel["targets"]]
    found += [(f"variable {v['name']}", v["definition"]) for v in board["templating"]["list"] if "definition" in v]
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Family]]:
    repo = tmp_path_factory.mktemp("repo")
    ensemble_models.add_onnx_add1(repo)
    server: RunningServer = start_server(
        repo, tmp_path_factory.mktemp("server"), "--metrics-config", "summary_latencies=true"
    )
    try:
        with grpcclient.InferenceServerClient(server.url) as client:
            good = grpcclient.InferInput("IN", [1, 4], "FP32")
            good.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
            for _ in range(5):
                client.infer("add1", [good])
            bad = grpcclient.InferInput("IN", [1, 3], "FP32")
            bad.set_data_from_numpy(np.ones((1, 3), dtype=np.float32))
            with pytest.raises(InferenceServerException):
                client.infer("add1", [bad])
        wait_until(
            lambda: parse(scrape(server.metrics_port))["nv_inference_request_success"].value(model="add1") == 5,
            what="the requests counted",
        )
        yield parse(scrape(server.metrics_port))
    finally:
        assert server.stop() == 0, server.log()


def test_the_dashboard_is_grafana_json_with_panels_that_query() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["schemaVersion"] >= 36 and board["panels"]
    assert all(panel["targets"] and panel["datasource"]["uid"] == "${datasource}" for panel in board["panels"])
    titles = " ".join(panel["title"] for panel in board["panels"]).lower()
    for wanted in ("throughput", "p99", "queue", "failures", "memory"):  # what issue 28 asks the board to show
        assert wanted in titles


@pytest.mark.parametrize(("title", "query"), queries())
def test_every_query_names_series_and_labels_shoal_exports(exported: dict[str, Family], title: str, query: str) -> None:
    names = SERIES.findall(query)
    assert names, f"{title}: no Shoal series in {query!r}"
    grouped = {label.strip() for group in GROUPING.findall(query) for label in group.split(",") if label.strip()}
    for name, matchers in names:
        family = exported.get(name)
        assert family is not None and family.samples, f"{title}: {name} is not exported"
        labels = set().union(*(sample.labels for sample in family.samples))
        wanted = grouped | set(MATCHER.findall(matchers))
        assert wanted <= labels, f"{title}: {name} has no label {sorted(wanted - labels)}"
        for label, value in re.findall(r'([a-z_]+)="([^"$]*)"', matchers):  # a fixed value (quantile="0.99")
            assert value in {s.labels.get(label) for s in family.samples}, f"{title}: no {name}{{{label}={value}}}"
