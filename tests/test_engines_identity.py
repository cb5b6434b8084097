"""`fidelity engines` asks each launched arm first whether it serves the run's model
(fidelity.kld.identity, as `fidelity kld` does): an arm whose `fidelity serve` loads another
model (the embedded checkpoint with its output head's rows shifted by one) under the same
tokenizer is refused with exit 2 and the probe's numbers, against the baseline's stored
scores, before the arm is scored; the arm serving the golden passes."""
import shutil
import subprocess

import torch

from fidelity.weights.source import EMBEDDED

from checkpoint_util import rewrite_shards
from needle_util import ROOT, fidelity_cmd, free_port

HANG = 900              # a guard against a hung run, never a speed requirement


def test_an_arm_serving_another_model_is_refused_before_it_is_scored(tmp_path):
    ck = tmp_path / "another"
    shutil.copytree(EMBEDDED, ck)
    rewrite_shards(ck, lambda n, t: {n: torch.roll(t, 1, 0) if n == "head.weight" else t})
    spec = tmp_path / "spec.toml"
    spec.write_text(f"""
[run]
baseline = "golden"
tasks = ["kld"]
[run.kld]
lengths = [200]
depths = [50]
decode_steps = 1
[engines.fs]
kind = "fidelity"
port = {free_port()}
start_timeout = {HANG}
stop_grace = 5
[[arms]]
name = "golden"
engine = "fs"
toggles = "golden"
[[arms]]
name = "same"
engine = "fs"
toggles = "golden"
[[arms]]
name = "other"
engine = "fs"
toggles = "golden"
flags = ["--checkpoint", "{ck}"]
""")
    p = subprocess.run(fidelity_cmd("engines", "run", str(spec), "--out", str(tmp_path / "out"), "--quiet"),
                       cwd=ROOT, capture_output=True, text=True, timeout=3 * HANG)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "other does not serve" in p.stderr and "no numerics verdict is made" in p.stderr, p.stderr[-3000:]
    assert "engine `fs`" in p.stderr
    scores = tmp_path / "out" / "engines" / "spec" / "kld" / "scores"
    assert (scores / "same").exists() and not (scores / "other").exists()     # refused before scoring
