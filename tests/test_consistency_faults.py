"""`fidelity consistency` under faults and bad input, against a real `fidelity serve`
process behind the fault proxy (issue 37): a 500 sent after the server has processed a
request (so its retry hits the prefix cache) neither warms a cold reference nor turns a
hit@P into a full hit -- the run verifies the cached-token counts, flushes and re-runs,
says so, and its tables equal a clean run's; a 502 or a reset on a batch filler is
retried, never the end of the run; prompt lengths below the probe template's minimum are
refused before any probe request, naming the family and the option; the run says what it
will cost before it starts, and that estimate is what it sends; a page or chunk size
under 1 is an error (exit 2)."""
import json

import pytest

from fidelity.cli import main
from fidelity.consistency.batch import BatchPlan
from fidelity.consistency.client import LiveArm
from fidelity.consistency.family import FamilyError
from fidelity.consistency.prefix import PrefixPlan
from fidelity.consistency.run import ConsistencySettings, run_consistency, store_path
from fidelity.kld.endpoint import Endpoint
from fidelity.weights.target import load_target
from infra.http import RetryPolicy
from needle.stub import StubServer

from fault_proxy import FaultProxy
from needle_util import served

TARGET = load_target(None)
PLAN = PrefixPlan(length=200, probes=1, max_tokens=4)
FAST = RetryPolicy(retries=4, timeout=120.0, backoff=0.05)
COLS = ["arm", "condition", "probes", "bitwise", "diverged", "flagged", "cached_median"]


class LateFaultProxy(FaultProxy):
    """The fault proxy plus "after:NNN": the request is forwarded (the server processes it
    and caches its prompt), then status NNN is sent instead of the answer -- what a
    gateway timing out, or a server failing while writing its answer, does."""

    async def _answer(self, method, path, headers, raw):
        queue = self.faults.get(path, [])
        if queue and isinstance(queue[0], str) and queue[0].startswith("after:"):
            status = int(queue.pop(0).split(":", 1)[1])
            self.seen.append((method, path, json.loads(raw) if raw else None))
            await self._forward(method, path, headers, raw)
            return StubServer._response(status, b'{"error": {"message": "injected after the answer"}}')
        return await super()._answer(method, path, headers, raw)


@pytest.fixture(scope="module")
def url():
    # a 64-token page; --time-slice 0: requests in flight take turns step by step
    arms = ("--arm", "golden=golden", "--arm", "window=restore_window_one_off")
    with served("golden", extra=(*arms, "--page-size", "64", "--time-slice", "0")) as (u,):
        yield u


def _arm(name, url):
    return LiveArm(Endpoint(name, url, None, name, FAST, TARGET.tokenizer))


def _prefix(url, out, run_id="r", progress=lambda m: None):
    return run_consistency([_arm("window", url)], TARGET, ConsistencySettings(("prefix",), PLAN), out,
                           run_id, progress=progress)


@pytest.fixture(scope="module")
def clean(url, tmp_path_factory):
    """The restore bug's prefix run without faults: flagged exactly where the cache hit."""
    res = _prefix(url, tmp_path_factory.mktemp("clean"))
    t = res["conditions"]
    assert (t.flagged == (t.cached_median > 0)).all() and t.flagged.sum() == 7
    return res


def _reference_row(out):
    rows = [json.loads(x) for x in store_path(out).read_text().splitlines()]
    return next(r for r in rows if r["condition"] == "cold")


def test_a_cold_reference_warmed_by_a_late_500_is_flushed_and_rerun(url, clean, tmp_path):
    """The first /generate (the cold reference) is processed, then answered 500: its retry
    is a cache hit through the restore bug. The run sees the cached tokens, flushes, asks
    again, and its tables equal the clean run's; the verdict and manifest say so."""
    with LateFaultProxy(url, {"/generate": ["after:500"]}) as px:
        res = _prefix(px.url, tmp_path)
    ref = _reference_row(tmp_path)
    assert ref["reference"]["cached"] == 0 and ref["reruns"] == 1, ref.get("warm_cached")
    assert res["conditions"][COLS].equals(clean["conditions"][COLS])
    assert any("1 cold reply came back with prompt tokens from the cache" in v and "re-run" in v
               for v in res["verdict"]), res["verdict"]
    assert res["manifest"]["arms"][0]["cache_reruns"] == 1


