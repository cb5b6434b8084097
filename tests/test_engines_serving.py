"""Serving arms in `fidelity engines`: launch-only serving settings (MTP, CUDA graphs, prefix
cache, prefill chunk, deterministic mode, running-request cap) render to each engine's own
flag and env names for SGLang 0.5.23 and vLLM 0.33 (written here from the engines' wheels,
sglang==0.5.23 arg_groups/fields/*.py and vllm==0.33.0 engine/arg_utils.py / envs.py, not
from our output); an engine's serving settings reach every arm and an arm's win; mistakes
are refused by name; and `tasks = ["consistency"]` runs fidelity consistency on each
launched arm of a spec against the stand-in (`fidelity serve`), resumes, and reports."""
import json
import subprocess

import pytest

from fidelity.cli import main
from fidelity.engines.launch import plan_arm
from fidelity.engines.run import consistency_settings
from fidelity.engines.spec import SpecError, load_spec
from kernel_toggles import profiles
from kernel_toggles import serving_settings as SS

from needle_util import ROOT, fidelity_cmd, free_port

HANG = 900              # seconds: a guard against a hung run, never a speed requirement

ENGINES = """
[engines.sg]
kind = "sglang"
version = "0.5.23"
model = "/models/DeepSeek-V4-Flash"
flags = ["--tp", "8"]
serving = { max_running_requests = 64 }
[engines.vl]
kind = "vllm"
version = "0.33.0"
model = "/models/DeepSeek-V4-Flash"
port = 8000
"""

ARMS = """
[[arms]]
name = "sg-mtp"
engine = "sg"
serving = { mtp = 3 }
[[arms]]
name = "sg-plain"
engine = "sg"
[arms.serving]                      # the same as serving = { ... } on one line
mtp = false
cuda_graphs = false
deterministic = true
prefix_cache = false
chunked_prefill_size = 4096
max_running_requests = 8
[[arms]]
name = "vl-mtp"
engine = "vl"
serving = { mtp = true }
[[arms]]
name = "vl-plain"
engine = "vl"
serving = { mtp = 0, cuda_graphs = false, deterministic = true, prefix_cache = false, max_running_requests = 8 }
"""

# the engines' names, from their code (see the module docstring)
SG_MTP3 = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
           "--speculative-num-draft-tokens", "4"]
SG_EAGER = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
VL_MTP1 = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']


