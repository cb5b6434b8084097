"""An in-process golden sharing the devices of `fidelity engines`' launched engines (engine
kind "inprocess"): everything that needs the golden (its KLD scores, fidelity ab's floor
arms, the consistency chunk family's one-piece references) is scored and stored first, the
golden's memory is released, then the engines are launched one at a time; the order and
the bytes freed are in the run log and state.json. The golden's stored scores equal the
in-process scorer's and the served golden's (`fidelity serve` as the stand-in engine); a
rerun with everything stored loads no golden, one with a score missing scores only that;
the chunk references stored before launch give the family the very rows a held reference
gives; conflicting settings are refused by name before anything is launched.

No assertion depends on how fast this machine is (HANG is a guard against a hung run)."""
import io
import json
import subprocess

import numpy as np
import pytest
import torch

from fidelity.cli import main
from fidelity.engines import golden, memory
from fidelity.engines.run import consistency_settings, plans, run_engines
from fidelity.engines.spec import SpecError, load_spec
from fidelity.scores.bounds import compare
from fidelity.scores.dialects import Request
from fidelity.scores.inprocess import InProcessScorer
from fidelity.scores.store import ScoreStore, request_key
from fidelity.progress import Progress

from needle_util import ROOT, fidelity_cmd, free_port

HANG = 900

SPEC = """
[run]
baseline = "golden"
tasks = ["kld", "consistency"]
out = "{out}"
[run.kld]
lengths = [250]
depths = [30, 70]
steps = 3
n_boot = 200
[run.consistency]
families = ["chunk"]
reference = "golden"
probes = 1

[engines.here]
kind = "inprocess"
devices = "{devices}"

[engines.fs]
kind = "fidelity"
port = {port}
start_timeout = {hang}
stop_grace = 5
serving = {{ chunked_prefill_size = 128 }}

[[arms]]
name = "golden"
engine = "here"
toggles = "golden"

[[arms]]
name = "served-golden"
engine = "fs"
toggles = "golden"

[[arms]]
name = "engine-bug"
engine = "fs"
toggles = "engine,routed_scaling_double"
"""


def _write(tmp_path, devices="cpu", text=None):
    p = tmp_path / "spec.toml"
    p.write_text(text or SPEC.format(out=tmp_path / "out", devices=devices, port=free_port(), hang=HANG))
    return p


def _state(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "engines" / "spec" / "state.json").read_text())


def _index(lines, fragment) -> int:
    return next(i for i, line in enumerate(lines) if fragment in line)


def _golden_scorer():
    from fidelity.design.arms import parse_arm
    from fidelity.weights.target import load_target
    return InProcessScorer("golden", parse_arm("golden").numerics(compute_dtype=torch.float64),
                           load_target(None).weights)


