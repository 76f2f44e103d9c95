"""Security: servers bind 127.0.0.1 by default, weights never load through pickle, and secrets are never
printed, logged as MLflow params or written to the resolved config artifact. (Untrusted reward code under
time and memory limits: tests/faults/test_reward_faults.py.)"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from rlray import cli
from rlray.config import Config, ConfigError, config_from_dict
from rlray.envs.agents.agent_host import AgentHost
from rlray.launch import driver
from rlray.observe.tracking import Tracker
from rlray.reward.server import deploy_reward_app

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"access": "AKIASECRETKEY42", "secret": "s3cr3t-Value-42", "hook": "https://hooks.example/T0k3n-42"}


def _hosts(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """Returns {dotted key: default} of every config field whose name ends in 'host', at any depth."""
    found = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            found |= _hosts(ann, f"{prefix}{name}.")
        elif name.endswith("host"):
            found[f"{prefix}{name}"] = field.default
    return found


def test_every_server_binds_localhost_by_default(monkeypatch):
    hosts = _hosts(Config)
    assert hosts == {"reward.server.host": "127.0.0.1", "monitor.host": "127.0.0.1", "env.gateway_host": "127.0.0.1"}
    assert inspect.signature(AgentHost).parameters["gateway_host"].default == "127.0.0.1"  # the agents' gateway
    assert inspect.signature(deploy_reward_app).parameters["host"].default == "127.0.0.1"  # `rlray serve-reward`
    # the embedded Ray's dashboard (when it is included)
    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(driver.ray, "init", lambda **kwargs: calls.append(kwargs))
    driver.init_ray(include_dashboard=True)
    assert calls[0]["dashboard_host"] == "127.0.0.1" and calls[0]["include_dashboard"] is True
    # the MLflow UI and server as the docs start them (cluster configs: tests/test_cluster.py)
    commands = [line for doc in [REPO / "README.md", *REPO.glob("docs/**/*.md")] for line in doc.read_text().splitlines()
                if re.search(r"mlflow (ui|server)\b", line)]  # fmt: skip
    assert commands and all("--host 127.0.0.1" in c for c in commands), commands


# --------------------------------------------------------------------------------------------
# Weights: safetensors, or torch.load(weights_only=True); never pickle
# --------------------------------------------------------------------------------------------
# pickle.loads in the sandbox (rlray.sandbox) round-trips exceptions raised by reward functions and environments, not weights
ALLOWED_PICKLE = {("rlray/sandbox.py", "pickle.loads")}
# peft's PeftModel.from_pretrained has no use_safetensors flag: it reads adapter_model.safetensors whenever the file
# exists, and rlray.models.adapters.check_adapter refuses an adapter folder without it before the call
ALLOWED_FROM_PRETRAINED = {("rlray/models/adapters.py", "PeftModel.from_pretrained")}


def _unsafe_loads(source: str, name: str) -> list[str]:
    """Returns 'file:line call' for each weight load that could unpickle: torch.load without
    weights_only=True, pickle/joblib/dill loads, and model from_pretrained without use_safetensors=True
    (GGUF files excepted: they hold tensors, not pickles)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
        call = f"{owner}.{node.func.attr}"
        kwargs = {k.arg: k.value for k in node.keywords}
        set_true = {key for key, value in kwargs.items() if isinstance(value, ast.Constant) and value.value is True}
        if call == "torch.load" and "weights_only" not in set_true:
            found.append(f"{name}:{node.lineno} {call}")
        elif owner in ("pickle", "joblib", "dill", "cloudpickle") and node.func.attr in ("load", "loads"):
            if (name, call) not in ALLOWED_PICKLE:
                found.append(f"{name}:{node.lineno} {call}")
        elif (node.func.attr == "from_pretrained" and "Model" in owner and "use_safetensors" not in set_true
              and "gguf_file" not in kwargs and (name, call) not in ALLOWED_FROM_PRETRAINED):  # fmt: skip
            found.append(f"{name}:{node.lineno} {call}")
    return found


def test_weights_load_through_safetensors_or_weights_only():
    # the check itself finds each unsafe form
    bad = ("torch.load(p)\ntorch.load(p, weights_only=False)\npickle.load(f)\n"
           "AutoModelForCausalLM.from_pretrained(d)\ntorch.load(p, weights_only=True)\n"
           "AutoModelForCausalLM.from_pretrained(d, use_safetensors=True)\n")  # fmt: skip
    assert _unsafe_loads(bad, "x.py") == ["x.py:1 torch.load", "x.py:2 torch.load", "x.py:3 pickle.load",
                                          "x.py:4 AutoModelForCausalLM.from_pretrained"]  # fmt: skip
    files = sorted(REPO.glob("rlray/**/*.py"))
    assert len(files) > 40
    found = [hit for f in files for hit in _unsafe_loads(f.read_text(), str(f.relative_to(REPO)))]
    assert found == []


# --------------------------------------------------------------------------------------------
# Secrets: never printed, never MLflow params, never in config/resolved.yaml
# --------------------------------------------------------------------------------------------
def _secret_tree(tmp_path: Path) -> dict:
    return {"run": {"output_dir": str(tmp_path / "out")},
            "checkpoint": {"uri": "s3://bucket/snapshots", "s3": {"access_key_id": SECRETS["access"],
                                                                  "secret_access_key": SECRETS["secret"]}},
            "monitor": {"alerts": ["log", "webhook"], "webhook_url": SECRETS["hook"]}}  # fmt: skip


def _leaks(text: str) -> list[str]:
    return [name for name, value in SECRETS.items() if value in text or value.split("/")[-1] in text]


def test_secrets_never_reach_mlflow_params_or_the_resolved_config(tmp_path):
    cfg = config_from_dict(_secret_tree(tmp_path))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "secrets")
    tracker.log_config(cfg)  # what the driver logs at the start of every run
    client = MlflowClient(uri)
    params = client.get_run(tracker.run_id).data.params
    assert params["checkpoint.s3.secret_access_key"] == "**********" and params["monitor.webhook_url"] == "**********"
    assert _leaks(str(params)) == []
    artifact = Path(client.download_artifacts(tracker.run_id, "config/resolved.yaml", str(tmp_path)))
    resolved = yaml.safe_load(artifact.read_text())
    assert resolved["checkpoint"]["s3"]["access_key_id"] == "**********"
    assert _leaks(artifact.read_text()) == []


def test_secrets_are_never_printed(tmp_path, capsys, caplog, ray_starts):
    # a value error on a secret field shows a mask, not the value
    with pytest.raises(ConfigError) as err:
        config_from_dict({"monitor": {"webhook_url": {"url": SECRETS["hook"]}}})
    assert "monitor.webhook_url='**********'" in str(err.value) and _leaks(str(err.value)) == []
    # the CLI on a run that fails at start (snapshot storage unreachable): nothing printed or logged names a secret
    tree = _secret_tree(tmp_path) | {"model": {"path": str(tmp_path / "no-model")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert cli.main(["train", str(path), "monitor.heartbeat_s=5"]) == 2
    assert [start.cancelled for start in ray_starts] == [True]  # Ray began beside the checks and was stopped unused
    out = capsys.readouterr()
    assert "model.path" in out.err
    assert _leaks(out.out + out.err + caplog.text + repr(config_from_dict(tree)) + str(config_from_dict(tree))) == []
