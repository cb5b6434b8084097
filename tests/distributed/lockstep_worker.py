"""One rank of a pipelined lockstep (launched by tests/test_distributed.py through torchrun):
the same arms and prompts as the test's single-process run, on a streamed and on a
resident-quantised copy of one checkpoint; rank 0 pickles the tables it got."""
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distributed.cases import arms, prompts, tables  # noqa: E402
from fidelity.ab.lockstep import LockstepRunner, RunnerSettings, RunSite  # noqa: E402
from fidelity.pipeline.stage import init_stage, shutdown  # noqa: E402
from fidelity.weights.source import checkpoint_config, load_weights  # noqa: E402

ckpt, out = sys.argv[1], Path(sys.argv[2])
stage = init_stage(checkpoint_config(ckpt), timeout_s=300)
got = {}
for mode in ("streamed", "resident-quantised"):
    w, _ = load_weights(ckpt, mode=mode, layers=stage.layers)
    res = LockstepRunner(w, arms(), RunnerSettings(decode_steps=2), {"bug": "engine"}, RunSite(stage=stage)).run(prompts())
    got[mode] = tables(res)
    if mode == "resident-quantised":
        got["layers_read"] = [i for i, r in enumerate(w.raw_layers) if r is not None]
got["ranges"] = [[r.start, r.stop] for r in stage.ranges]
layers_read = stage.gather(got.pop("layers_read"), "layers read")
if stage.first:
    got["layers_read"] = layers_read
    out.write_bytes(pickle.dumps(got))
shutdown()
