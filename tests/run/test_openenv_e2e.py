"""End to end: 2 GRPO steps on tiny-random against the OpenEnv template environment (`openenv init` at test time,
served by uvicorn from .venvs/openenv, one server per environment host), its rows mixed with single-turn rows; the
server crashes once in step 1 (the test's wrapper app exits the process at the first episode step it gets): the episodes
open on it fail, counted, the host restarts it, step 2's episodes all finish, and the run ends FINISHED."""

import math
from pathlib import Path

import pytest

from rlray.observe.tracking import get_run_metrics
from tests.envs.servers.openenv_template import openenv_init, openenv_venv

# Wraps the template's app: at the first step of any episode the server writes the marker and exits (a server dying
# mid-run, while the episodes of step 1 are open on it); the restarted process sees the marker and serves normally.
CRASH_APP = '''
import os
from server.app import app  # noqa: F401 - the template's app, served as crash_app:app
import server.echo_env_environment as module

Env = next(v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__)
_step = Env.step


def step(self, action):
    marker = os.environ["CRASH_MARKER"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return _step(self, action)


Env.step = step
'''

CONFIG = """
run: {{seed: 0, max_steps: 2, output_dir: {out}}}
model: {{path: tiny-random, dtype: float32}}
data: {{train_files: [{rows}], max_prompt_tokens: 128, shuffle: false}}
env:
  servers:
    echo:
      protocol: openenv
      command: python -m uvicorn crash_app:app --host {{host}} --port {{port}}
      python: {venv}
      cwd: {folder}
      env: {{CRASH_MARKER: {marker}}}
      max_sessions: 8
      openenv: {{action_field: message, observation_field: echoed_message}}
  max_turns: 3
  max_observation_tokens: 32
  # a reset waits for the crashed server's restart (a Python start and uvicorn's imports): over 60 s once, with four
  # test suites on 2 cores; the subject is that the restarted server serves step 2, not how fast it restarts
  step_timeout_s: 300
reward:
  functions:
    - {{function: exact_match, weight: 1.0, kwargs: {{column: solution}}}}
# tiny-random's turns rarely end by themselves, and a turn cut at max_new_tokens ends its episode unstepped: common
# letters as stop strings end its turns early, so the environment sees them
rollout: {{samples_per_prompt: 2, max_new_tokens: 16, stop: [" ", "e", "a", "o", "i", "t", "n", "s"]}}
learner: {{prompts_per_step: 3, lr: 1.0e-3, sequences_per_minibatch: 6, sequences_per_microbatch: 3}}
eval: {{num_problems: 0}}
tracking: {{experiment: smoke, mlflow_uri: "sqlite:///{out}/mlflow.db"}}
guard: {{kl_threshold: 10.0}}
monitor: {{port: 0, heartbeat_s: 10, restart_delay_s: 1}}
"""


@pytest.mark.ray
def test_openenv_template_two_steps_with_a_server_crash(ray_session, tmp_path):
    from rlray.config import load_config
    from rlray.launch.driver import run_training

    venv = openenv_venv()
    folder = openenv_init(tmp_path, "echo_env", sessions=8)
    (folder / "crash_app.py").write_text(CRASH_APP)
    rows = tmp_path / "rows.jsonl"
    # per step 3 prompts: 2 OpenEnv rows (4 episodes) and 1 single-turn row (2 samples)
    rows.write_text("\n".join([
        '{"prompt": "Say hello.", "environment": "echo"}', '{"prompt": "Say bye.", "environment": "echo"}',
        '{"prompt": "What is 1 + 1?", "solution": "2"}'] * 2) + "\n")
    marker = tmp_path / "crashed"
    cfg_path = tmp_path / "openenv.yaml"
    cfg_path.write_text(CONFIG.format(out=tmp_path / "out", rows=rows, venv=venv, folder=folder, marker=marker))
    cfg = load_config(cfg_path)
    result = run_training(cfg)
    assert result.status == "FINISHED"
    assert marker.exists()  # the server did crash
    metrics = {k: dict(v) for k, v in get_run_metrics(f"sqlite:///{tmp_path}/out/mlflow.db", result.run_id).items()}
    assert metrics["env/episodes"] == {1: 4.0, 2: 4.0}
    # step 1: the crash failed the OpenEnv episodes open on the server (all 4: they step together), counted, not fatal
    assert metrics["env/failed"][1] == 4.0 and metrics["env/failed/env_error"][1] == 4.0
    # step 2: the restarted server served every episode (the template never says done: a limit ends them)
    assert metrics["env/failed"][2] == 0.0
    assert sum(v[2] for k, v in metrics.items() if k.startswith("env/stop_reason/") and 2 in v) == 4.0
    assert metrics["env/turns_mean"][2] >= 1.0
    # the template's reward, 0.1 per character the model sent, summed over the turns, is the env term
    assert metrics["reward/env"][2] > 0.0 and math.isfinite(metrics["learner/pg_loss"][2])
    assert sorted(metrics["learner/grad_norm"]) == [1, 2]


def test_config_rejects_a_server_without_port(tmp_path):
    from rlray.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("model: {path: tiny-random}\ndata: {train_files: [x.jsonl]}\n"
                    "env: {servers: {echo: {protocol: openenv, command: python -m server.app}}}\n")
    with pytest.raises(ConfigError, match=r"has no \{port\}"):
        load_config(path)
    assert Path(path).exists()
