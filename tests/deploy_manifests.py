"""Shoal's Kubernetes manifests and KServe's own schemas, read offline (issue 25): the helpers the
test_deploy_* and test_kserve_* tests share.

KServe's CRDs never set ``additionalProperties``, so ``strict_schema`` adds ``false`` wherever a
schema lists properties and does not preserve unknown fields (a misspelt field then fails), and
lets ``x-kubernetes-int-or-string`` take numbers (``cpu: 0.1``), as ../shared/kserve/README.md says.
"""

from __future__ import annotations

import functools
import os
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPLOY = REPO_ROOT / "deploy"
# KServe's own CRD schemas and shipped runtimes: the shared folder beside the checkout (``../shared``), or this
# machine's /work/shared when the checkout lies elsewhere (a clean clone under /tmp); $SHOAL_KSERVE_DATA overrides.
KSERVE_PLACES = [Path(p) for p in [os.environ.get("SHOAL_KSERVE_DATA", "")] if p] + [
    REPO_ROOT.parent / "shared" / "kserve",
    Path("/work/shared/kserve"),
]
KSERVE_DATA = next((place for place in KSERVE_PLACES if (place / "crds").is_dir()), KSERVE_PLACES[0])
CRDS = KSERVE_DATA / "crds"
SHIPPED_RUNTIMES = KSERVE_DATA / "runtimes"
RUNTIME_KINDS = {"ServingRuntime", "ClusterServingRuntime"}
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}
KNATIVE_PORT_NAMES = {"", "http1", "h2c"}
KNATIVE_RESERVED_PORTS = {8012, 8013, 8022, 9090, 9091}

Manifest = dict[str, Any]
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 2.3 MB of YAML


def documents(path: Path) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files(folder: Path) -> list[Path]:
    """The YAML files of ``folder`` (recursively) that are manifests, not kustomizations."""
    return sorted(p for p in folder.rglob("*.yaml") if p.name != "kustomization.yaml")


def strict_schema(schema: Any) -> Any:
    """An OpenAPI v3 schema, changed in place, to refuse unknown fields and take numbers as int-or-string."""

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        if node.get("x-kubernetes-int-or-string"):
            node["anyOf"] = [{"type": "integer"}, {"type": "number"}, {"type": "string"}]
        for value in node.values():
            walk(value)

    walk(schema)
    return schema


@functools.cache
def validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """(apiVersion, kind) → a strict validator, one per served version of each CRD in CRDS."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=_LOADER)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict_schema(version["schema"]["openAPIV3Schema"])
            found[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return found


def schema_errors(manifest: Manifest) -> list[str]:
    """Where ``manifest`` breaks its KServe CRD's strict schema; one line per error."""
    validator = validators().get((manifest.get("apiVersion", ""), manifest.get("kind", "")))
    if validator is None:
        return [f"no KServe CRD for {manifest.get('apiVersion')} {manifest.get('kind')}"]
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(manifest)]


def containers(manifest: Manifest) -> Iterator[Manifest]:
    """The containers a manifest declares (a runtime's, an InferenceService predictor's model, a Deployment's)."""
    spec = manifest.get("spec", {})
    yield from spec.get("containers", [])
    if "model" in spec.get("predictor", {}):
        yield spec["predictor"]["model"]
    yield from spec.get("predictor", {}).get("containers", [])
    yield from spec.get("template", {}).get("spec", {}).get("containers", [])


def rule_problems(manifest: Manifest, others: list[Manifest]) -> list[str]:
    """What KServe's admission webhook and Knative refuse and the schema lets through.

    ``others``: the runtimes it stands beside (KServe's shipped ones): an auto-selected format and
    version must not share its priority with another runtime's auto-selected one when their
    protocols overlap. Also: protocols within v1/v2/grpc-v1/grpc-v2, no PYTHONPATH, and at most one
    container port, named as Knative allows and not one Knative reserves.
    """
    problems = []
    spec = manifest.get("spec", {})
    if manifest.get("kind") in RUNTIME_KINDS:
        protocols = set(spec.get("protocolVersions") or ["v1"])
        if bad := protocols - PROTOCOLS:
            problems.append(f"unknown protocol versions {sorted(bad)}")
        for fmt in spec.get("supportedModelFormats", []):
            if not fmt.get("autoSelect"):
                continue
            for other in others:
                if other["metadata"]["name"] == manifest["metadata"]["name"]:
                    continue
                other_protocols = set(other["spec"].get("protocolVersions") or ["v1"])
                for theirs in other["spec"].get("supportedModelFormats", []):
                    if (
                        theirs.get("autoSelect")
                        and (theirs["name"], theirs.get("version")) == (fmt["name"], fmt.get("version"))
                        and theirs.get("priority") == fmt.get("priority")
                        and protocols & other_protocols
                    ):
                        problems.append(
                            f"{fmt['name']} {fmt.get('version')} at priority {fmt.get('priority')} "
                            f"clashes with {other['metadata']['name']}"
                        )
    for container in containers(manifest):
        if any(env.get("name") == "PYTHONPATH" for env in container.get("env", [])):
            problems.append(f"container {container.get('name')}: PYTHONPATH is refused")
        if manifest.get("kind") == "Deployment":
            continue  # plain Kubernetes: no Knative port rules
        ports = container.get("ports", [])
        if len(ports) > 1:
            problems.append(f"container {container.get('name')}: {len(ports)} ports, Knative takes one")
        for port in ports:
            if port.get("name", "") not in KNATIVE_PORT_NAMES:
                problems.append(f"port name {port.get('name')!r} is not one of Knative's ('', http1, h2c)")
            if port.get("containerPort") in KNATIVE_RESERVED_PORTS:
                problems.append(f"port {port.get('containerPort')} is reserved by Knative")
    return problems


def shipped_runtimes() -> list[Manifest]:
    return [doc for path in sorted(SHIPPED_RUNTIMES.glob("*.yaml")) for doc in documents(path)]


def shoal_manifests() -> list[tuple[Path, Manifest]]:
    return [(path, doc) for path in manifest_files(DEPLOY) for doc in documents(path)]


def kserve_manifests() -> list[tuple[Path, Manifest]]:
    return [(path, doc) for path, doc in shoal_manifests() if doc["apiVersion"].startswith("serving.kserve.io/")]


def shoal_containers() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, args, env values) of every container in deploy/ that runs Shoal."""
    found = []
    for path, doc in shoal_manifests():
        for container in containers(doc):
            if container.get("args", [None])[0] == "shoal":
                env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
                found.append(
                    (
                        f"{path.relative_to(REPO_ROOT)}:{doc['kind']}/{doc['metadata']['name']}",
                        list(container["args"]),
                        env,
                    )
                )
    return found


def dockerfile_instruction(name: str) -> list[str]:
    """The arguments of the last ``name`` instruction of the Dockerfile (JSON or shell form)."""
    lines = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    found = [line.split(None, 1)[1] for line in lines if line.split(None, 1)[:1] == [name]]
    if not found:
        return []
    text = found[-1].strip()
    return list(yaml.safe_load(text)) if text.startswith("[") else shlex.split(text)


def dockerfile_env() -> dict[str, str]:
    env = {}
    lines = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, _, value = pair.partition("=")
                env[key] = value
    return env
