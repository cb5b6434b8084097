"""The speculative-decoding toggles (kernel_toggles/speculative.py): each changes a
speculative decode against plain decoding of the same arm (plain decoding never calls the
spec kernels, so it is the golden's), and changes it only where it claims: the verifier
that ignores temperature leaves greedy requests alone; the rollback bug needs a rejected
draft; the non-exact verifier moves logprobs at the first verify."""
import pytest
import torch

from kernel_toggles import ToggleSet
from reference_model import Model, random_weights, tiny
from reference_model.generate import Decoder, Sampling, Scoring
from reference_model.mtp import MTP, random_mtp_weights
from reference_model.speculative import SpecDecoder

W = random_weights(tiny(), 0)
MW = random_mtp_weights(tiny(), 0, seed=3)
IDS = torch.randint(2, 512, (70,), generator=torch.Generator().manual_seed(4)).tolist()


def _decode(arm, sampling, k=None, oracle=None):
    model = Model(W, ToggleSet.parse(arm).numerics())
    if k is None:
        d = Decoder(model, IDS, 16, sampling, scoring=Scoring(top=1))
    else:
        d = SpecDecoder(model, MTP(model, MW), k, IDS, 16, sampling, scoring=Scoring(top=1))
        if oracle is not None:          # drafts from the known answer: everything accepted
            d._draft = lambda kk, d=d: oracle[len(d.out.tokens):len(d.out.tokens) + kk]
    out = d.run()
    return out.tokens, [s.logprob for s in out.scores]


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


GREEDY, SAMPLED = Sampling(), Sampling(temperature=1.0, seed=3)


def test_golden_arm_is_unchanged_by_speculation():
    assert _decode("golden", SAMPLED, 2) == _decode("golden", SAMPLED)


def test_verify_not_batch_exact_moves_logprobs_from_the_first_verify():
    plain = _decode("golden", GREEDY)
    spec = _decode("verify_not_batch_exact", GREEDY, 2)
    assert _decode("verify_not_batch_exact", GREEDY) == plain      # plain decoding: untouched
    assert _first_diff(spec[1], plain[1]) in (1, 2, 3)     # within the first verify (token 0: prefill)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_rollback_keeping_rejected_rows_needs_a_rejection(sampling):
    plain = _decode("golden", sampling)
    bug = "rollback_keeps_rejected_compressor_rows"
    assert _decode(bug, sampling, 2, oracle=plain[0] + [0] * 4) == plain     # nothing rejected
    assert _decode(bug, sampling, 2) != plain                                # random drafts


def test_verify_ignoring_temperature_decodes_sampled_requests_greedily():
    """Greedy requests are untouched; a sampled one keeps its first token (sampled from the
    prefill's row, no verify yet) and then continues as greedy decoding would."""
    bug = "verify_ignores_temperature"
    assert _decode(bug, GREEDY, 2) == _decode("golden", GREEDY)
    toks, _ = _decode(bug, SAMPLED, 2)
    assert toks != _decode("golden", SAMPLED)[0]
    greedy = Decoder(Model(W), IDS + toks[:1], 15).run().tokens
    assert toks[1:] == greedy


def test_correction_row_not_snapshotted_injects_bos_after_a_partial_acceptance():
    """ds4 #750's shape: never with one draft or when every draft is accepted; with two
    drafts, greedy decoding parts from plain decoding exactly where a BOS (id 0) appears."""
    bug = "correction_row_not_snapshotted"
    plain = _decode("golden", GREEDY)
    assert _decode(bug, GREEDY, 1) == plain
    assert _decode(bug, GREEDY, 2, oracle=plain[0] + [0] * 4) == plain
    # drafts right at even steps only: the first verify (steps 1-2) rejects its first draft,
    # the second (steps 2-3) accepts one and rejects the next -> its correction is BOS
    half = [t if i % 2 == 0 else t + 1 for i, t in enumerate(plain[0])]
    toks, _ = _decode(bug, GREEDY, 2, oracle=half + [0] * 4)
    i = _first_diff(toks, plain[0])
    assert i == 3 and toks[i] == 0 and 0 not in plain[0][:i + 1]
    assert _decode("golden", GREEDY, 2, oracle=half + [0] * 4) == plain


@pytest.mark.parametrize("k", [1, 2])
def test_verify_accepting_near_top_drafts_emits_tokens_that_are_not_their_rows_top1(k):
    """A lossy acceptance rule: with one draft as with two, greedy replies hold drafted
    tokens ranked below the top-1 of their own reported row (a correct verifier never
    emits one: the golden arm's ranks are all 1); plain decoding is untouched."""
    bug = "verify_accepts_near_top"
    assert _decode(bug, GREEDY) == _decode("golden", GREEDY)

    def ranks(arm):
        model = Model(W, ToggleSet.parse(arm).numerics())
        d = SpecDecoder(model, MTP(model, MW), k, IDS, 16, GREEDY, scoring=Scoring(top=1))
        return [s.rank for s in d.run().scores]
    assert set(ranks("golden")) == {1}
    assert max(ranks(bug)) > 1