# ---- end to end: order, scores, resume -----------------------------------------------------
def test_golden_scored_then_released_then_engines_launched_and_resumed(tmp_path, monkeypatch):
    spec = _write(tmp_path)
    p = subprocess.run(fidelity_cmd("engines", "run", str(spec)), cwd=ROOT, capture_output=True, text=True,
                       timeout=3 * HANG)
    assert p.returncode == 1, p.stderr[-3000:]           # flagged: the routed_scaling_double arm
    lines = p.stderr.splitlines()
    order = [_index(lines, f) for f in ("in-process engine here: loading the golden", "here: golden scored:",
                                        "here: memory released before any engine is launched",
                                        "served-golden: launching", "served-golden: stopped",
                                        "engine-bug: launching")]
    assert order == sorted(order), p.stderr
    released = lines[order[2]]
    assert "of weights and weight caches dropped" in released and "still referenced" not in released
    assert "process RSS" in released

    st = _state(tmp_path)
    events = st["run log"][0]["events"]
    assert [(e["event"], e.get("arm")) for e in events] == [
        ("golden loaded", None), ("golden scored", None), ("memory released", None),
        ("launched", "served-golden"), ("stopped", "served-golden"),
        ("launched", "engine-bug"), ("stopped", "engine-bug")]
    rel = events[2]
    assert rel["tensor_bytes"] > 0 and rel["all_dropped"] is True       # nothing kept the golden alive
    assert isinstance(rel["rss_before"], int) and isinstance(rel["rss_after"], int)
    assert events[1]["scored"]["golden"] == {"prompts": 2, "stored_earlier": 0}
    # engine-bug's twin (its toggles) and the floors around it, scored with the golden
    # (served-golden's twin is the baseline itself: no second judgement)
    assert set(events[1]["scored"]) == {"golden", "floor:exact", "floor:fp32-accum", "floor:tie-order",
                                        "twin", "twin~floor:fp32-accum", "twin~floor:tie-order",
                                        "consistency reference golden"}
    assert st["golden"]["done"] == ["kld"] and st["golden"]["engine"]["inprocess"]["devices"] == ["cpu"]

    # the stored golden = the in-process scorer now = the served golden (its top-k)
    root = tmp_path / "out" / "engines" / "spec"
    store = ScoreStore(root / "kld" / "scores")
    files = sorted((root / "kld" / "scores" / "golden").glob("*.npz"))
    assert len(files) == 2
    scorer = _golden_scorer()
    for f in files:
        pid, key = f.stem.rsplit("-", 1)
        got = store.get("golden", pid, key)
        direct = scorer.score(got.ids, Request(k=20, steps=3, captures=True))
        assert got.ladder_tokens == direct.ladder_tokens
        for a, b in zip(got.known, direct.known):
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.logp, b.logp)
        served = store.get("served-golden", pid, key)
        assert served.ladder_tokens == got.ladder_tokens
        kl = [compare(a, b, None) for a, b in zip(got.known, served.known)]
        assert max(c["kl_lb"] for c in kl) < 1e-9 and all(c["same_top1"] for c in kl)
    # judged twice: fidelity serve computing engine,routed_scaling_double is its twin exactly
    m = json.loads((root / "kld-report" / "manifest.json").read_text())
    (tw,) = m["manifest"]["twins"]
    assert tw["engines"] == ["engine-bug"] and not tw["unexplained"], tw
    assert (root / "kld-report-vs-twin" / "index.html").is_file()
    assert sorted((root / "kld" / "scores").glob("engine-bug~repeat/*.npz"))
    # the chunk reference stored before launch: the served golden is bit-identical to it
    assert st["served-golden"]["consistency"]["flagged"] == []
    assert st["engine-bug"]["consistency"]["conditions"] >= 1

    # rerun, everything stored: the golden is never loaded, no engine is launched
    def boom(*a, **k):
        raise AssertionError("the golden was loaded")
    monkeypatch.setattr(golden, "load_target", boom)
    monkeypatch.setattr(golden, "InProcessScorer", boom)
    mtimes = {f: f.stat().st_mtime_ns for f in (root / "kld" / "scores").rglob("*.npz")}
    log = io.StringIO()
    run_engines(load_spec(spec), "spec", Progress(stream=log))
    text = log.getvalue()
    assert "everything it computes is stored" in text and "the golden is not loaded" in text
    assert text.count("tasks done earlier; not launched") == 2
    assert {f: f.stat().st_mtime_ns for f in mtimes} == mtimes
    assert [e["event"] for e in _state(tmp_path)["run log"][1]["events"]] == [
        "golden not loaded", "not launched", "not launched"]

    # one golden score lost: only that prompt is scored again, to the same numbers
    monkeypatch.undo()
    before = store.get("golden", *files[0].stem.rsplit("-", 1))
    files[0].unlink()
    log = io.StringIO()
    run_engines(load_spec(spec), "spec", Progress(stream=log))
    text = log.getvalue()
    assert "golden: 1 prompts (1 stored earlier); floor:exact: 0 prompts (2 stored earlier)" in text
    assert text.count("not launched") == 2
    again = store.get("golden", *files[0].stem.rsplit("-", 1))
    assert all(np.array_equal(a.logp, b.logp) for a, b in zip(before.known, again.known))
    assert [e["event"] for e in _state(tmp_path)["run log"][2]["events"]] == [
        "golden loaded", "golden scored", "memory released", "not launched", "not launched"]


# ---- the chunk family's reference, stored before launch --------------------------------------
class _Arm:
    """A stand-in live arm for the chunk family: reports a chunk size, scores in-process."""

    def __init__(self, scorer, chunk):
        self.name, self.scorer, self.chunk = "arm", scorer, chunk

    def sizes(self):
        return {"chunked_prefill_size": self.chunk, "page_size": None}

    def score(self, ids, req):
        return self.scorer.score(ids, req)


