"""Triton's logging extension (issue 28 item 4): ``/v2/logging`` and gRPC ``LogSettings``.

Settings read and changed over both transports with Triton 2.51's names, kinds and words (captured
from tritonserver 2.51); a change made through one front end is what the other reports, also when
front-end workers serve them; and the change is what every process logs by: the host, and a Python
model's own process (its ``pb_utils.Logger`` lines), in both process layouts.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from shoal.errors import ErrorCode, ShoalError
from shoal.logs import LogSettings
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import python_models
from tests.conftest import RunningServer, serving
from tests.polling import wait_until

DEFAULTS = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}

LOUD_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# Logs one line at each level per request, each naming the request's number.
LOUD = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            pb_utils.Logger.log_verbose(f"loud-verbose-{n[0]}")
            pb_utils.Logger.log_info(f"loud-info-{n[0]}")
            pb_utils.Logger.log_warn(f"loud-warning-{n[0]}")
            pb_utils.Logger.log_error(f"loud-error-{n[0]}")
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", n)]))
        return responses
"""
ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", re.MULTILINE)


# -- the rules, without a server -------------------------------------------------------------------


def test_a_change_names_only_what_changes_and_answers_every_setting() -> None:
    changed = LogSettings().updated({"log_verbose_level": 2, "log_info": False, "log_format": "ISO8601"})
    assert changed.as_dict() == {**DEFAULTS, "log_verbose_level": 2, "log_info": False, "log_format": "ISO8601"}
    assert LogSettings().updated({"log_info": None}) == LogSettings()  # null leaves it, as Triton


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"log_info": "true"}, "expect boolean for 'log_info'"),
        ({"log_warning": 1}, "expect boolean for 'log_warning'"),
        ({"log_verbose_level": True}, "expect int32 for 'log_verbose_level'"),
        ({"log_verbose_level": -1}, "expect int32 for 'log_verbose_level'"),
        ({"log_verbose_level": 1.5}, "expect int32 for 'log_verbose_level'"),
        ({"log_verbose_level": 2**32}, "expect int32 for 'log_verbose_level'"),
        ({"log_format": 3}, "expect string for 'log_format'"),
        ({"log_format": "iso8601"}, "invalid argument for log_format, got: iso8601"),
        ({"log_warnings": False}, "unknown log setting 'log_warnings'"),
    ],
)
def test_a_bad_setting_is_refused_in_tritons_words(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ShoalError) as caught:
        LogSettings().updated({"log_verbose_level": 1, **changes})  # the good one is not applied either
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT and message in caught.value.message


def test_the_log_file_is_not_changed_over_the_network() -> None:
    for value in ("/tmp/x.log", ""):  # not even to what it is, as Triton
        with pytest.raises(ShoalError) as caught:
            LogSettings().updated({"log_file": value})
        assert caught.value.code is ErrorCode.UNSUPPORTED
        assert caught.value.message == "log file location can not be updated through network protocol"


# -- a real server, both layouts -------------------------------------------------------------------


@pytest.fixture(scope="module")
def loud_server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    python_models.write_model(repo, "loud", LOUD_CONFIG, LOUD)
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as server:
        yield server


