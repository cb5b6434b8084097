"""The lockstep's head runs a chunk of positions at a time and reduces each chunk against
golden's on the fly: the tables equal a whole-prompt reduction bit for bit, no head call
sees more than a chunk, and the per-position KLD equals one computed independently from
each arm's whole-prompt logits."""
import math

import pandas as pd
import pytest
import torch

from fidelity.ab import head as HD
from fidelity.ab import metrics as M
from fidelity.ab.lockstep import Chunking, LockstepArm, LockstepRunner, Prompt, RunnerSettings
from kernel_toggles import ToggleSet
from reference_model import Model, Numerics, tiny
from reference_model.weights import random_weights


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny(), seed=3)


def _arms():
    return [LockstepArm("golden", Numerics("reference"), role="golden"),
            LockstepArm("engine", ToggleSet.parse("engine").numerics(), frozenset({"engine"})),
            LockstepArm("bug", ToggleSet.parse("engine,routed_scaling_double").numerics(), frozenset({"b"}))]


def _prompts():
    g = torch.Generator().manual_seed(9)
    return [Prompt(f"p{j}", torch.randint(2, 500, (n,), generator=g)) for j, n in enumerate((150, 37))]


def _tables(res):
    return {k: pd.DataFrame(getattr(res, k)) for k in ("drift", "kld", "pairs", "pair_kld")}


@pytest.mark.slow          # ~150 s: the default run keeps test_kld_rows_equal_whole_prompt_logits
def test_chunked_head_tables_equal_one_chunk(weights):
    whole = LockstepRunner(weights, _arms(), RunnerSettings(decode_steps=2), {"bug": "engine"},
                           chunking=Chunking(head=10**6)).run(_prompts())
    for chunk in (7, 64):
        part = LockstepRunner(weights, _arms(), RunnerSettings(decode_steps=2), {"bug": "engine"},
                              chunking=Chunking(head=chunk)).run(_prompts())
        a, b = _tables(whole), _tables(part)
        assert (a["drift"].tap == "logits").sum() > 0 and len(a["pair_kld"]) > 0
        for k in a:
            pd.testing.assert_frame_equal(a[k], b[k], check_exact=True)


def test_no_head_call_sees_more_than_a_chunk(weights, monkeypatch):
    seen = []
    real = Model.head

    def spy(self, H, taps=None):
        seen.append(H.shape[0])
        return real(self, H, taps)

    monkeypatch.setattr(Model, "head", spy)
    LockstepRunner(weights, _arms(), RunnerSettings(decode_steps=1), chunking=Chunking(head=32)).run(_prompts())
    assert max(seen) == 32 and sum(seen) == 3 * (150 + 37 + 2)      # 3 arms, prefill + 1 step


def test_kld_rows_equal_whole_prompt_logits(weights):
    """Outside computation: each arm's whole-prompt logits from Model.prefill_logits."""
    p = _prompts()[0]
    res = LockstepRunner(weights, _arms()[:2], RunnerSettings(decode_steps=0), chunking=Chunking(head=16)).run([p])
    g = Model(weights, Numerics("reference")).prefill_logits(p.tokens).double()
    e = Model(weights, ToggleSet.parse("engine").numerics()).prefill_logits(p.tokens).double()
    lg, le = torch.log_softmax(g, -1), torch.log_softmax(e, -1)
    expect = (lg.exp() * (lg - le)).sum(-1).clamp_min(0)
    got = torch.tensor([r["kld"] for r in res.kld], dtype=torch.float64)
    assert len(got) == p.length and float(expect.max()) > 0
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-15)


def test_row_stats_summaries_equal_whole_tensor_metrics(monkeypatch):
    monkeypatch.setattr(HD, "METRIC_ROWS", 5)
    g = torch.Generator().manual_seed(0)
    ref, arm = torch.randn(23, 40, generator=g), torch.randn(23, 40, generator=g)
    arm[11, 3] = 9.0                                                   # the largest |Δ|
    rows = HD.row_stats(ref, arm)
    spans = [(0, 23), (4, 17)]
    assert M.tensor_metrics_from_rows(rows, spans, (23, 40)) == M.tensor_metrics_rows(ref, arm, spans)
    assert M.tensor_metrics_rows(ref, arm, spans)[0]["max_abs_at"] == [11, 3]
    whole = M.logits_metrics(ref, arm)
    assert M.logits_summary(rows) == whole and whole["n"] == 23
    arm[2, 0] = math.nan
    assert not M.logits_summary(HD.row_stats(ref, arm))["finite"]


def test_inprocess_kld_scorer_reads_the_head_a_chunk_at_a_time(weights, monkeypatch):
    """fidelity kld's in-process arm: its per-position distributions equal log-softmax of
    the whole-prompt logits, and no head call sees more than the model's chunk."""
    import numpy as np

    from fidelity.scores.dialects import Request
    from fidelity.scores.inprocess import InProcessScorer
    ids = _prompts()[0].tokens.tolist()
    want = torch.log_softmax(Model(weights, Numerics("reference")).prefill_logits(torch.tensor(ids)).double(), -1)
    sc = InProcessScorer("golden", Numerics("reference"), weights)
    sc.model.chunk_tokens = 16
    seen = []
    real = Model.head
    monkeypatch.setattr(Model, "head", lambda self, H, taps=None: seen.append(H.shape[0]) or real(self, H, taps))
    s = sc.score(ids, Request(k=20, steps=2, captures=False))
    rows = np.stack([k.logp for k in s.known])
    assert rows.shape == tuple(want.shape) and max(seen) == 16
    np.testing.assert_array_equal(rows, want.numpy())
    assert s.actual[:-1] == [float(want[j, ids[j + 1]]) for j in range(len(ids) - 1)]
    tail = s.known[-3:]
    assert len(tail) == 3 and np.array_equal(tail[2].logp, want[-1].numpy())
