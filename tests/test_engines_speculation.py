"""The consistency `spec` family in `fidelity engines`: speculative arms (`serving = { mtp =
K }`) against a baseline arm without speculation, run one at a time -- the baseline first,
its replies recorded, each speculative arm's compared with them. Against real `fidelity
serve` processes: the golden decoding speculatively is lossless, the planted BOS injection
(antirez/ds4 #750) is flagged with its step and its special token; the roles and the launch
order are checked before anything runs."""
import json
import subprocess

import pytest

from needle_util import ROOT, fidelity_cmd, free_port
from test_engines import HANG
from fidelity.engines.run import consistency_settings
from fidelity.engines.spec import SpecError, load_spec
from fidelity.engines.speculation import launch_order, settings_for

ARMS = """
[engines.fs]
kind = "fidelity"
model = "tiny-needle-v2"           # the embedded model with an MTP layer
port = {port}
start_timeout = {hang}
stop_grace = 5

[[arms]]
name = "spec2"
engine = "fs"
toggles = "golden"
serving = {{ mtp = 2 }}

[[arms]]
name = "plain"
engine = "fs"
toggles = "golden"

[[arms]]
name = "bos"
engine = "fs"
toggles = "correction_row_not_snapshotted"
serving = {{ mtp = 2 }}
"""


OTHER = '[[arms]]\nname = "other"\nengine = "fs"\ntoggles = "decode_splitk_by_batch"\n'


def _spec(tmp_path, consistency: str, arms: str = ARMS):
    p = tmp_path / "spec.toml"
    p.write_text(f'[run]\ntasks = ["consistency"]\nout = "{tmp_path / "out"}"\n[run.consistency]\n'
                 f'{consistency}\n' + arms.format(port=free_port(), hang=HANG))
    return load_spec(p)


def test_roles_and_launch_order(tmp_path):
    spec = _spec(tmp_path, 'families = ["spec"]', ARMS.replace('[[arms]]\nname = "bos"', OTHER + '\n[[arms]]\nname = "bos"'))
    cs = consistency_settings(spec)
    assert cs.spec.baseline == "plain"                    # the first launched arm without mtp
    assert [a.name for a in launch_order(spec, cs)] == ["plain", "spec2", "other", "bos"]
    by = {a.name: a for a in spec.arms}
    assert settings_for(by["other"], cs).families == ()    # neither speculative nor the baseline
    assert settings_for(by["bos"], cs) is cs and settings_for(by["plain"], cs) is cs
    cs = consistency_settings(_spec(tmp_path, 'families = ["spec"]\n[run.consistency.spec]\nbaseline = "other"',
                                    ARMS + OTHER))
    assert cs.spec.baseline == "other"


@pytest.mark.parametrize("table,frag", [
    ('[run.consistency.spec]\nbaseline = "spec2"', "'spec2' decodes speculatively itself"),
    ('[run.consistency.spec]\nbaseline = "nope"', "'nope' is not an arm"),
    ('[run.consistency.spec]\nbaseline = 3', "must be an arm name"),
])
def test_baseline_mistakes_are_named(tmp_path, table, frag):
    with pytest.raises(SpecError, match=frag):
        consistency_settings(_spec(tmp_path, 'families = ["spec"]\n' + table))


@pytest.mark.slow           # three stand-in servers one after another: CI runs it in make test-slow
def test_spec_family_in_an_engines_run(tmp_path):
    spec = _spec(tmp_path, 'families = ["spec"]\nprobes = 2\nlength = 200\nmax_tokens = 16\n'
                           '[run.consistency.spec]\nseeds = 4')
    p = subprocess.run(fidelity_cmd("engines", "run", str(spec.path)), cwd=ROOT,
                       capture_output=True, text=True, timeout=6 * HANG)
    assert p.returncode == 1, p.stderr[-3000:]               # flagged: bos's spec condition
    root = tmp_path / "out" / "engines" / "spec"
    st = json.loads((root / "state.json").read_text())
    launched = [e["arm"] for e in st["run log"][-1]["events"] if e["event"] == "launched"]
    assert launched == ["plain", "spec2", "bos"]
    assert st["spec2"]["consistency"]["flagged"] == [] and st["bos"]["consistency"]["flagged"] == ["spec"]
    lossless = [v for v in st["spec2"]["consistency"]["verdict"] if v.startswith("`spec2` (spec, vs `plain`)")]
    assert lossless and "lossless" in lossless[0] and "Acceptance length" in lossless[0]
    bos = next(v for v in st["bos"]["consistency"]["verdict"] if v.startswith("`bos` (spec, vs `plain`)"))
    assert "special token(s) injected" in bos and "greedy tokens part from the baseline's at" in bos, bos
    assert "Looks like a logits row read corrupt after a verify: BOS emitted" in bos and "2 drafts" in bos
