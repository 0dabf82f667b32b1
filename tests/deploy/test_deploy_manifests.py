"""deploy/: every manifest against KServe's own CRD schemas and the rules its webhook and Knative add,
the container command lines against Shoal's parser, the image against the manifests, and
``kubectl kustomize`` (issue 25). Offline: no cluster, no Docker engine."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shoal.cli import build_parser
from tests import deploy_manifests as dm

pytestmark = pytest.mark.skipif(
    not dm.CRDS.is_dir(),
    reason=f"KServe's CRD schemas are not on this machine (looked in {', '.join(map(str, dm.KSERVE_PLACES))})",
)
SHIPPED = dm.shipped_runtimes() if dm.CRDS.is_dir() else []


def _ids(items: list[tuple[Path, dm.Manifest]]) -> list[str]:
    return [f"{path.relative_to(dm.DEPLOY)}:{doc['kind']}/{doc['metadata']['name']}" for path, doc in items]


def test_the_kserve_data_is_there() -> None:
    assert len(SHIPPED) == 15 and {d["metadata"]["name"] for d in SHIPPED} >= {"kserve-tritonserver"}
    assert set(dm.validators()) == {
        ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"),
        ("serving.kserve.io/v1alpha1", "ServingRuntime"),
        ("serving.kserve.io/v1beta1", "InferenceService"),
        ("serving.kserve.io/v1alpha1", "TrainedModel"),
    }


@pytest.mark.parametrize("runtime", SHIPPED, ids=[d["metadata"]["name"] for d in SHIPPED])
def test_kserves_shipped_runtimes_pass_the_validator_and_the_rules(runtime: dm.Manifest) -> None:
    """No false positives: what KServe ships is valid under the strict schema and the rule checks."""
    assert dm.schema_errors(runtime) == []
    assert dm.rule_problems(runtime, SHIPPED) == []


@pytest.mark.parametrize(
    ("where", "misspelt"),
    [
        (("spec",), "protocolVersion"),  # protocolVersions
        (("spec", "containers", 0), "arg"),  # args
        (("spec", "containers", 0, "securityContext"), "runAsNonroot"),
        (("spec", "supportedModelFormats", 0), "autoselect"),
        (("spec", "containers", 0, "resources", "requests"), None),  # int-or-string: numbers pass
    ],
)
def test_a_misspelt_field_fails_the_validator(where: tuple[str | int, ...], misspelt: str | None) -> None:
    triton = next(d for d in SHIPPED if d["metadata"]["name"] == "kserve-tritonserver")
    for runtime in (triton, *(doc for _, doc in dm.kserve_manifests() if doc["kind"] in dm.RUNTIME_KINDS)):
        broken = copy.deepcopy(runtime)
        node = broken
        for key in where:
            node = node[key]
        if misspelt is None:
            node["cpu"] = 0.5
            assert dm.schema_errors(broken) == []
        else:
            node[misspelt] = node.get(misspelt, True)
            errors = dm.schema_errors(broken)
            assert errors and any(misspelt in error for error in errors), errors


def test_an_inferenceservice_and_a_trainedmodel_typo_fail_too() -> None:
    docs = {doc["kind"]: doc for _, doc in dm.kserve_manifests()}
    isvc = copy.deepcopy(docs["InferenceService"])
    isvc["spec"]["predictor"]["model"]["storageURI"] = "gs://x"
    trained = copy.deepcopy(docs["TrainedModel"])
    trained["spec"]["model"]["memroy"] = "1Gi"
    assert dm.schema_errors(isvc) and dm.schema_errors(trained)


MANIFESTS = dm.kserve_manifests()


@pytest.mark.parametrize(("path", "manifest"), MANIFESTS, ids=_ids(MANIFESTS))
def test_every_kserve_manifest_validates_and_keeps_the_rules(path: Path, manifest: dm.Manifest) -> None:
    assert dm.schema_errors(manifest) == []
    assert dm.rule_problems(manifest, SHIPPED + [d for _, d in MANIFESTS if d is not manifest]) == []


def test_the_manifests_hold_what_the_issue_asks() -> None:
    kinds = [(doc["kind"], doc["metadata"]["name"]) for _, doc in MANIFESTS]
    assert ("ClusterServingRuntime", "shoal") in kinds and ("ServingRuntime", "shoal") in kinds
    assert sum(kind == "TrainedModel" for kind, _ in kinds) >= 1
    for _, doc in MANIFESTS:
        if doc["kind"] not in dm.RUNTIME_KINDS:
            continue
        spec = doc["spec"]
        assert spec["protocolVersions"] == ["v2", "grpc-v2"]
        assert {(f["name"], f["version"]) for f in spec["supportedModelFormats"]} == {
            ("onnx", "1"),
            ("pytorch", "1"),
            ("triton", "2"),
        }
        assert spec["annotations"] == {"prometheus.kserve.io/port": "8002", "prometheus.kserve.io/path": "/metrics"}
        (container,) = spec["containers"]
        assert container["name"] == "kserve-container" and "ports" not in container
        assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
        assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
        assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 300
        security = container["securityContext"]
        assert security["runAsUser"] == 1000 and security["runAsNonRoot"]
        assert security["capabilities"]["drop"] == ["ALL"]
        assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
    grpc = next(doc for path, doc in MANIFESTS if path.name == "inferenceservice-grpc.yaml")
    assert grpc["spec"]["predictor"]["model"]["ports"] == [{"name": "h2c", "protocol": "TCP", "containerPort": 9000}]


def _runtime(name: str = "shoal", kind: str = "ServingRuntime") -> dm.Manifest:
    return copy.deepcopy(next(doc for _, doc in MANIFESTS if (doc["kind"], doc["metadata"]["name"]) == (kind, name)))


def test_the_rule_checks_catch_what_the_webhook_and_knative_refuse() -> None:
    clash = _runtime()
    clash["spec"]["supportedModelFormats"][0].update(autoSelect=True, priority=1)  # onnx 1 at triton's priority
    assert any("clashes with kserve-tritonserver" in p for p in dm.rule_problems(clash, SHIPPED))
    openvino = _runtime()
    openvino["spec"]["supportedModelFormats"][0].update(autoSelect=True, priority=2)
    assert any("clashes with kserve-openvino" in p for p in dm.rule_problems(openvino, SHIPPED))
    other_protocol = _runtime()
    other_protocol["spec"]["protocolVersions"] = ["v1"]  # no overlap with kserve-tritonserver's: no clash
    other_protocol["spec"]["supportedModelFormats"][2].update(autoSelect=True, priority=1)
    assert dm.rule_problems(other_protocol, SHIPPED) == []
    broken = _runtime()
    container = broken["spec"]["containers"][0]
    broken["spec"]["protocolVersions"] = ["v2", "grpc-v3"]
    container["env"].append({"name": "PYTHONPATH", "value": "/x"})
    container["ports"] = [{"name": "grpc", "containerPort": 9000}, {"name": "h2c", "containerPort": 9091}]
    problems = "\n".join(dm.rule_problems(broken, SHIPPED))
    for phrase in ("grpc-v3", "PYTHONPATH", "2 ports", "'grpc'", "9091 is reserved"):
        assert phrase in problems


def _parse(args: list[str], env: dict[str, str]) -> object:
    """``args`` as Kubernetes expands $(VAR) from the container's env, then Shoal's own parser."""
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg) for arg in args]
    assert expanded[0] == "shoal" and expanded[1] == "serve"
    return build_parser().parse_args(expanded[1:])


CONTAINERS = dm.shoal_containers()


@pytest.mark.parametrize(("where", "args", "env"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_shoal_container_command_line_parses(where: str, args: list[str], env: dict[str, str]) -> None:
    parsed = _parse(args, env)
    assert str(parsed.model_repository) == "/mnt/models" and parsed.allow_grpc and parsed.allow_http
    assert not any("=" not in arg for arg in args[2:]), "every flag in the =-joined form, as KServe writes them"


def test_auto_workers_count_a_cpu_limit() -> None:
    """``--grpc-workers=auto`` reads the cgroup CPU quota, which only a CPU limit sets (without one it would count
    the node's cores): every container that asks for auto has a limit, and on a 64-core node the 2-CPU Deployment
    gets the one-process layout, the fastest measured on 2 cores."""
    from shoal.backends.devices import CpuAllowance
    from shoal.frontend.worker_count import resolve

    autos = [
        (doc, container)
        for _, doc in dm.shoal_manifests()
        for container in dm.containers(doc)
        if "--grpc-workers=auto" in container.get("args", [])
    ]
    assert any(doc["kind"] == "Deployment" for doc, _ in autos)
    for _, container in autos:
        assert container.get("resources", {}).get("limits", {}).get("cpu"), "auto without a CPU limit counts the node"
    deployment = next(container for doc, container in autos if doc["kind"] == "Deployment")
    assert str(deployment["resources"]["limits"]["cpu"]) == "2"
    assert resolve("auto", CpuAllowance(affinity=64, quota=2.0)).count == 0


def test_kserve_tritonservers_own_arguments_parse_as_shoals() -> None:
    """What kserve-tritonserver passes after ``tritonserver``, verbatim."""
    triton = next(d for d in SHIPPED if d["metadata"]["name"] == "kserve-tritonserver")
    args = triton["spec"]["containers"][0]["args"]
    assert args[0] == "tritonserver"
    parsed = build_parser().parse_args(["serve", *args[1:]])
    assert (str(parsed.model_repository), parsed.grpc_port, parsed.http_port) == ("/mnt/models", 9000, 8080)
    assert parsed.allow_grpc is True and parsed.allow_http is True


def test_allow_grpc_false_is_refused_in_words(capsys: pytest.CaptureFixture[str]) -> None:
    from shoal.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["serve", "--model-store=.", "--allow-grpc=false"])
    assert caught.value.code == 2
    assert "--allow-grpc=false: Shoal always serves gRPC" in capsys.readouterr().err


def test_the_image_runs_what_the_manifests_run() -> None:
    """No ENTRYPOINT: the runtimes' args replace CMD whole, and CMD is the runtimes' args."""
    assert dm.dockerfile_instruction("ENTRYPOINT") == []
    runtime_args = {
        tuple(args)
        for where, args, _ in CONTAINERS
        if where.startswith("deploy/kserve/") and "--model-control-mode=explicit" not in args
    }
    assert runtime_args == {tuple(dm.dockerfile_instruction("CMD"))}
    assert dm.dockerfile_instruction("USER") == ["1000:1000"]
    env = dm.dockerfile_env()
    assert env["HOME"] == "/nonexistent" and env["PYTHONDONTWRITEBYTECODE"] == "1" and env["TMPDIR"] == "/tmp"
    assert env["PATH"].startswith("/opt/shoal/bin:")
    text = (dm.REPO_ROOT / "Dockerfile").read_text()
    assert "ARG EXTRAS" in text and "slim" in text
    images = {
        container["image"]
        for _, doc in dm.shoal_manifests()
        for container in dm.containers(doc)
        if "image" in container
    }
    assert images == {"shoal:0.1.0"}


KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (the Debian package kubernetes-client has it)")
@pytest.mark.parametrize("folder", ["k8s", "kserve", "kserve/examples"])
def test_kubectl_kustomize_renders(folder: str) -> None:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(dm.DEPLOY / folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rendered = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    listed = yaml.safe_load((dm.DEPLOY / folder / "kustomization.yaml").read_text())["resources"]
    assert len(rendered) == sum(len(dm.documents(dm.DEPLOY / folder / name)) for name in listed)
    for doc in rendered:
        if doc["apiVersion"].startswith("serving.kserve.io/"):
            assert dm.schema_errors(doc) == []
    if folder == "k8s":
        kinds = {doc["kind"] for doc in rendered}
        assert kinds == {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
