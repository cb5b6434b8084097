"""`fidelity consistency` against real `fidelity serve` processes: the prefix-cache family
flags each planted restore bug exactly where the engine reports a cache hit and nowhere
else; the batch family flags an arm whose decode kernel depends on the requests in flight,
not its fixed counterpart; a clean server flags nothing over three seeds; transport faults
are retried, never counted as differences; a run killed with SIGKILL resumes to the same
tables; the OpenAI dialect alone works on greedy text; the chunked-prefill family finds a
boundary bug and not an even kernel difference; the long-generation family dates drift
against the engine's re-read of its own output, from step 0."""
import json

import pytest

from fidelity.consistency.client import LiveArm
from fidelity.consistency.prefix import PrefixPlan, boundaries
from fidelity.consistency.run import ConsistencySettings, run_consistency, store_path
from fidelity.consistency.store import ProbeStore
from fidelity.kld.endpoint import Endpoint
from fidelity.weights.target import load_target
from infra.http import RetryPolicy

from fault_proxy import FaultProxy
from needle_util import served

TARGET = load_target(None)
BUGS = ("restore_window_one_off", "restore_drops_compressor_pending", "restore_saved_one_token_later")
PLAN = PrefixPlan(length=200, probes=1, max_tokens=4)
FAST = RetryPolicy(retries=4, timeout=120.0, backoff=0.05)
TOK = TARGET.tokenizer


def _chat_tokens(task: int = 0) -> int:
    """The long-generation family's chat prompt length for TASKS[task] (thinking on)."""
    from fidelity.consistency.longgen import TASKS
    return len(TOK.encode(TOK.render_chat([{"role": "user", "content": TASKS[task]}], thinking=True).text))


def _wrap_at(step: int) -> str:
    """decode_positions_wrap leaving the golden at generated step `step` of TASKS[0]: step t
    decodes the token at position P + t - 1, the first one the wrap moves is `at`."""
    return f"decode_positions_wrap(at={_chat_tokens() + step - 1})"


@pytest.fixture(scope="module")
def url():
    arms = ["--arm", "golden=golden"] + [a for b in BUGS for a in ("--arm", f"{b}={b}")]
    arms += ["--arm", "batchdep=decode_splitk_by_batch", "--arm", "fixed=splitk_decode"]
    arms += ["--arm", f"early={_wrap_at(20)}"]
    # --time-slice 0: requests in flight take turns step by step, as in continuous batching
    with served("golden", extra=(*arms, "--page-size", "64", "--time-slice", "0")) as (u,):
        yield u


def _arm(name, url, dialect=None):
    return LiveArm(Endpoint(name, url, dialect, name, FAST, TARGET.tokenizer))


def _run(arms, tmp_path, plan=PLAN, run_id="r"):
    return run_consistency(arms, TARGET, ConsistencySettings(("prefix",), plan), tmp_path, run_id,
                           progress=lambda m: None)


