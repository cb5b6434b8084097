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
