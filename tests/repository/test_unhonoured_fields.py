"""No ModelConfig field ignored in silence (issue 27 item 4): repository/unhonoured.py's table.

The table covers every field of model_config.proto (a field added to the proto fails here until it
is listed), names only real fields, and a real server warns about what it does not honour, refuses
what would change answers (the model is UNAVAILABLE with the reason, the others serve), and says the
same in ``shoal config check``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf.descriptor import Descriptor

from shoal.protocol import config_pb2
from shoal.repository import unhonoured
from shoal.repository.config import parse_config
from shoal.tools import local_server
from tests.models import REPO_ROOT

SIMPLE = REPO_ROOT / "model_repository" / "simple"


def proto_paths(descriptor: Descriptor, prefix: str = "", inside: frozenset[str] = frozenset()) -> Iterator[str]:
    """Every field path of ``descriptor``, map values and repeated elements under their field's path."""
    for field in descriptor.fields:
        path = prefix + field.name
        yield path
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            message = message.fields_by_name["value"].message_type
        if message is not None and message.full_name not in inside:  # recursive messages: once
            yield from proto_paths(message, path + ".", inside | {message.full_name})


def test_every_field_of_model_config_proto_is_in_the_table() -> None:
    unlisted = [path for path in proto_paths(config_pb2.ModelConfig.DESCRIPTOR) if unhonoured.entry(path) is None]
    assert unlisted == []


def test_the_table_names_only_fields_that_exist() -> None:
    assert set(unhonoured.FIELDS) - set(proto_paths(config_pb2.ModelConfig.DESCRIPTOR)) == set()


def test_findings_name_each_block_once_and_leave_honoured_fields_alone() -> None:
    config = parse_config("""
        backend: "onnxruntime" max_batch_size: 8
        instance_group [ { count: 1 rate_limiter { resources [ { name: "R" count: 1 } ] } },
                         { count: 1 rate_limiter { priority: 2 } } ]
        dynamic_batching { max_queue_delay_microseconds: 100 }
        response_cache { enable: true }
        optimization { input_pinned_memory { enable: true } priority: PRIORITY_MAX }
    """)
    assert [(f.path, f.treatment) for f in unhonoured.findings(config)] == [
        ("optimization.priority", unhonoured.Treatment.WARNED),
    ]


@pytest.fixture(scope="module")
def repository() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        config = (SIMPLE / "config.pbtxt").read_text()
        shutil.copytree(SIMPLE, repo / "simple")
        shutil.copytree(SIMPLE, repo / "cached")
        (repo / "cached" / "config.pbtxt").write_text(
            config.replace('name: "simple"', 'name: "cached"') + "\noptimization { priority: PRIORITY_MAX }\n"
            'metric_tags { key: "team" value: "search" }\n'
        )
        shutil.copytree(SIMPLE, repo / "custom_ops")
        (repo / "custom_ops" / "config.pbtxt").write_text(
            config.replace('name: "simple"', 'name: "custom_ops"')
            + '\nmodel_operations { op_library_filename: [ "libcustom.so" ] }\n'
        )
        yield repo


def test_a_server_warns_refuses_and_serves_the_rest(repository: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    server = local_server.start(repository, "--exit-on-error", "false", work_dir=tmp_path, log_path=log)
    try:
        client = grpcclient.InferenceServerClient(server.url)
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["custom_ops"].state == "UNAVAILABLE"
        assert index["custom_ops"].reason == (
            "model 'custom_ops': model_operations is not supported: custom operation libraries are not loaded"
        )
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for model in ("simple", "cached"):
            inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(a)
            result = client.infer(model, inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        text = server.log()
        assert "model 'cached': optimization.priority is not honoured: model priority is not applied" in text
        assert "model 'cached': metric_tags is not honoured: metric tags are not added" in text
        assert not [line for line in text.splitlines() if "'simple'" in line and "not honoured" in line]
        client.close()
    finally:
        server.stop()


def test_config_check_says_the_same(repository: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shoal", "config", "check", str(repository)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert (
        "FAIL  custom_ops: model 'custom_ops': model_operations is not supported: "
        "custom operation libraries are not loaded"
    ) in result.stdout
    assert "      warning: model 'cached': optimization.priority is not honoured" in result.stdout