def test_stored_chunk_reference_gives_the_rows_a_held_reference_gives(tmp_path):
    from fidelity.design.arms import parse_arm
    from fidelity.consistency.chunk import ChunkFamily, ChunkPlan
    from fidelity.consistency.store import ProbeStore
    from fidelity.weights.target import load_target
    t = load_target(None)
    plan, c = ChunkPlan(probes=2), 128
    ref = _golden_scorer()
    arm = _Arm(InProcessScorer("arm", parse_arm("engine").numerics(), t.weights), c)

    asked = []

    class Recording:
        def score(self, ids, req):
            asked.append(list(ids))
            return ref.score(ids, req)
    held = ProbeStore(tmp_path / "held.jsonl")
    ChunkFamily(arm, held, t.tokenizer, t.cfg, plan, Recording()).run()
    assert asked == golden.chunk_prompts(t.tokenizer, plan, c)     # the prompts rebuilt before launch

    rstore, req = ScoreStore(tmp_path / "ref"), Request(k=plan.k, steps=1)
    for ids in asked:
        rstore.put("golden", golden.REF_PROMPT, request_key(req.k, 1, False, False, ids), ref.score(ids, req))
    stored = ProbeStore(tmp_path / "stored.jsonl")
    ChunkFamily(arm, stored, t.tokenizer, t.cfg, plan, golden.StoredReference(rstore, "golden", {}, [c])).run()
    assert stored.rows == held.rows

    arm.chunk = 160                                     # the engine reports another chunk size
    with pytest.raises(RuntimeError, match="was for prefill chunks of 128 tokens.*serving chunked_prefill_size"):
        ChunkFamily(arm, ProbeStore(tmp_path / "other.jsonl"), t.tokenizer, t.cfg, plan,
                    golden.StoredReference(rstore, "golden", {}, [c])).run()


# ---- memory -------------------------------------------------------------------------------
class _Holds:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_release_counts_each_storage_once_and_checks_nothing_kept_it():
    w = torch.zeros(1000, dtype=torch.float64)
    cache = {(0, "f64"): {"a": w, "b": w[:10]}, (1, "f32"): {"c": torch.zeros(10, dtype=torch.float32)}}
    holder = {"weights": _Holds(layers=[{"w": w}]), "weight_cache": cache}
    r = memory.release(holder, ["cpu"])
    assert r["tensor_bytes"] == 8000 + 40 and r["all_dropped"] is True and holder == {}
    kept = _Holds(t=torch.zeros(4))
    r = memory.release({"weights": kept}, ["cpu"])
    assert r["all_dropped"] is False and "still referenced elsewhere" in memory.describe(r)


def test_release_on_cuda_empties_the_cache_and_reports_allocated_bytes(monkeypatch):
    """The CUDA branch without a GPU: memory_allocated and empty_cache stood in for."""
    allocated = iter([{"cuda:0": 2 << 30, "cuda:1": 1 << 30}, {"cuda:0": 0, "cuda:1": 1 << 20}])
    emptied = []
    monkeypatch.setattr(memory, "cuda_allocated", lambda devices: next(allocated))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    r = memory.release({"weights": _Holds(t=torch.zeros(8))}, ["cuda:0", "cuda:1"])
    assert emptied == [True]
    assert r["cuda"]["cuda:0"] == {"allocated_before": 2 << 30, "allocated_after": 0, "freed": 2 << 30}
    assert r["cuda"]["cuda:1"]["freed"] == (1 << 30) - (1 << 20)
    text = memory.describe({**r, "tensor_bytes": 3 << 30, "rss_before": None})
    assert text == ("3.0 GiB of weights and weight caches dropped; cuda:0 allocated 2.0 GiB -> 0 B (2.0 GiB freed); "
                    "cuda:1 allocated 1.0 GiB -> 1.0 MiB (1023.0 MiB freed)")


# ---- conflicting settings, refused before anything is launched --------------------------------
HERE = '[engines.here]\nkind = "inprocess"\n{here}\n[engines.fs]\nkind = "fidelity"\n{fs}\n' \
       '[[arms]]\nname = "golden"\nengine = "here"\n{arm}\n[[arms]]\nname = "b"\nengine = "fs"\n'


