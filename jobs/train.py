"""`ray job submit` entry point: runs exactly what `rlray train CONFIG [key=value ...]` runs.

    ray job submit --address http://HEAD:8265 --working-dir . --runtime-env jobs/runtime_env.yaml \
        -- python jobs/train.py configs/grpo_gsm8k_smollm2.yaml learner.lr=1e-5

The working directory is uploaded to the cluster and put first on the job's PYTHONPATH by Ray, so
the `rlray` imported here is the uploaded checkout; the heavy stack (torch, vLLM, Ray) is the
cluster's own install (see jobs/runtime_env.yaml). `ray job stop` sends SIGTERM: the driver stops
the run at the next step boundary, writes the final snapshot and marks the MLflow run KILLED.
"""

import sys
from pathlib import Path

import rlray
from rlray.cli import main

if __name__ == "__main__":
    print(f"rlray {rlray.__version__} from {Path(rlray.__file__).resolve().parent}", flush=True)
    sys.exit(main(["train", *sys.argv[1:]]))