def _spec(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return load_spec(p)


def _plans(tmp_path, text=ENGINES + ARMS):
    spec = _spec(tmp_path, text)
    return {a.name: plan_arm(a, spec.engines[a.engine]) for a in spec.arms}


def _after(cmd, flag, n=1):
    i = cmd.index(flag)
    return cmd[i + 1:i + 1 + n] if n > 1 else cmd[i + 1]


def _sub(cmd, seq) -> bool:
    return any(cmd[i:i + len(seq)] == seq for i in range(len(cmd)))


def test_sglang_serving_settings_render_the_0523_names(tmp_path):
    p = _plans(tmp_path)
    mtp, plain = p["sg-mtp"].cmd, p["sg-plain"].cmd
    assert _sub(mtp, SG_MTP3) and not _sub(plain, SG_MTP3[:2])
    assert _after(mtp, "--max-running-requests") == "64"          # the engine's serving setting
    assert _after(plain, "--max-running-requests") == "8"         # the arm's wins, once
    assert plain.count("--max-running-requests") == 1
    assert _sub(plain, SG_EAGER) and not _sub(mtp, SG_EAGER[:1])
    assert "--enable-deterministic-inference" in plain and "--enable-deterministic-inference" not in mtp
    assert "--disable-radix-cache" in plain and "--disable-radix-cache" not in mtp
    assert _after(plain, "--chunked-prefill-size") == "4096"
    assert p["sg-mtp"].env == {} and p["sg-plain"].env == {}
    assert _after(plain, "--tp") == "8"                           # the engine's own flags kept


def test_vllm_serving_settings_render_the_033_names(tmp_path):
    p = _plans(tmp_path)
    mtp, plain = p["vl-mtp"].cmd, p["vl-plain"].cmd
    assert _sub(mtp, VL_MTP1) and "--speculative-config" not in plain
    assert json.loads(_after(mtp, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 1}
    assert "--enforce-eager" in plain and "--enforce-eager" not in mtp
    assert p["vl-plain"].env == {"VLLM_BATCH_INVARIANT": "1"} and p["vl-mtp"].env == {}
    assert "--no-enable-prefix-caching" in plain
    assert _after(plain, "--max-num-seqs") == "8"
    assert "--max-running-requests" not in mtp                    # sg's engine setting is not vl's


def test_unconfirmed_mapping_needs_allow_unconfirmed(tmp_path):
    """vLLM has no chunk-size flag; --max-num-batched-tokens is only close (unconfirmed)."""
    arm = '[[arms]]\nname = "a"\nengine = "vl"\nserving = { chunked_prefill_size = 2048 }\n'
    with pytest.raises(SpecError, match=r"chunked_prefill_size is UNCONFIRMED.*allow_unconfirmed = true"):
        _plans(tmp_path, ENGINES + arm)
    p = _plans(tmp_path, ENGINES.replace('port = 8000', 'port = 8000\nallow_unconfirmed = true') + arm)["a"]
    assert _after(p.cmd, "--max-num-batched-tokens") == "2048"
    assert any("chunked_prefill_size: unconfirmed mapping applied" in n for n in p.notes)


def test_plan_prints_serving_flags(tmp_path, capsys):
    p = tmp_path / "s.toml"
    p.write_text(f'[run]\nout = "{tmp_path}"\n' + ENGINES + ARMS)
    assert main(["engines", "plan", str(p)]) == 0
    out = capsys.readouterr().out
    assert "--enforce-eager" in out and "VLLM_BATCH_INVARIANT=1" in out and "--speculative-num-steps 3" in out
    assert "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'" in out


def test_fidelity_stand_in_takes_the_settings_it_has(tmp_path):
    text = '[engines.fs]\nkind = "fidelity"\n[[arms]]\nname = "a"\nengine = "fs"\n' \
           'serving = { prefix_cache = false, chunked_prefill_size = 256, cuda_graphs = false, mtp = 2 }\n'
    p = _plans(tmp_path, text)["a"]
    assert "--no-prefix-cache" in p.cmd and _after(p.cmd, "--chunked-prefill-size") == "256"
    assert _after(p.cmd, "--speculative-tokens") == "2"          # the MTP arm of the stand-in


@pytest.mark.parametrize("serving,frag", [
    ("{ mtpp = 1 }", r"arms\[0\]\.serving: unknown serving setting 'mtpp'; did you mean mtp\?"),
    ("{ cuda_graphs = 0 }", r"arms\[0\]\.serving\.cuda_graphs takes true or false, got 0"),
    ("{ mtp = -1 }", r"arms\[0\]\.serving\.mtp takes a number of draft tokens >= 0"),
    ("{ max_running_requests = 0 }", r"max_running_requests takes a number of requests >= 1, got 0"),
    ("{ max_running_requests = true }", r"max_running_requests takes a number of requests >= 1, got True"),
    ('"mtp"', r"arms\[0\]\.serving must be a table of setting = value"),
])
def test_bad_serving_settings_are_named(tmp_path, serving, frag):
    with pytest.raises(SpecError, match=frag):
        _spec(tmp_path, ENGINES + f'[[arms]]\nname = "a"\nengine = "sg"\nserving = {serving}\n')


@pytest.mark.parametrize("engine,serving,frag", [
    ('kind = "fidelity"', "{ cuda_graphs = true }",
     "arm a on fidelity: serving setting no known fidelity setting for cuda_graphs = true"),
    ('kind = "fidelity"', "{ deterministic = true }", "no known fidelity setting for deterministic = true"),
    ('kind = "external"\nurl = "http://h:1"', "{ mtp = 0 }", "cannot be given toggles, serving settings"),
    ('kind = "sglang"\nversion = "0.5.23"\nmodel = "m"\nflags = ["--speculative-algorithm", "DSPARK"]', "{ mtp = 2 }",
     r"--speculative-algorithm is set in the engine's or the arm's flags and by serving setting mtp"),
    ('kind = "vllm"\nversion = "0.33"\nmodel = "m"\nenv = { VLLM_BATCH_INVARIANT = "0" }', "{ deterministic = true }",
     "VLLM_BATCH_INVARIANT is set in the engine's or the arm's env and by serving setting deterministic"),
    ('kind = "vllm"\nversion = "0.40"\nmodel = "m"', "{ mtp = 1 }",
     "vllm 0.40: engine_profiles.json has mappings for 0.33"),
])
def test_unrealisable_serving_settings_are_refused(tmp_path, engine, serving, frag):
    with pytest.raises(SpecError, match=frag):
        _plans(tmp_path, f'[engines.e]\n{engine}\n[[arms]]\nname = "a"\nengine = "e"\nserving = {serving}\n')


def test_engine_serving_setting_is_checked_too(tmp_path):
    with pytest.raises(SpecError, match=r"engines\.sg\.serving: unknown serving setting 'graphs'"):
        _spec(tmp_path, ENGINES.replace("max_running_requests = 64", "graphs = false") + ARMS)


def test_serving_arms_are_their_own_factor(tmp_path):
    spec = _spec(tmp_path, ENGINES + ARMS)
    f = {a.name: a.factors for a in spec.arms}
    assert f["sg-mtp"] == frozenset()                          # the baseline (the first arm)
    assert f["sg-plain"] == frozenset({"sg-plain"}) and f["vl-mtp"] == frozenset({"vl-mtp"})


def test_profile_serving_entries_are_complete():
    data = json.loads(profiles.PATH.read_text())
    assert SS.validate(data) == []
    assert set(data["serving_settings"]) == set(SS.SETTINGS)
    bad = dict(data, serving_settings={**data["serving_settings"], "graphs": {}})
    assert "serving_settings: unknown setting 'graphs'" in SS.validate(bad)


def test_toggles_lists_the_serving_settings(capsys):
    assert main(["toggles", "--serving"]) == 0
    out = capsys.readouterr().out
    for name in SS.SETTINGS:
        assert f"\n{name} (" in "\n" + out
    assert "sglang 0.5.23: default true; on: (nothing to set); off: --cuda-graph-backend-decode disabled" in out
    assert "vllm 0.33: default false; on: VLLM_BATCH_INVARIANT=1" in out
    assert main(["toggles", "--serving", "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "sglang" not in out.split("\n", 3)[2] and "UNCONFIRMED" in out and "#50576" in out


# ---- [run.consistency] ------------------------------------------------------------------
FS = '[engines.fs]\nkind = "fidelity"\n[[arms]]\nname = "a"\nengine = "fs"\n'


def test_consistency_table_sets_the_plans(tmp_path):
    spec = _spec(tmp_path, '[run]\ntasks = ["consistency"]\n[run.consistency]\nfamilies = ["batch"]\n'
                           'probes = 1\nconcurrency = [1, 2]\nmax_tokens = 3\ntop_k = 4\n'
                           '[run.consistency.prefix]\nlength = 256\n' + FS)
    cs = consistency_settings(spec)
    assert cs.families == ("batch",)
    assert (cs.batch.probes, cs.batch.concurrency, cs.batch.steps, cs.batch.k) == (1, (1, 2), 3, 4)
    assert cs.prefix.length == 256
    # as fidelity consistency: prefix and batch by default; chunk once a reference is given
    assert consistency_settings(_spec(tmp_path, '[run]\ntasks = ["consistency"]\n' + FS)).families == \
        ("prefix", "batch")
    cs = consistency_settings(_spec(tmp_path, '[run]\ntasks = ["consistency"]\n[run.consistency]\n'
                                              'reference = "golden"\n' + FS))
    assert cs.families[:3] == ("prefix", "batch", "chunk")


@pytest.mark.parametrize("table,frag", [
    ('families = ["bacth"]', "run.consistency.families: unknown family 'bacth'"),
    ('families = ["spec"]', r"no launched arm has serving = \{ mtp = K \}"),
    ('families = ["prefix"]\nconcurrency = [1, 2]', "run.consistency: unknown key 'concurrency' for families prefix"),
    ("probez = 1", "run.consistency: unknown key 'probez'"),
    ('families = ["batch"]\nconcurrency = 4', r"run.consistency.concurrency must be a non-empty list of integers"),
    ("probes = 0", "run.consistency.probes must be an integer >= 1, got 0"),
    ("retries = -1", "run.consistency.retries must be an integer >= 0"),
    ('dialect = "tgi"', "run.consistency.dialect must be sglang, vllm, llamacpp or openai"),
    ('families = ["chunk"]', 'family chunk compares with a reference computed here.*reference = "golden"'),
    ('reference = "nope"', "run.consistency.reference: unknown toggle 'nope'"),
    ("[run.consistency.batch]\nlenght = 9", r"run.consistency.batch: unknown key 'lenght' \(allowed: "),
])
def test_consistency_table_mistakes_are_named(tmp_path, table, frag):
    spec = _spec(tmp_path, f'[run]\ntasks = ["consistency"]\n[run.consistency]\n{table}\n' + FS)
    with pytest.raises(SpecError, match=frag):
        consistency_settings(spec)
    assert main(["engines", "plan", str(spec.path), "--out", str(tmp_path)]) == 2   # before any launch


# ---- end to end against the stand-in ----------------------------------------------------
SPEC = """
[run]
baseline = "golden"
tasks = ["consistency"]
out = "{out}"
[run.consistency]
families = ["batch"]
probes = 1
length = 200
max_tokens = 4
concurrency = [1]
repeats = 2

[engines.fs]
kind = "fidelity"
port = {port}
start_timeout = {hang}
stop_grace = 5
flags = ["--time-slice", "0"]       # requests in flight take turns step by step

[[arms]]
name = "golden"
engine = "fs"
toggles = "golden"
serving = {{ prefix_cache = false, chunked_prefill_size = 256 }}

[[arms]]
name = "batchdep"
engine = "fs"
toggles = "decode_splitk_by_batch"
"""


def test_consistency_task_end_to_end(tmp_path):
    """Two stand-in arms, batch family, one probe: the batch-dependent decode arm's
    condition is flagged, golden's is not; the verdicts and links are in the engines
    report; the serving settings reached the stand-in; a rerun launches nothing."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(out=tmp_path / "out", port=free_port(), hang=HANG))
    run = lambda: subprocess.run(fidelity_cmd("engines", "run", str(spec)), cwd=ROOT,   # noqa: E731
                                 capture_output=True, text=True, timeout=3 * HANG)
    p = run()
    assert p.returncode == 1, p.stderr[-3000:]          # flagged: batchdep's condition
    root = tmp_path / "out" / "engines" / "spec"
    st = json.loads((root / "state.json").read_text())
    assert st["golden"]["done"] == ["consistency"] and st["batchdep"]["done"] == ["consistency"]
    assert st["golden"]["consistency"]["flagged"] == []
    assert st["batchdep"]["consistency"]["flagged"] == ["batch/batch@1"]
    info = st["golden"]["engine"]["server_info"]
    assert info["chunked_prefill_size"] == 256, info                  # the serving setting reached it
    assert "--no-prefix-cache" in (root / "launch.sh").read_text()
    for arm in ("golden", "batchdep"):
        assert (root / st[arm]["consistency"]["path"] / "index.html").exists()
    summary = (root / "summary.md").read_text()
    lines = st["golden"]["consistency"]["verdict"] + st["batchdep"]["consistency"]["verdict"]
    assert lines and all(line in summary for line in lines)
    # its replies change with a batch-mate (below the greedy choice on this short probe)
    assert any(line.startswith(("`batchdep` (batch) differs", "`batchdep` (batch) its numerics change"))
               and "under 1 of 1 conditions" in line for line in st["batchdep"]["consistency"]["verdict"])
    assert "[Consistency report: batchdep](consistency/batchdep/index.html) (1 of 1 conditions flagged)" in summary
    assert "| batchdep | **flagged**: consistency: batch/batch@1 |" in summary     # its one-line finding
    assert "prefix_cache=false chunked_prefill_size=256" in summary           # the arms table
    p2 = run()
    assert p2.returncode == 1 and p2.stderr.count("not launched") == 2