def test_restore_bugs_flagged_exactly_where_the_cache_hit(url, tmp_path):
    res = _run([_arm("golden", url)] + [_arm(b, url) for b in BUGS], tmp_path)
    t = res["conditions"]
    g = t[t.arm == "golden"]
    assert not g.flagged.any() and (g.bitwise == g.probes).all()
    hits = t[t.condition.str.startswith("hit@")]
    # a 64-token page: a shared prefix of P restores the largest multiple of 64 below it
    for _, r in hits[hits.arm == "golden"].iterrows():
        assert r.cached_median == (int(r.shared) // 64) * 64, r.condition
    for bug in BUGS:
        b = t[(t.arm == bug) & (t.condition != "cold-again")]
        assert (b.flagged == (b.cached_median > 0)).all(), b[["condition", "cached_median", "flagged"]]
        assert b.flagged.sum() >= 6, bug                 # hits at 64, 65, 127-129 and the full hit
    assert res["verdict"][0].startswith("`golden` (prefix): no serving condition changes its replies")
    # 3 greedy tokens: the hit moves its numerics, not (yet) its greedy answer
    assert any(line.startswith(("`restore_window_one_off` (prefix) differs from its cold replies under 7 of 14",
                                "`restore_window_one_off` (prefix) its numerics change (not its greedy "
                                "answers) under 7 of 14"))
               for line in res["verdict"])
    path = res["path"]
    html = open(f"{path}/index.html").read()
    assert "Prefix-cache hits vs cold" in html and "data:image/png;base64" in html
    rows = [json.loads(x) for x in store_path(tmp_path).read_text().splitlines()]
    assert {r["cold_by"] for r in rows if "cold_by" in r} == {"/flush_cache"}


def test_batch_dependent_arm_flagged_its_fixed_counterpart_not(url, tmp_path):
    """decode_splitk_by_batch (split count from the step's tokens) differs from its alone
    replies with others in flight; splitk_decode (a fixed split, the same numerics alone or
    not) and golden do not."""
    from fidelity.consistency.batch import BatchPlan
    plan = BatchPlan(length=200, probes=1, concurrency=(1, 4), repeats=2, steps=4)
    res = run_consistency([_arm(n, url) for n in ("golden", "batchdep", "fixed")], TARGET,
                          ConsistencySettings(("batch",), batch=plan), tmp_path, "b", progress=lambda m: None)
    t = res["conditions"].set_index(["arm", "condition"])
    assert t.loc[("batchdep", "batch@1"), "flagged"] and t.loc[("batchdep", "batch@4"), "flagged"]
    assert t.loc[("batchdep", "batch@4"), "kl_max"] > 0
    assert not t.loc[["golden", "fixed"], "flagged"].any()
    assert (t.loc[["golden", "fixed"], "bitwise"] == t.loc[["golden", "fixed"], "probes"]).all()
    assert "data:image/png;base64" in open(f"{res['path']}/index.html").read()


def test_clean_server_flags_nothing_over_three_seeds(url, tmp_path):
    """The golden arm under the prefix and batch families, three seeds: no false positive."""
    from fidelity.consistency.batch import BatchPlan
    for seed in (1, 2, 3):
        s = ConsistencySettings(("prefix", "batch"), PrefixPlan(length=200, probes=1, max_tokens=3, seed=seed),
                                BatchPlan(length=200, probes=1, concurrency=(2,), repeats=1, steps=3, seed=seed))
        res = run_consistency([_arm("golden", url)], TARGET, s, tmp_path, f"s{seed}", progress=lambda m: None)
        assert not res["flagged"] and len(res["conditions"]) == 17, seed     # 15 prefix + 2 batch


def test_faults_are_retried_never_counted(url, tmp_path):
    faults = {"/generate": ["500", "ok", "drop", "ok", "malformed", "503"]}
    with FaultProxy(url, faults) as px:
        res = _run([_arm("golden", px.url)], tmp_path)
    assert not res["conditions"].flagged.any()
    retries = res["manifest"]["arms"][0]["retries"]
    assert retries == {"POST /generate": 4}, retries          # 500, drop, malformed, 503


@pytest.mark.slow          # ~80 s each on 2 cores: make test-slow (CI runs it)
def test_sigkill_mid_run_then_rerun_resumes_to_the_same_tables(url, tmp_path):
    """`fidelity consistency` killed with SIGKILL after some probes finished: the rerun
    keeps them (the store only grows), finishes, and its tables equal an uninterrupted run's."""
    import os
    import signal
    import subprocess
    import time
    from needle_util import ROOT, fidelity_cmd
    args = ["consistency", "--endpoint", f"restore_window_one_off={url}", "--families", "prefix",
            "--probes", "2", "--length", "200", "--max-tokens", "3", "--quiet"]
    store = store_path(tmp_path / "a")
    proc = subprocess.Popen(fidelity_cmd(*args, "--out", str(tmp_path / "a"), "--run-id", "r"),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    end = time.monotonic() + 600
    while not (store.exists() and len(store.read_text().splitlines()) >= 5):
        assert proc.poll() is None and time.monotonic() < end, "the run ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = [r["key"] for r in ProbeStore(store).rows]
    assert 5 <= len(kept) < 2 * 14
    resumed = _run([_arm("restore_window_one_off", url)], tmp_path / "a", PrefixPlan(length=200, probes=2, max_tokens=3))
    assert [r["key"] for r in ProbeStore(store).rows][:len(kept)] == kept
    fresh = _run([_arm("restore_window_one_off", url)], tmp_path / "b", PrefixPlan(length=200, probes=2, max_tokens=3))
    assert len(ProbeStore(store).rows) == len(ProbeStore(store_path(tmp_path / "b")).rows)
    cols = ["condition", "probes", "bitwise", "flagged", "cached_median"]
    assert resumed["conditions"][cols].equals(fresh["conditions"][cols])


def test_openai_dialect_alone_works_on_greedy_text(url, tmp_path):
    plan = PrefixPlan(length=200, probes=1, max_tokens=3)
    res = _run([_arm("restore_window_one_off", url, "openai")], tmp_path, plan)
    t = res["conditions"]
    assert t.flagged.any() and (t.flagged == (t.cached_median > 0)).all()
    assert any("read through the OpenAI dialect" in v and "looser" in v for v in res["verdict"])


def test_progress_says_where_the_whole_run_stands(url, tmp_path):
    """Every family line carries the run's requests sent of those planned and the time, an
    ETA while requests remain; the count only grows."""
    import re
    lines = []
    run_consistency([_arm("golden", url)], TARGET, ConsistencySettings(("prefix",), PLAN), tmp_path, "p",
                    progress=lines.append)
    planned = int(re.search(r"; (\d+) requests in all", lines[0]).group(1))
    counts = [re.search(r"\[(\d+)/(\d+) requests, \d+ s(, eta ~\d+ s)?\]$", ln) for ln in lines[1:]]
    assert counts and all(counts), lines
    done = [int(m.group(1)) for m in counts]
    assert all(int(m.group(2)) == planned for m in counts) and done == sorted(done) and done[-1] > 0
    assert any(m.group(3) for m in counts[:-1]) or len(counts) == 1


def test_an_arm_that_does_not_speculate_is_left_out_of_the_spec_family(url, tmp_path):
    """A plain server's arm beside the spec baseline: its server says it does not speculate,
    so it is not compared (its replies against the baseline's would read as a spec fault) and
    the verdict says why; nothing is sent for it."""
    from fidelity.consistency.spec import SpecPlan
    arm = _arm("restore_window_one_off", url)
    s = ConsistencySettings(("spec",), spec=SpecPlan(baseline="golden", probes=1, length=200, max_tokens=4, seeds=2))
    res = run_consistency([_arm("golden", url), arm], TARGET, s, tmp_path, "s", progress=lambda m: None)
    assert res["spec"].empty and arm.sent == 0
    assert any(ln.startswith("`restore_window_one_off` does not decode speculatively (/get_server_info "
                             "speculative.enabled = False)") for ln in res["verdict"]), res["verdict"]


def test_store_skips_a_torn_line(tmp_path):
    p = tmp_path / "probes.jsonl"
    p.write_text(json.dumps({"key": "a", "x": 1}) + "\n" + '{"key": "b", "x"')
    s = ProbeStore(p)
    assert s.has("a") and not s.has("b")
    s.add({"key": "b", "x": 2})
    assert [r["key"] for r in ProbeStore(p).rows] == ["a", "b"]


def test_boundary_classes():
    cfg = TARGET.cfg
    got = boundaries(cfg, {"page_size": 64, "chunked_prefill_size": 2048}, PrefixPlan(length=200))
    assert got == [("window", 31), ("window", 32), ("window", 33), ("csa-group", 51), ("csa-group", 52),
                   ("csa-group", 53), ("hca-group", 127), ("hca-group", 128), ("hca-group", 129),
                   ("page", 63), ("page", 64), ("page", 65)]


def test_chunk_boundary_bug_flagged_kernel_numerics_not(tmp_path):
    """A server prefilling in 96-token chunks: chunk_stale_index_keys (the indexer keys before
    a boundary lost) jumps at both boundaries against the golden scored here in one piece;
    index_keys_fp8 differs from the golden along the whole prompt but does not jump there;
    the golden arm is identical to it everywhere."""
    from fidelity.consistency.chunk import ChunkPlan
    from fidelity.scores.inprocess import InProcessScorer
    from reference_model import Numerics
    arms = ("--arm", "golden=golden", "--arm", "stale=chunk_stale_index_keys", "--arm", "fp8=index_keys_fp8")
    ref = InProcessScorer("golden", Numerics("reference"), TARGET.weights)
    with served("golden", extra=(*arms, "--chunked-prefill-size", "96")) as (u,):
        res = run_consistency([_arm(n, u) for n in ("golden", "stale", "fp8")], TARGET,
                              ConsistencySettings(("chunk",), chunk=ChunkPlan(length=300, probes=4)),
                              tmp_path, "c", progress=lambda m: None, reference=ref)
    t = res["conditions"].set_index(["arm", "condition"])
    assert t.loc[("stale", "after@96"), "flagged"] and t.loc[("stale", "after@192"), "flagged"]
    assert not t.loc["fp8", "flagged"].any() and t.loc[("fp8", "after@192"), "kl_max"] > 0
    assert not t.loc["golden", "flagged"].any() and (t.loc["golden", "kl_max"] == 0).all()
    assert "KL along the prompt, chunk boundaries marked" in open(f"{res['path']}/index.html").read()


def test_chunk_family_needs_a_reference_and_a_chunk_size(url, tmp_path):
    from fidelity.consistency.chunk import ChunkPlan
    from fidelity.consistency.family import FamilyError
    with pytest.raises(FamilyError, match="--arm"):
        run_consistency([_arm("golden", url)], TARGET, ConsistencySettings(("chunk",), chunk=ChunkPlan()),
                        tmp_path, "x", progress=lambda m: None)


def _agree(res) -> None:
    """Each long-generation run is stated once in the verdict, flagged there exactly when the
    behaviour table flags it, and its conditions-table stretches agree."""
    t, c = res["behaviour"], res["conditions"]
    for _, r in t.iterrows():
        lines = [v for v in res["verdict"] if v.startswith(f"`{r.arm}` (long generation, {r['mode']},")]
        assert len(lines) == 1 and ("is flagged:" in lines[0]) == r.flagged, (lines, r.flagged)
        stretch = c[(c.arm == r.arm) & c.condition.str.startswith(r["mode"] + ":steps@")]
        assert stretch.flagged.any() == (r.stretches_flagged > 0)
    assert not any("(longgen)" in v for v in res["verdict"])
    assert res["flagged"] == bool(t.flagged.any())


def test_long_generation_early_onset_seen_golden_not(url, tmp_path):
    """Greedy, 64 tokens: decode_positions_wrap leaving the golden at step 20 -- inside what
    used to be the floor (the first 128 steps) -- is flagged and dated at 20 against the
    engine's re-read of its own output; the golden arm is not flagged."""
    from fidelity.consistency.longgen import LongGenPlan
    from fidelity.scores.inprocess import InProcessScorer
    from reference_model import Numerics
    ref = InProcessScorer("golden", Numerics("reference"), TARGET.weights)
    plan = LongGenPlan(probes=1, max_tokens=64, temperature=0.0, ignore_eos=True)
    res = run_consistency([_arm(n, url) for n in ("golden", "early")], TARGET,
                          ConsistencySettings(("longgen",), longgen=plan), tmp_path, "e",
                          progress=lambda m: None, reference=ref)
    b = res["behaviour"].set_index("arm")
    assert b.loc["early", "flagged"] and b.loc["early", "drift_start_min"] == 20
    assert b.loc["early", "first_flagged"] == 16 and b.loc["early", "floor_kl_max"] == 0
    assert not b.loc["golden", "flagged"] and b.loc["golden", "kl_max"] == 0
    assert res["manifest"]["requests"]["longgen/early"] == 2          # the generation and its re-read
    _agree(res)


@pytest.mark.slow          # ~60 s on 2 cores: make test-slow (CI runs it)
def test_long_generation_drift_found_where_it_starts(tmp_path):
    """decode_positions_wrap leaving the golden at step 20 and at step 151 of a 200-token
    generation, greedy and sampled, scored teacher-forced here against the engine's re-read
    of the same tokens: each flagged and dated exactly; the golden arm and index_keys_fp8
    (off the reference as much re-read as generated) are not flagged; the verdict and the
    behaviour table agree on every run."""
    from fidelity.consistency.longgen import LongGenPlan
    from fidelity.scores.inprocess import InProcessScorer
    from reference_model import Numerics
    ref = InProcessScorer("golden", Numerics("reference"), TARGET.weights)
    plan = LongGenPlan(probes=1, max_tokens=200, ignore_eos=True)
    arms = ("--arm", "golden=golden", "--arm", f"early={_wrap_at(20)}", "--arm", f"late={_wrap_at(151)}",
            "--arm", "fp8=index_keys_fp8")
    with served("golden", extra=arms) as (u,):
        res = run_consistency([_arm(n, u) for n in ("golden", "early", "late", "fp8")], TARGET,
                              ConsistencySettings(("longgen",), longgen=plan), tmp_path, "g",
                              progress=lambda m: None, reference=ref)
    b = res["behaviour"].set_index(["arm", "mode"])
    for mode in ("greedy", "sampled"):
        assert b.loc[("early", mode), "drift_start_min"] == 20 and b.loc[("early", mode), "flagged"]
        assert b.loc[("late", mode), "drift_start_min"] == 151 and b.loc[("late", mode), "flagged"]
        for arm in ("golden", "fp8"):
            assert b.loc[(arm, mode), "drifting"] == 0 and not b.loc[(arm, mode), "flagged"]
    assert b.loc[("fp8", "greedy"), "floor_kl_max"] > 0          # off the reference, evenly
    t = res["conditions"].set_index(["arm", "condition"])
    assert t.loc[("early", "greedy:steps@16"), "flagged"] and not t.loc[("early", "greedy:steps@0"), "flagged"]
    assert t.loc[("late", "greedy:steps@128"), "flagged"] and not t.loc[("late", "greedy:steps@64"), "flagged"]
    assert any("from step 151" in v for v in res["verdict"])
    assert "KL along long generations" in open(f"{res['path']}/index.html").read()
    _agree(res)


def test_eviction_condition_with_a_small_cache(tmp_path):
    """A stand-in whose prefix cache holds a few snapshots: after 640 tokens of other
    prompts the probe's prefix is gone (0 cached), so even a restore bug answers as cold;
    requests are counted per condition."""
    plan = PrefixPlan(length=200, probes=1, max_tokens=3, evict_tokens=640)
    with served("golden", extra=("--arm", "golden=golden", "--arm", "bug=restore_window_one_off",
                                 "--prefix-cache-bytes", "2000000")) as (u,):
        res = _run([_arm("golden", u), _arm("bug", u)], tmp_path, plan)
    t = res["conditions"].set_index(["arm", "condition"])
    for arm in ("golden", "bug"):
        assert t.loc[(arm, "evicted"), "cached_median"] == 0 and not t.loc[(arm, "evicted"), "flagged"]
    assert t.loc[("bug", "full-hit"), "flagged"]
    rows = res["probes"].set_index(["arm", "condition"])
    assert rows.loc[("golden", "evicted"), "requests"] == 2 + 640 // 200 + 1
    assert rows.loc[("golden", "multi-turn"), "requests"] == 3
    assert res["manifest"]["requests"]["prefix/golden"] == rows.loc["golden", "requests"].sum()
