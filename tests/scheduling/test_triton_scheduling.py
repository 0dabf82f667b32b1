"""Triton's rules for default instance counts and for what a reload rebuilds, checked through a real
server and tritonclient (the batcher's own edge rules are in test_scheduler.py, with a fake runner)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from shoal.protocol import config_pb2
from shoal.repository.config import normalize, parse_config
from tests import models
from tests.polling import wait_until

CPU = config_pb2.ModelInstanceGroup.KIND_CPU
GPU = config_pb2.ModelInstanceGroup.KIND_GPU


def _counts(text: str, resolves_to: int) -> list[int]:
    config = normalize(parse_config(text), "m", auto_kind=lambda backend, group: resolves_to)
    return [group.count for group in config.instance_group]


def test_the_default_instance_count_follows_the_kind_a_group_resolves_to() -> None:
    """Triton's NormalizeInstanceGroup resolves KIND_AUTO first, then ``SetDefaultInstanceCount``
    (core src/model_config_utils.cc) gives a group without a count 1, or 2 where the kind is
    KIND_CPU and the backend onnxruntime (or tensorflow); a KIND_GPU count is per listed GPU."""
    onnx = 'backend: "onnxruntime"\n'
    assert _counts(onnx, resolves_to=CPU) == [2]  # no instance_group: one KIND_AUTO group
    assert _counts(onnx, resolves_to=GPU) == [1]
    assert _counts(onnx + "instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]", resolves_to=GPU) == [2, 1]
    assert _counts(onnx + "instance_group [ { count: 3 } ]", resolves_to=CPU) == [3]  # a count given stays
    assert _counts('backend: "pytorch"\n', resolves_to=CPU) == [1]  # pytorch did not opt into 2
    assert _counts('backend: "identity"\n', resolves_to=CPU) == [1]
    # Without the lifecycle's resolver (repository code knows no backend or device) KIND_AUTO counts as not CPU.
    assert [g.count for g in normalize(parse_config(onnx), "m").instance_group] == [1]


def test_a_kind_auto_onnx_model_on_a_cpu_host_gets_two_instances(
    tmp_path: Path, server_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the server: a config-less ONNX model (KIND_AUTO) on a host without a usable GPU
    resolves to KIND_CPU and so gets Triton's CPU default of 2 instances; an identity model, 1."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU wherever the test runs
    repo = tmp_path / "repo"
    (repo / "bare").mkdir(parents=True)
    shutil.copytree(models.EXAMPLES / "simple" / "1", repo / "bare" / "1")  # no config.pbtxt
    models.add_identity(repo, "copy", "FP32")
    server = server_factory(repo)
    client = grpcclient.InferenceServerClient(server.url)
    try:
        for name, count in (("bare", 2), ("copy", 1)):
            [group] = client.get_model_config(name, as_json=True)["config"]["instance_group"]
            assert group.get("kind", "KIND_AUTO") == "KIND_AUTO" and group["count"] == count, (name, group)
    finally:
        client.close()
    assert "model bare version 1: 2 instance(s)" in server.log()


def _infer(client: grpcclient.InferenceServerClient, version: str, times: int) -> None:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    for _ in range(times):
        inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(data)
        result = client.infer("simple", inputs, model_version=version)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * data)


def _inference_count(client: grpcclient.InferenceServerClient, version: str) -> int:
    [stats] = client.get_inference_statistics("simple", version, as_json=True)["model_stats"]
    return int(stats.get("inference_count", 0))


def test_a_reload_rebuilds_only_the_versions_whose_files_or_config_changed(tmp_path: Path, server_factory) -> None:
    """Triton's ModelLifeCycle::AsyncLoad (core src/model_repository_manager/model_lifecycle.cc)
    keeps a READY version serving (an in-place update, not a new model) unless
    ``IsModelVersionModified`` (its version folder's timestamps, model_repository_manager.cc) or
    ``ConfigChangeRequiresReload`` (any config change beyond instance_group and version_policy,
    model_config_utils.cc) says otherwise. So in poll mode a change to version 2's files rebuilds
    version 2 only: version 1's statistics survive; a config change then rebuilds both."""
    repo = models.repository(tmp_path, "simple")
    config = repo / "simple" / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy: { all { } }\n")
    shutil.copytree(repo / "simple" / "1", repo / "simple" / "2")
    server = server_factory(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    client = grpcclient.InferenceServerClient(server.url)
    try:
        assert client.is_model_ready("simple", "1") and client.is_model_ready("simple", "2")
        _infer(client, "1", 3)
        _infer(client, "2", 2)
        assert (_inference_count(client, "1"), _inference_count(client, "2")) == (3, 2)

        model_file = repo / "simple" / "2" / "model.onnx"
        stat = model_file.stat()
        os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))  # version 2 changed
        assert wait_until(lambda: _inference_count(client, "2") == 0, what="version 2 rebuilt")
        assert _inference_count(client, "1") == 3, "version 1 was rebuilt though its files did not change"
        assert client.is_model_ready("simple", "1") and client.is_model_ready("simple", "2")

        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))  # config changed
        assert wait_until(lambda: client.get_model_config("simple", as_json=True)["config"]["max_batch_size"] == 4)
        assert wait_until(lambda: _inference_count(client, "1") == 0, what="version 1 rebuilt")
        _infer(client, "1", 1)
        assert _inference_count(client, "1") == 1
    finally:
        client.close()


def test_an_explicit_load_that_changes_only_the_version_policy_keeps_the_version_it_still_selects(
    tmp_path: Path, server_factory
) -> None:
    """``ConfigChangeRequiresReload`` (core src/model_config_utils.cc) ignores ``version_policy``:
    a load whose config only narrows the policy unloads the version it drops and keeps serving the
    one it still selects (its statistics survive), while an unchanged explicit load rebuilds nothing."""
    repo = models.repository(tmp_path, "simple")
    config = repo / "simple" / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy: { all { } }\n")
    shutil.copytree(repo / "simple" / "1", repo / "simple" / "2")
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "simple")
    client = grpcclient.InferenceServerClient(server.url)
    try:
        _infer(client, "2", 2)
        client.load_model("simple")  # nothing changed: nothing is rebuilt
        assert _inference_count(client, "2") == 2
        served = client.get_model_config("simple", as_json=True)["config"]
        client.load_model("simple", config=json.dumps({**served, "version_policy": {"latest": {"num_versions": 1}}}))
        assert not client.is_model_ready("simple", "1") and client.is_model_ready("simple", "2")
        assert _inference_count(client, "2") == 2, "version 2 was rebuilt though only the version policy changed"
    finally:
        client.close()
