"""Every Serve config and KubeRay manifest is valid: Ray's own ServeDeploySchema, adaspec's
AppConfig, and the real KubeRay v1.7.0 CRD schemas (cluster/crds/)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cli.serve_config import check_serve_config
from serve_app.config import AppConfig

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
MANIFESTS = sorted((REPO / "cluster").glob("*.yaml"))
CRDS = {"RayService": "ray.io_rayservices.v1.7.0.yaml", "RayCluster": "ray.io_rayclusters.v1.7.0.yaml"}
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAME_LIMIT = {"RayService": 47, "RayCluster": 53}  # enforced by the operator's Go code


def _to_json_schema(node):
    """The CRD's openAPIV3Schema as JSON Schema, with Kubernetes' extensions spelled out."""
    if isinstance(node, list):
        return [_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)  # catch typos such as `minReplica`
    if "required" in out:
        # Defaulted by the API server before validation.
        out["required"] = [r for r in out["required"] if r not in ("minReplicas", "maxReplicas")]
    return out


def _crd_validator(kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((REPO / "cluster" / "crds" / CRDS[kind]).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _to_json_schema(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # only loosely described by CRDs
    return jsonschema.Draft7Validator(schema)


def _check_operator_rules(doc: dict) -> None:
    name = doc["metadata"]["name"]
    assert DNS_1035.match(name) and len(name) <= NAME_LIMIT[doc["kind"]], name
    cluster = doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    for g in groups:
        assert g["template"]["spec"]["containers"], "every group needs a container"
    for g in cluster.get("workerGroupSpecs", []):
        assert g.get("minReplicas", 0) <= g.get("maxReplicas", 2**31 - 1)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_serve_config_is_valid(path):
    doc = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(doc)
    check_serve_config(path)


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_kuberay_manifest_is_valid(path):
    for doc in yaml.safe_load_all(path.read_text()):
        errors = sorted(_crd_validator(doc["kind"]).iter_errors(doc), key=str)
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
        _check_operator_rules(doc)
        if doc["kind"] == "RayService":
            serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
            ServeDeploySchema.model_validate(serve_config)
            for app in serve_config["applications"]:
                AppConfig.model_validate(app["args"])


def test_rayservice_runs_the_gpu_config():
    doc = yaml.safe_load((REPO / "cluster" / "rayservice.yaml").read_text())
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    gpu = yaml.safe_load((REPO / "configs" / "app-gpu-tp2.yaml").read_text())
    assert serve_config["applications"] == gpu["applications"]
    head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (workers,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    tp = gpu["applications"][0]["args"]["tensor_parallel_size"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == tp  # one pod holds one replica's tensor-parallel group


def test_crd_validation_catches_typos_and_bad_types():
    doc = yaml.safe_load((REPO / "cluster" / "rayservice.yaml").read_text())
    validator = _crd_validator("RayService")
    typo = copy.deepcopy(doc)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    assert any("minReplica" in e.message for e in validator.iter_errors(typo))
    unquoted = copy.deepcopy(doc)
    unquoted["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert list(validator.iter_errors(unquoted))
