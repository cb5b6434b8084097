"""reference_model.generate against independent computations: prompt scores (logprob,
rank, top-k, requested ids) against a brute-force fp64 sort, chunked scoring equal to one
pass, top-k / logit-bias sampling by their definitions, and the stepwise Decoder equal to
generate()."""
import math

import pytest
import torch

import reference_model.generate as G
from reference_model.generate import Decoder, Sampling, Scoring, generate, score_prompt


def _brute(row: torch.Tensor, token: int):
    vals = [float(v) for v in row.double()]
    m = max(vals)
    lse = m + math.log(sum(math.exp(v - m) for v in vals))
    lp = [v - lse for v in vals]
    order = sorted(range(len(lp)), key=lambda i: -lp[i])
    return lp, 1 + sum(1 for v in lp if v > lp[token]), order


def test_score_prompt_matches_brute_force_and_chunks(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 37, generator=g).float()
    ids = torch.randint(0, 37, (9,), generator=g)
    full = score_prompt(logits, ids, 4, 0, (3, 5))
    monkeypatch.setattr(G, "ROWS_PER_CHUNK", 2)
    assert score_prompt(logits, ids, 4, 0, (3, 5)) == full          # chunking changes nothing
    assert full[0] is None and len(full) == 9
    for j in range(1, 9):
        lp, rank, order = _brute(logits[j - 1], int(ids[j]))
        s = full[j]
        assert s.token == int(ids[j]) and s.rank == rank
        assert s.logprob == pytest.approx(lp[int(ids[j])], abs=1e-12)
        assert [i for i, _ in s.top] == order[:4]
        assert [v for _, v in s.top] == sorted([v for _, v in s.top], reverse=True)
        assert [i for i, _ in s.ids] == [3, 5] and s.ids[1][1] == pytest.approx(lp[5], abs=1e-12)
    later = score_prompt(logits, ids, 0, 5)                          # from position 5, no None
    assert [s.token for s in later] == [int(i) for i in ids[5:]] and later[0].top == []


def test_pick_top_k_and_logit_bias():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    gen = torch.Generator().manual_seed(1)
    picks = {G._pick(logits, Sampling(temperature=2.0, top_k=2), gen) for _ in range(300)}
    assert picks == {1, 2}                                           # only the two highest
    picks = {G._pick(logits, Sampling(temperature=2.0, top_k=1), gen) for _ in range(50)}
    assert picks == {1}
    assert G._pick(logits, Sampling(logit_bias={3: 100.0}), None) == 3
    assert G._pick(logits, Sampling(logit_bias={1: -100.0}), None) == 2
    assert logits[1] == 3.0                                          # the caller's logits untouched


def test_decoder_steps_equal_generate(target_model):
    model, ids = target_model
    ref = generate(model, ids, 5, Sampling(0.7, seed=11), Scoring.of_logprobs(2, echo=True))
    d = Decoder(model, ids, 5, Sampling(0.7, seed=11), (), Scoring(top=2, prompt_top=2, prompt_from=0))
    seen = []
    while not d.done:
        t = d.step()
        if t is not None:
            seen.append(t)
    assert seen == ref.tokens == d.out.tokens and d.steps == len(ref.tokens)
    assert d.out.prompt_logprobs == ref.prompt_logprobs and d.out.logprobs == ref.logprobs
    only_prompt = Decoder(model, ids, 0, scoring=Scoring(prompt_top=0, prompt_from=1))
    assert only_prompt.run().tokens == [] and only_prompt.steps == 1
    assert len(only_prompt.out.prompt_scores) == len(ids) - 1


@pytest.fixture(scope="module")
def target_model():
    from fidelity.weights.target import load_target
    from reference_model import Model, Numerics
    t = load_target(None)
    return Model(t.weights, Numerics("reference")), t.tokenizer.encode("The river keeps talking.")
