"""rlray.algos is pure torch: it imports in a fresh process where Ray, vLLM and MLflow cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BLOCKED = ("ray", "vllm", "mlflow", "transformers", "trl", "datasets", "pyarrow")

SCRIPT = f"""
import sys
BLOCKED = {BLOCKED!r}

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked for this test: {{name}}")
        return None

sys.meta_path.insert(0, Blocker())
sys.path.insert(0, {str(REPO)!r})
for name in BLOCKED:  # the finder must really block, or the check below proves nothing
    try:
        __import__(name)
    except ImportError as err:
        assert "blocked for this test" in str(err), err
    else:
        raise AssertionError(f"{{name}} imported despite the blocker")
import rlray.algos as algos
assert callable(algos.grpo_advantages) and callable(algos.ppo_clip_loss)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not loaded, loaded
print("ok", len(algos.__all__))
"""


def test_import_without_cluster_libraries():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")