def http_post(server: RunningServer, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://{server.http_url}/v2/logging", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def grpc_settings(server: RunningServer, **changes: Any) -> dict[str, Any]:
    """Every setting over gRPC, each with the kind of value Triton sends it as."""
    request = pb.LogSettingsRequest()
    for name, value in changes.items():
        kind = "bool_param" if isinstance(value, bool) else "uint32_param" if isinstance(value, int) else "string_param"
        setattr(request.settings[name], kind, value)
    with grpc.insecure_channel(server.url) as channel:
        answer = InferenceStub(channel).LogSettings(request, timeout=30)
    return {
        name: (value.WhichOneof("parameter_choice"), getattr(value, value.WhichOneof("parameter_choice")))
        for name, value in answer.settings.items()
    }


def loud(server: RunningServer, n: int) -> None:
    import numpy as np

    with grpcclient.InferenceServerClient(server.url) as client:
        given = grpcclient.InferInput("IN", [1], "INT32")
        given.set_data_from_numpy(np.array([n], dtype=np.int32))
        assert client.infer("loud", [given]).as_numpy("OUT").tolist() == [n]


def lines_of(server: RunningServer, n: int) -> dict[str, bool]:
    """Which of request ``n``'s lines the server logged; waits for its error line, which comes last."""
    wait_until(lambda: f"loud-error-{n}" in server.log(), what=f"request {n}'s last line in the log")
    log = server.log()
    return {level: f"loud-{level}-{n}" in log for level in ("verbose", "info", "warning", "error")}


def test_both_transports_read_tritons_settings(loud_server: RunningServer) -> None:
    with httpclient.InferenceServerClient(loud_server.http_url) as client:
        assert client.get_log_settings() == DEFAULTS
        assert "logging" in client.get_server_metadata()["extensions"]
    with grpcclient.InferenceServerClient(loud_server.url) as client:
        assert {k: v.WhichOneof("parameter_choice") for k, v in client.get_log_settings().settings.items()} == {
            "log_file": "string_param",
            "log_info": "bool_param",
            "log_warning": "bool_param",
            "log_error": "bool_param",
            "log_verbose_level": "uint32_param",
            "log_format": "string_param",
        }
    assert grpc_settings(loud_server)["log_verbose_level"] == ("uint32_param", 0)


def test_a_change_through_one_transport_is_what_the_other_reads(loud_server: RunningServer) -> None:
    status, answer = http_post(loud_server, b'{"log_verbose_level": 3, "log_format": "ISO8601"}')
    assert (status, answer) == (200, {**DEFAULTS, "log_verbose_level": 3, "log_format": "ISO8601"})
    after = grpc_settings(loud_server, log_verbose_level=0, log_format="default")
    assert after["log_verbose_level"] == ("uint32_param", 0) and after["log_format"] == ("string_param", "default")
    with httpclient.InferenceServerClient(loud_server.http_url) as client:
        assert client.get_log_settings() == DEFAULTS


def test_bad_settings_are_refused_on_both_transports_and_change_nothing(loud_server: RunningServer) -> None:
    assert http_post(loud_server, b'{"log_info": false, "log_verbose_level": "2"}') == (
        400,
        {"error": "expect int32 for 'log_verbose_level'"},
    )
    assert http_post(loud_server, b'{"log_file": "/tmp/elsewhere.log"}') == (
        501,
        {"error": "log file location can not be updated through network protocol"},
    )
    assert http_post(loud_server, b"not json")[0] == 400
    with pytest.raises(grpc.RpcError) as caught:
        grpc_settings(loud_server, log_info="yes")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "expect boolean for 'log_info'"
    with pytest.raises(grpc.RpcError) as caught:
        grpc_settings(loud_server, log_file="")
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    no_kind = pb.LogSettingsRequest()
    no_kind.settings["log_verbose_level"].SetInParent()  # the key with no value: Triton refuses it
    with grpc.insecure_channel(loud_server.url) as channel, pytest.raises(grpc.RpcError) as caught:
        InferenceStub(channel).LogSettings(no_kind, timeout=30)
    assert caught.value.details() == "expect int32 for 'log_verbose_level'"
    with httpclient.InferenceServerClient(loud_server.http_url) as client:
        assert client.get_log_settings() == DEFAULTS


def test_the_settings_are_what_a_python_models_process_logs_by(loud_server: RunningServer) -> None:
    try:
        loud(loud_server, 1)
        assert lines_of(loud_server, 1) == {"verbose": False, "info": True, "warning": True, "error": True}
        assert http_post(loud_server, b'{"log_verbose_level": 1, "log_info": false}')[0] == 200
        loud(loud_server, 2)
        assert lines_of(loud_server, 2) == {"verbose": True, "info": False, "warning": True, "error": True}
        grpc_settings(loud_server, log_warning=False, log_verbose_level=0, log_format="ISO8601")
        loud(loud_server, 3)
        assert lines_of(loud_server, 3) == {"verbose": False, "info": False, "warning": False, "error": True}
        line = next(x for x in loud_server.log().splitlines() if "loud-error-3" in x)
        assert ISO_LINE.match(line), line
        # The host's own lines follow too: its line for the change is there only while INFO is on.
        grpc_settings(loud_server, log_info=True, log_warning=True)
        wait_until(
            lambda: "log settings now" in loud_server.log() and "'log_info': True" in loud_server.log(),
            what="the host's line for the change",
        )
        assert "'log_info': False" not in loud_server.log()
    finally:
        grpc_settings(loud_server, log_info=True, log_warning=True, log_verbose_level=0, log_format="default")


def test_the_command_line_sets_them_and_the_log_file_takes_every_process(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_models.write_model(repo, "loud", LOUD_CONFIG, LOUD)
    log_file = tmp_path / "shoal.log"
    (tmp_path / "server").mkdir()
    with serving(
        repo,
        tmp_path / "server",
        "--grpc-workers",
        "2",
        "--log-verbose",
        "1",
        "--log-warning",
        "false",
        "--log-format",
        "ISO8601",
        "--log-file",
        str(log_file),
    ) as server:
        with httpclient.InferenceServerClient(server.http_url) as client:
            assert client.get_log_settings() == {
                **DEFAULTS,
                "log_file": str(log_file),
                "log_warning": False,
                "log_verbose_level": 1,
                "log_format": "ISO8601",
            }
        loud(server, 7)
        wait_until(lambda: "loud-error-7" in log_file.read_text(), what="the model's line in the log file")
        text = log_file.read_text()
        assert "loud-verbose-7" in text and "loud-warning-7" not in text
        ours = [line for line in text.splitlines() if "loud-" in line or "front-end worker" in line]
        assert {w for w in (0, 1) if f"front-end worker {w} serves gRPC" in text} == {0, 1}  # workers' lines
        assert ours and all(ISO_LINE.match(line) for line in ours), ours
        assert "loud-" not in server.log() and "front-end worker" not in server.log()
