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
from serve_app.builder import _placement
from serve_app.config import AppConfig
from serve_app.ray_env import RAY_ENV

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
def test_serve_config_is_valid(path, monkeypatch):
    # The GPU configs name hub models: with no network the hub client retries for about 40 s
    # per model before the check goes on without their configs (prepare.models.attention_heads);
    # offline, it goes on at once. What is checked stays the same.
    import huggingface_hub

    monkeypatch.setitem(huggingface_hub.is_offline_mode.__globals__, "HF_HUB_OFFLINE", True)
    doc = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(doc)
    check_serve_config(path)


def _documents(path: Path) -> list[dict]:
    return list(yaml.safe_load_all(path.read_text()))


def _rayservice(path: Path) -> dict:
    (doc,) = [d for d in _documents(path) if d["kind"] == "RayService"]
    return doc


def _app_args(doc: dict) -> dict:
    (app,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    return app["args"]


def _groups(doc: dict) -> list[dict]:
    cluster = doc["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def _check_claim(doc: dict) -> None:
    # No Kubernetes core schema offline: the fields the head's volume relies on.
    assert doc["apiVersion"] == "v1", doc["apiVersion"]
    assert DNS_1035.match(doc["metadata"]["name"])
    assert set(doc["spec"]) == {"accessModes", "resources"}, doc["spec"]
    assert doc["spec"]["resources"]["requests"]["storage"]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_kuberay_manifest_is_valid(path):
    for doc in _documents(path):
        if doc["kind"] == "PersistentVolumeClaim":
            _check_claim(doc)
            continue
        errors = sorted(_crd_validator(doc["kind"]).iter_errors(doc), key=str)
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
        _check_operator_rules(doc)
        if doc["kind"] == "RayService":
            serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
            ServeDeploySchema.model_validate(serve_config)
            for app in serve_config["applications"]:
                AppConfig.model_validate(app["args"])


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_rayservice_runs_the_cluster_features(path):
    """Controller on, Serve autoscaling behind the speculation-aware router, admin routes
    whose token and OpenAI routes whose API key every pod reads from a Secret (never a
    literal in the manifest)."""
    doc = _rayservice(path)
    cfg = AppConfig.model_validate(_app_args(doc))
    assert cfg.controller.enabled
    assert cfg.autoscaling is not None and cfg.router == "spec_aware"
    workers = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert cfg.autoscaling.max_replicas <= sum(g["maxReplicas"] for g in workers)
    assert cfg.admin.enabled and cfg.admin.token is None and cfg.admin.token_env
    assert cfg.api_key is None and cfg.api_key_env
    for group in _groups(doc):
        # The ingress may be placed in any pod, so every container carries the variables.
        for container in group["template"]["spec"]["containers"]:
            for what, name in [("the admin token", cfg.admin.token_env), ("the API key", cfg.api_key_env)]:
                (var,) = [e for e in container.get("env", []) if e["name"] == name]
                assert "value" not in var, f"{container['name']}: {what} is a literal"
                assert {"name", "key"} <= set(var["valueFrom"]["secretKeyRef"]), container["name"]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_controller_checkpoint_is_on_the_head_volume(path):
    """ADASPEC_CONTROLLER_DIR on the head is a mounted claim, defined in the same file, so the
    checkpoint outlives the head pod."""
    docs = _documents(path)
    head = _rayservice(path)["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    (container,) = head["containers"]
    (directory,) = [e["value"] for e in container["env"] if e["name"] == "ADASPEC_CONTROLLER_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert volume["persistentVolumeClaim"]["claimName"] in claims


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_every_pod_starts_ray_with_its_workers_at_normal_priority(path):
    """The engine runs in Ray's worker processes, which Ray starts at niceness 15 unless
    RAY_worker_niceness says otherwise in the environment of `ray start` (serve_app/ray_env.py)."""
    cluster = _rayservice(path)["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert {k: env.get(k) for k in RAY_ENV} == RAY_ENV, (path.name, container["name"])


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_every_pod_declares_the_metrics_port_prometheus_scrapes(path):
    """Ray's metrics agent on each pod (adaspec's, vLLM's and Serve's series; the dashboard in
    cluster/grafana/) exports on `metrics-export-port`, declared as the container port `metrics`
    that a PodMonitor selects."""
    for group in _groups(_rayservice(path)):
        port = int(group["rayStartParams"]["metrics-export-port"])
        (container,) = group["template"]["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in container.get("ports", [])}.get("metrics") == port, \
            (path.name, group.get("groupName", "head"))


def _pod_ray_resources(group: dict) -> dict[str, float]:
    """What Ray declares on one pod of a group: rayStartParams, else (as KubeRay does) the
    container's limits."""
    params = group["rayStartParams"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return {"CPU": float(params.get("num-cpus", limits.get("cpu", 0))),
            "GPU": float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))}


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_one_replica_per_worker_pod(path):
    """Each worker pod holds exactly one replica's placement group, so the worker group's
    maxReplicas is the replica ceiling the autoscaler can reach; the head holds none."""
    doc = _rayservice(path)
    cfg = AppConfig.model_validate(_app_args(doc))
    bundles = _placement(cfg)["placement_group_config"]["bundles"]
    need = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
    cluster = doc["spec"]["rayClusterConfig"]
    head = _pod_ray_resources(cluster["headGroupSpec"])
    assert head["CPU"] == 0 and head["GPU"] == 0
    for group in cluster["workerGroupSpecs"]:
        have = _pod_ray_resources(group)
        fits = min(have[k] // need[k] for k in need if need[k] > 0)
        assert fits == 1, (group["groupName"], have, need)


@pytest.mark.parametrize("manifest,config", [
    ("rayservice.yaml", "app-gpu-tp2.yaml"),          # a draft model
    ("rayservice-eagle3.yaml", "app-gpu-eagle3.yaml"),  # an EAGLE-3 head
])
def test_rayservice_runs_the_gpu_config(manifest, config):
    doc = _rayservice(REPO / "cluster" / manifest)
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    gpu = yaml.safe_load((REPO / "configs" / config).read_text())
    assert serve_config["applications"] == gpu["applications"]
    (workers,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    tp = gpu["applications"][0]["args"]["tensor_parallel_size"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == tp  # one pod holds one replica's tensor-parallel group


def test_cpu_rayservice_runs_the_cluster_config():
    """The CPU manifest is configs/app-cluster.yaml's app, but for the replica count
    (autoscaling), the admin token (from a Secret rather than loopback-only routes) and the
    OpenAI routes' API key (the local app serves on loopback without one)."""
    doc = _rayservice(REPO / "cluster" / "rayservice-cpu.yaml")
    args = _app_args(doc)
    local = yaml.safe_load((REPO / "configs" / "app-cluster.yaml").read_text())["applications"][0]["args"]
    differ = {"num_replicas", "autoscaling", "admin", "api_key_env"}
    assert {k: v for k, v in args.items() if k not in differ} == {k: v for k, v in local.items() if k not in differ}
    assert args["autoscaling"]["min_replicas"] >= local["num_replicas"]
    for group in _groups(doc):
        for container in group["template"]["spec"]["containers"]:
            assert container["image"].endswith("-cpu")
            assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_crd_validation_catches_typos_and_bad_types():
    doc = _rayservice(REPO / "cluster" / "rayservice.yaml")
    validator = _crd_validator("RayService")
    typo = copy.deepcopy(doc)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    assert any("minReplica" in e.message for e in validator.iter_errors(typo))
    unquoted = copy.deepcopy(doc)
    unquoted["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert list(validator.iter_errors(unquoted))
