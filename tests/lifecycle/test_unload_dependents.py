"""``unload_dependents``: unloading an ensemble with it also unloads the models it uses (as Triton),
except those another loaded ensemble still uses; over gRPC and HTTP, in both layouts."""

from __future__ import annotations

from pathlib import Path

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import models


def _ready(client: grpcclient.InferenceServerClient) -> set[str]:
    return {m.name for m in client.get_model_repository_index().models if m.state == "READY"}


def test_unload_dependents_unloads_what_only_that_ensemble_used(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("mlp", "mlp_scale", "mlp_pipeline", "preprocess", "image_pipeline"):
        models.copy_example(repo, name)
    server = server_factory(
        repo, "--model-control-mode", "explicit", "--load-model", "mlp_pipeline", "--load-model", "image_pipeline"
    )
    with grpcclient.InferenceServerClient(server.url) as client:
        assert _ready(client) == {"mlp", "mlp_scale", "mlp_pipeline", "preprocess", "image_pipeline"}
        client.unload_model("mlp_pipeline", unload_dependents=True)
        # mlp_scale went with it; mlp stays: image_pipeline still uses it.
        assert _ready(client) == {"mlp", "preprocess", "image_pipeline"}
        with httpclient.InferenceServerClient(server.http_url) as rest:
            rest.unload_model("image_pipeline", unload_dependents=True)
        assert _ready(client) == set()


def test_without_the_flag_the_models_it_used_stay(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("mlp", "mlp_scale", "mlp_pipeline"):
        models.copy_example(repo, name)
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "mlp_pipeline")
    with grpcclient.InferenceServerClient(server.url) as client:
        client.unload_model("mlp_pipeline")
        assert _ready(client) == {"mlp", "mlp_scale"}
        client.load_model("mlp_pipeline")
        with httpclient.InferenceServerClient(server.http_url) as rest:
            rest.unload_model("mlp_pipeline", unload_dependents=False)
        assert _ready(client) == {"mlp", "mlp_scale"}