def test_a_hit_turned_full_by_a_late_500_is_rerun(url, clean, tmp_path):
    """hit@31's measured request (the sixth /generate: cold, cold-again, full hit x2, its
    warm-up) is processed, then answered 500: its retry restores the whole prompt (192
    tokens), more than the 31 it shares. The run re-runs the condition; tables as clean."""
    with LateFaultProxy(url, {"/generate": ["ok"] * 5 + ["after:500"]}) as px:
        res = _prefix(px.url, tmp_path)
    t = res["conditions"].set_index("condition")
    assert t.loc["hit@31", "cached_median"] == 0 and not t.loc["hit@31", "flagged"]
    assert res["conditions"][COLS].equals(clean["conditions"][COLS])
    assert res["manifest"]["arms"][0]["cache_reruns"] == 1


def test_filler_faults_are_retried_not_the_end_of_the_run(url, tmp_path):
    """Batch fillers are streamed /v1/completions requests: a 502 and a reset on them are
    retried under the shared policy and counted, the run finishes, nothing is flagged."""
    plan = BatchPlan(length=200, probes=1, concurrency=(2,), repeats=1, steps=3)
    with FaultProxy(url, {"/v1/completions": ["502", "ok", "drop"]}) as px:
        res = run_consistency([_arm("golden", px.url)], TARGET, ConsistencySettings(("batch",), batch=plan),
                              tmp_path, "b", progress=lambda m: None)
        assert px.count("/v1/completions") == 4                      # 2 fillers + 2 retries
    assert not res["flagged"]
    assert res["manifest"]["arms"][0]["retries"] == {"POST /v1/completions (filler)": 2}


def test_cost_is_said_before_the_run_and_is_what_it_sends(url, clean, tmp_path):
    lines = []
    settings = ConsistencySettings(("prefix", "batch"), PLAN,
                                   BatchPlan(length=200, probes=1, concurrency=(2,), repeats=1, steps=3))
    with FaultProxy(url) as px:
        def progress(m):
            lines.append((m, px.count("/generate")))
        res = run_consistency([_arm("window", px.url)], TARGET, settings, tmp_path, "c", progress=progress)
    plan = [(m, n) for m, n in lines if m.startswith("plan:")]
    assert plan and plan[0][1] == 0, lines                         # said before any probe request
    text = " ".join(m for m, _ in plan)
    req = res["manifest"]["requests"]
    assert f"prefix {req['prefix/window']} requests" in text and f"batch {req['batch/window']} requests" in text


def test_lengths_below_the_template_are_refused_before_any_request(url, tmp_path):
    with FaultProxy(url) as px:
        with pytest.raises(FamilyError) as e:
            run_consistency([_arm("golden", px.url)], TARGET,
                            ConsistencySettings(("prefix", "batch"), PrefixPlan(length=320),
                                                BatchPlan(length=150)), tmp_path, "x", progress=lambda m: None)
        assert px.count("/generate") == 0 and px.count("/v1/completions") == 0
    msg = str(e.value)
    assert "batch family" in msg and "--length batch=" in msg and "150" in msg, msg
    assert "prefix" not in msg


def test_chunk_default_length_follows_a_small_reported_chunk(url, tmp_path):
    """A server prefilling in 96-token chunks: 1.5 chunks (145 tokens) is below the
    template's minimum, so the chunk family's default length is that minimum (still past
    the boundary by its window), said in the plan -- not an error minutes in."""
    from fidelity.consistency.chunk import ChunkFamily, ChunkPlan
    from fidelity.consistency.store import ProbeStore
    with FaultProxy(url, {"/get_server_info": [lambda d: {**d, "chunked_prefill_size": 96}]}) as px:
        arm = _arm("golden", px.url).connect()
    fam = ChunkFamily(arm, ProbeStore(tmp_path / "p.jsonl"), TARGET.tokenizer, TARGET.cfg, ChunkPlan(),
                      reference=object())
    fam.check()
    n = fam.length()
    assert n > 145 and n > 96 + 16 and fam.cost().requests == 4
    for short in (100, 150):        # below the probe template's minimum
        with pytest.raises(FamilyError, match=r"chunk family.*--length chunk="):
            ChunkFamily(arm, ProbeStore(tmp_path / "q.jsonl"), TARGET.tokenizer, TARGET.cfg,
                        ChunkPlan(length=short), reference=object()).check()


@pytest.mark.parametrize("opt", [["--page-size", "0"], ["--page-size", "-64"], ["--chunk-size", "0"],
                                 ["--probes", "0"], ["--length", "-5"], ["--max-tokens", "0"],
                                 ["--evict-tokens", "-1"], ["--gen-tokens", "0"], ["--length", "nope=5"]])
def test_sizes_under_one_are_an_error(opt, capsys, tmp_path):
    rc = main(["consistency", "--endpoint", "x=http://127.0.0.1:9", *opt, "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and opt[0] in err, err
    assert "Traceback" not in err