@pytest.mark.parametrize("run,here,fs,arm,frag", [
    ("", "", "", "", r'engines.here: an inprocess engine needs devices: where its arms are computed, "cpu"'),
    ("", 'devices = ""', "", "", "engines.here.devices is empty"),
    ("", "devices = []", "", "", "engines.here.devices is empty"),
    ("", 'devices = "tpu:0"', "", "", "engines.here.devices: unknown device 'tpu:0'"),
    ("", 'devices = "cuda:0,cuda:0"', "", "", "engines.here.devices: cuda:0 is listed twice"),
    ("", 'devices = "cpu"\nport = 30000', "", "", "engines.here.port: an inprocess engine is computed in this process"),
    ("", 'devices = "cpu"\nweights_mode = "mmap"', "", "", "engines.here.weights_mode must be one of"),
    ("", 'devices = "cpu"\naccumulate = "fp16"', "", "", "engines.here.accumulate must be auto, fp64 or fp32"),
    ("", 'devices = "cpu"', 'devices = "cuda:0"', "", r'engines.fs.devices: only an engine of kind "inprocess"'),
    ("", 'devices = "cpu"', "", 'flags = ["--x"]', "engine here is computed in this process"),
    ("", 'devices = "cpu"\n[engines.there]\nkind = "inprocess"\ndevices = "cpu"', "", "",
     'engines here, there are both of kind "inprocess"'),
    ('baseline = "b"\n[run.kld]\nexact = true', 'devices = "cpu"', "", "",
     "arm golden is computed in-process.*exact = true"),
    ('tasks = ["consistency"]\n[run.consistency]\nreference = "golden"\nfamilies = ["chunk", "longgen"]',
     'devices = "cpu"', "", "", "the longgen family scores each engine's own output"),
    ('tasks = ["consistency"]\n[run.consistency]\nreference = "golden"\nfamilies = ["chunk"]',
     'devices = "cpu"', "", "", r"arm b: the chunk family's reference is computed before any engine is launched"),
])
def test_conflicting_settings_are_named(tmp_path, run, here, fs, arm, frag):
    p = _write(tmp_path, text=f"[run]\n{run}\n" + HERE.format(here=here, fs=fs, arm=arm))
    with pytest.raises(SpecError, match=frag):
        spec = load_spec(p)
        plans(spec)
    assert main(["engines", "plan", str(p), "--out", str(tmp_path / "o")]) == 2


def test_chunk_size_from_the_consistency_table_is_enough(tmp_path):
    text = ('[run]\ntasks = ["consistency"]\n[run.consistency]\nreference = "golden"\nfamilies = ["chunk"]\n'
            "[run.consistency.chunk]\nchunk_size = 256\n" + HERE.format(here='devices = "cpu"', fs="", arm=""))
    spec = load_spec(_write(tmp_path, text=text))
    plans(spec)
    assert golden.chunk_sizes(spec, consistency_settings(spec)) == {"b": 256}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 7, reason="this machine has cuda:7")
def test_missing_device_stops_the_run_before_any_launch(tmp_path):
    spec = _write(tmp_path, devices="cuda:7")
    with pytest.raises(SpecError, match=r"engines.here.devices: cuda:7 does not exist: this machine has \d+ CUDA "
                                        r"device\(s\).*nothing was launched"):
        run_engines(load_spec(spec), "spec", Progress(quiet=True))
    root = tmp_path / "out" / "engines" / "spec"
    assert not (root / "logs").exists()                 # no engine was started (its log is opened first)
    runs = json.loads((root / "state.json").read_text())["run log"] if (root / "state.json").exists() else []
    assert not any(e["event"] == "launched" for r in runs for e in r["events"])


def test_plan_names_the_inprocess_arm_and_launches_only_the_others(tmp_path, capsys):
    p = _write(tmp_path, devices="cuda:0,cuda:1")          # plan checks names only: no GPU needed here
    assert main(["engines", "plan", str(p), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "# golden  (inprocess engine here, computed first, in this process)" in out
    assert "computed in this process on cuda:0,cuda:1 (the embedded model)" in out
    script = (tmp_path / "o" / "engines" / "spec" / "launch.sh").read_text()
    assert script.count("fidelity.cli serve") == 2 and '"golden" ]' not in script
