"""`engine` spellings of an in-process engine's arms resolve for its checkpoint's version,
read from its config.json when the spec is loaded: a DeepSeek-V4.1 checkpoint's `engine`
arm holds V4.1's optimizations, not V4's (issue 39); launched engines keep V4's."""
import json

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
