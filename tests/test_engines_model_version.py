"""`engine` spellings of an in-process engine's arms resolve for its checkpoint's version,
read from its config.json when the spec is loaded: a DeepSeek-V4.1 checkpoint's `engine`
arm holds V4.1's optimizations, not V4's (issue 39); launched engines keep V4's. And a whole
V4.1 engines run (examples/engines/v41-inprocess.toml)."""
import json
import subprocess

import pytest

from needle_util import ROOT, fidelity_cmd, free_port
from fidelity.engines.spec import load_spec
from kernel_toggles import ToggleSet
from reference_model.v41.checkpoint_write import hf_config_dict
from reference_model.v41.config import tiny_v41

SPEC = """
[engines.here]
kind = "inprocess"
devices = "cpu"
model = "{model}"
[[arms]]
name = "golden"
engine = "here"
[[arms]]
name = "eng"
engine = "here"
toggles = "engine"
[[designs]]
engine = "here"
kind = "one-at-a-time"
prefix = "one"
"""


def _arms(tmp_path, model):
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(model=model))
    return {a.name: a for a in load_spec(p).arms}


def test_engine_spelling_follows_the_in_process_checkpoint(tmp_path):
    ck = tmp_path / "v41"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(hf_config_dict(tiny_v41())))
    v41, v4 = ToggleSet.parse("engine", "v41"), ToggleSet.parse("engine", "v4")
    assert v41 != v4
    arms = _arms(tmp_path, ck)
    assert arms["eng"].toggles == v41 and arms["eng"].factors == set(v41.names)
    assert {a.toggles.names[0] for n, a in arms.items() if n.startswith("one:")} == set(v41.names)
    assert _arms(tmp_path, "tiny-needle")["eng"].toggles == v4


@pytest.mark.slow           # the golden, three floors and one arm in process, then a served arm: ~1.5 min
def test_v41_engines_run_end_to_end(tmp_path):
    """examples/engines/v41-inprocess.toml on the embedded V4.1 checkpoint: the in-process
    `engine` arm holds V4.1's optimizations, the served golden equals the in-process one
    (KLD exactly 0), the golden ran before the launch."""
    text = (ROOT / "examples" / "engines" / "v41-inprocess.toml").read_text()
    spec = tmp_path / "v41.toml"
    spec.write_text(text.replace("port = 18779", f"port = {free_port()}"))
    p = subprocess.run(fidelity_cmd("engines", "run", str(spec), "--out", str(tmp_path)), cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    root = tmp_path / "engines" / "v41"
    st = json.loads((root / "state.json").read_text())
    events = [e["event"] for e in st["run log"][-1]["events"]]
    assert events.index("memory released") < events.index("launched")
    summary = (root / "summary.md").read_text()
    v41 = ToggleSet.parse("engine", "v41")
    assert f"| engine | here | arm | {','.join(v41.names)} |" in summary
    assert "| served | nothing flagged | 0 [0, 0] |" in summary
