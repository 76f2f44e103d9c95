"""rlray.lean_imports: transformers imported without scikit-learn, nothing hidden (issue 39). Each check runs in a
fresh interpreter, since the hook acts at a module's first import."""

import json
import subprocess
import sys

from rlray import lean_imports


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transformers_without_rlray_imports_sklearn():
    # the control: transformers' candidate generator still imports scikit-learn at import (else the hook is moot)
    got = _fresh("import json, sys; from transformers import AutoTokenizer; "
                 "print(json.dumps({'sklearn': 'sklearn' in sys.modules}))")
    assert got == {"sklearn": True}


def test_rlray_defers_sklearn_and_keeps_roc_curve_exact():
    got = _fresh(
        "import json, sys\n"
        "import rlray\n"
        "from transformers import AutoTokenizer\n"
        "import transformers.generation.candidate_generator as cg\n"
        "before = 'sklearn' in sys.modules\n"
        "fpr, tpr, thr = cg.roc_curve([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])\n"
        "from sklearn.metrics import roc_curve\n"
        "ref = roc_curve([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])\n"
        "print(json.dumps({'before': before, 'available': cg.is_sklearn_available(),\n"
        "                  'ours': [fpr.tolist(), tpr.tolist()], 'ref': [ref[0].tolist(), ref[1].tolist()],\n"
        "                  'again': rlray.lean_imports.install()}))\n")
    assert got["before"] is False  # AutoTokenizer's import reached the candidate generator without scikit-learn
    assert got["available"] is True  # the module's runtime check answers the truth
    assert got["ours"] == got["ref"] == [[0.0, 0.0, 0.5, 0.5, 1.0], [0.0, 0.5, 0.5, 1.0, 1.0]]  # sklearn's example
    assert got["again"] is False  # the generator is imported: nothing left to defer


def test_heavy_rlray_modules_import_no_sklearn():
    # the driver, the rollout actor and the learner rank each load a tokenizer or a model
    got = _fresh("import json, sys; import rlray.launch.driver, rlray.rollout.engine, rlray.run.worker; "
                 "print(json.dumps({'sklearn': 'sklearn' in sys.modules}))")
    assert got == {"sklearn": False}


def test_the_deferred_roc_curve_is_sklearns():
    fpr, tpr, thresholds = lean_imports.roc_curve([1, 1, 2, 2], [0.1, 0.4, 0.35, 0.8], pos_label=2)
    assert (fpr.tolist(), tpr.tolist()) == ([0.0, 0.0, 0.5, 0.5, 1.0], [0.0, 0.5, 0.5, 1.0, 1.0])  # sklearn's docs
    assert thresholds.tolist()[1:] == [0.8, 0.4, 0.35, 0.1]


def test_the_driver_imports_only_what_runs_before_ray_starts():
    # issue 39: the driver's module imports what the config, the preflight and ray.init need; Ray Train, MLflow, the
    # learner, the actors, SciPy (transformers' losses), math-verify and datasets load where they are used
    moved = ["ray.train", "mlflow", "rlray.observe.tracking", "rlray.learner.policy", "rlray.models.heads",
             "rlray.launch.actors", "rlray.launch.trainer", "rlray.run.build", "rlray.run.worker", "scipy",
             "math_verify", "datasets", "pandas"]
    got = _fresh(f"import json, sys; import rlray.launch.driver as d; "
                 f"print(json.dumps({{'moved': [m for m in {moved!r} if m in sys.modules], "
                 f"'kept': [callable(getattr(d, n)) for n in ('init_ray', 'resolve_paths', 'run_training', "
                 f"'eval_setup', 'evaluate_checkpoint', 'max_model_len', 'worker_env', 'start_reward_server')], "
                 f"'needed': [m in sys.modules for m in ('ray', 'torch', 'transformers')]}}))")
    assert got == {"moved": [], "kept": [True] * 8, "needed": [True, True, True]}
