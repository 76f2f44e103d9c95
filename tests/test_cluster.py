"""cluster/: the GPU Dockerfile, the AWS cluster-launcher config and the KubeRay manifests agree and validate.

- Dockerfile: parsed with dockerfile-parse; its image tag is the one every config names, its base
  is Ray's CUDA image at the Ray version rlray pins, and it installs rlray with the vllm extra.
- aws-gpu.yaml: Ray's own launcher validation (``prepare_config`` + ``validate_config``, what
  ``ray up`` runs before touching AWS).
- KubeRay: the RayCluster/RayJob fields as JSON Schema (tests/fixtures/kuberay_v1.schema.json; no
  package ships KubeRay's CRDs) and every pod template against Kubernetes' own schema
  (kubernetes-validate, strict).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import tomllib
import yaml
from dockerfile_parse import DockerfileParser

from rlray.config import load_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
IMAGE_LABEL = "org.opencontainers.image.ref.name"
SCHEMA = json.loads((REPO / "tests" / "fixtures" / "kuberay_v1.schema.json").read_text())


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _ray_pin() -> str:
    ray_dep = next(d for d in _pyproject()["project"]["dependencies"] if d.startswith("ray["))
    return ray_dep.split("==")[1]


def _dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(CLUSTER / "Dockerfile"))


def _launcher() -> dict:
    return yaml.safe_load((CLUSTER / "aws-gpu.yaml").read_text())


def _manifest(name: str) -> dict:
    return yaml.safe_load((CLUSTER / "kuberay" / name).read_text())


def _pod_templates(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]


def _images(node) -> list[str]:
    """Returns every containers[].image under ``node`` (a parsed manifest)."""
    if isinstance(node, dict):
        found = [c["image"] for c in node["containers"]] if "containers" in node else []
        return found + [i for k, v in node.items() if k != "containers" for i in _images(v)]
    if isinstance(node, list):
        return [i for v in node for i in _images(v)]
    return []


# --------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------
def test_dockerfile_is_the_cuda_ray_image_at_rlrays_versions():
    df = _dockerfile()
    # rayproject/ray:<ray>-py311-cu128: Ray's CUDA 12.8 image, at the version pyproject.toml pins
    assert re.fullmatch(rf"rayproject/ray:{re.escape(_ray_pin())}-py311-cu12\d", df.baseimage), df.baseimage
    assert df.labels["org.opencontainers.image.version"] == _pyproject()["project"]["version"]
    assert df.labels[IMAGE_LABEL].endswith(":" + _pyproject()["project"]["version"])
    runs = [i["value"] for i in df.structure if i["instruction"] == "RUN"]
    assert any('pip install ".[vllm]"' in r for r in runs), runs
    assert "vllm" in _pyproject()["project"]["optional-dependencies"]
    copied = [i["value"].split()[-2] for i in df.structure if i["instruction"] == "COPY"]
    assert {"rlray", "configs", "jobs"} <= set(copied)


def test_every_config_names_the_dockerfiles_image():
    image = _dockerfile().labels[IMAGE_LABEL]
    assert _launcher()["docker"]["image"] == image
    for name in ("raycluster.yaml", "rayjob.yaml"):
        images = _images(_manifest(name))
        assert len(images) == 3 and set(images) == {image}, (name, images)  # head + 2 worker groups


# --------------------------------------------------------------------------------------------
# Ray cluster launcher (AWS)
# --------------------------------------------------------------------------------------------
def test_launcher_config_passes_rays_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(_launcher()))
    validate_config(prepared)
    # the validation is real: a wrong type is refused
    broken = copy.deepcopy(prepared)
    broken["idle_timeout_minutes"] = "15 minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(broken)


def test_launcher_layout_head_a100_spot_with_on_demand_fallback():
    cfg = _launcher()
    assert cfg["provider"]["type"] == "aws" and cfg["idle_timeout_minutes"] == 15
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    spot, ondemand = types["gpu_a100_spot"], types["gpu_a100_ondemand"]
    assert spot["node_config"]["InstanceType"] == ondemand["node_config"]["InstanceType"] == "p4d.24xlarge"
    assert spot["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"}
    assert "InstanceMarketOptions" not in ondemand["node_config"]
    # same resources, spot preferred; the autoscaler falls back when a spot launch fails
    assert spot["resources"] == ondemand["resources"] == {"CPU": 96, "GPU": 8}
    assert spot["priority"] > ondemand["priority"]
    assert spot["min_workers"] == ondemand["min_workers"] == 0
    assert cfg["setup_commands"] == ['pip install -e "$HOME/rlray[vllm]"']
    assert cfg["file_mounts"] == {"~/rlray": "."}
    assert all("--dashboard-host=127.0.0.1" in c for c in cfg["head_start_ray_commands"] if "ray start" in c)


# --------------------------------------------------------------------------------------------
# KubeRay
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_kuberay_manifest_passes_the_schema(name):
    manifest = _manifest(name)
    jsonschema.Draft202012Validator(SCHEMA).validate(manifest)
    spec = manifest["spec"] if manifest["kind"] == "RayCluster" else manifest["spec"]["rayClusterSpec"]
    version = kubernetes_validate.latest_version()
    for template in _pod_templates(spec):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(pod_template, version, strict=True)


def test_kuberay_schema_catches_mistakes():
    validator = jsonschema.Draft202012Validator(SCHEMA)
    good = _manifest("raycluster.yaml")
    typo = copy.deepcopy(good)
    typo["spec"]["workerGroupSpec"] = typo["spec"].pop("workerGroupSpecs")
    number = copy.deepcopy(good)
    number["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 8  # map[string]string in the CRD
    missing = copy.deepcopy(good)
    del missing["spec"]["workerGroupSpecs"][0]["maxReplicas"]
    for bad in (typo, number, missing):
        assert not validator.is_valid(bad)
    pod = copy.deepcopy(good["spec"]["workerGroupSpecs"][0]["template"])
    pod["spec"]["containers"][0]["resource"] = pod["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": pod},
                                     kubernetes_validate.latest_version(), strict=True)


def test_kuberay_layout_matches_the_launcher():
    cluster, job = _manifest("raycluster.yaml"), _manifest("rayjob.yaml")
    spec = cluster["spec"]
    assert job["spec"]["rayClusterSpec"] == spec  # the RayJob runs on the same layout
    assert spec["rayVersion"] == _ray_pin()
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == _launcher()["idle_timeout_minutes"] * 60
    spot, ondemand = spec["workerGroupSpecs"]
    assert spot["template"]["spec"]["nodeSelector"] == {
        "node.kubernetes.io/instance-type": "p4d.24xlarge", "karpenter.sh/capacity-type": "spot"}
    assert ondemand["template"]["spec"]["nodeSelector"]["karpenter.sh/capacity-type"] == "on-demand"
    gpus = [g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for g in (spot, ondemand)]
    assert gpus == ["8", "8"]
    assert (spot["minReplicas"], ondemand["minReplicas"]) == (0, 0)
    head_env = {e["name"]: e["value"] for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert head_env["RAY_enable_autoscaler_v2"] == "1"


def test_rayjob_runs_jobs_train_with_a_valid_config_and_the_jobs_runtime_env():
    spec = _manifest("rayjob.yaml")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["submissionMode"] == "K8sJobMode"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    jobs_env = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    assert runtime_env["env_vars"] == jobs_env["env_vars"]
    assert int(runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) >= 60
    # the entrypoint loads as an rlray config (paths in the image map to this checkout)
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["python", "/home/ray/rlray/jobs/train.py"]
    config, overrides = argv[2].replace("/home/ray/rlray", str(REPO)), argv[3:]
    cfg = load_config(config, overrides)
    assert cfg.resources.rollout.gpus == 1 and cfg.resources.learner.gpus == 1
    assert cfg.run.output_dir.startswith("s3://") and cfg.tracking.mlflow_uri.startswith("http")
    copied = {i["value"].split()[-1] for i in _dockerfile().structure if i["instruction"] == "COPY"}
    assert {"./jobs", "./configs"} <= copied  # the image holds what the entrypoint runs
