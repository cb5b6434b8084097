"""One rank of gpu_check.py's distributed check (launched through torchrun, NCCL, one GPU
per rank): the tiny golden's lockstep over 2 pipeline ranks; rank 0 pickles the tables."""
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from distributed.cases import arms, prompts, tables  # noqa: E402
from fidelity.ab.lockstep import LockstepRunner, RunnerSettings, RunSite  # noqa: E402
from fidelity.pipeline.stage import init_stage, shutdown  # noqa: E402
from reference_model import random_weights, tiny  # noqa: E402

stage = init_stage(tiny(), timeout_s=600)
w = random_weights(tiny(), seed=0)
res = LockstepRunner(w, arms(), RunnerSettings(decode_steps=2, devices=(str(stage.device),)),
                     {"bug": "engine"}, RunSite(stage=stage)).run(prompts())
if stage.first:
    Path(sys.argv[1]).write_bytes(pickle.dumps({"backend": str(stage.device), "tables": tables(res)}))
shutdown()
