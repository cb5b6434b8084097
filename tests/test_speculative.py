"""Speculative decoding on the golden (reference_model/speculative.py, spec_kernels.py):
outputs and logprobs bit-identical to plain decoding for K = 1, 2, 4, greedy and sampled
(seed for seed); the rolled-back state equals feeding the accepted tokens alone, across
window, ratio-4 and ratio-128 boundaries; acceptance stats; bad settings named."""
import pytest
import torch

from reference_model import Model, random_weights, tiny
from reference_model.generate import Decoder, Sampling, Scoring
from reference_model.mtp import MTP, random_mtp_weights
from reference_model.spec_kernels import recording_compressor_rows, rows_by_layer, snapshot_layer
from reference_model.speculative import SpecDecoder, SpecError


@pytest.fixture(scope="module")
def model():
    return Model(random_weights(tiny(), 0))


@pytest.fixture(scope="module")
def mtp(model):
    return MTP(model, random_mtp_weights(tiny(), 0, seed=3))


def _ids(n, seed=1):
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(dec):
    out = dec.run()
    return out.tokens, [(s.token, s.logprob, s.top) for s in out.scores], out.finish_reason


def _plain(model, ids, n, sampling):
    return _run(Decoder(model, ids, n, sampling, scoring=Scoring(top=3)))


def _spec(model, mtp, ids, n, sampling, k, oracle=None):
    d = SpecDecoder(model, mtp, k, ids, n, sampling, scoring=Scoring(top=3))
    if oracle is not None:                 # drafts from the known answer, some made wrong
        def draft(kk, d=d):
            at = len(d.out.tokens)
            return [t if (at + j) % oracle else (t + 1) % 512 for j, t in enumerate(oracle_toks[at:at + kk])]
        oracle_toks = oracle[1]
        oracle = oracle[0]
        d._draft = draft
    return _run(d), d.spec


# 120-token prompt + 24 tokens: decoding crosses the ratio-128 boundary at 128 and six
# ratio-4 groups; verifies of K+1 tokens straddle them at every offset
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, seed=7),
                                      Sampling(temperature=1.3, top_p=0.9, top_k=50, seed=11)],
                         ids=["greedy", "t0.9", "t1.3-top_p-top_k"])
def test_spec_output_is_bit_identical_to_plain_decoding(model, mtp, k, sampling):
    ids = _ids(120)
    ref = _plain(model, ids, 24, sampling)
    got, stats = _spec(model, mtp, ids, 24, sampling, k)
    assert got == ref
    assert stats.verifies >= 1 and stats.drafted >= stats.verifies - 1
    # drafts that are mostly right (every 5th wrong): accepted runs of every length
    got, stats = _spec(model, mtp, ids, 24, sampling, k, oracle=(5, ref[0] + [0] * 8))
    assert got == ref
    assert stats.accepted_total > 0 and (k == 1 or stats.accepted[k - 1] > 0)


def test_acceptance_is_counted_per_position(model, mtp):
    """An MTP that copies the target (drafts from the main model's own next-token
    distribution would be perfect); here: the stats add up and acceptance of position j+1
    never exceeds position j (a draft is only looked at after its predecessors)."""
    _, s = _spec(model, mtp, _ids(50), 30, Sampling(), 4)
    assert s.drafted == sum(s.proposed) and s.accepted_total == sum(s.accepted)
    assert all(a >= b for a, b in zip(s.accepted, s.accepted[1:]))
    assert s.accept_length == 1 + s.accepted_total / s.verifies


@pytest.mark.parametrize("start,keep", [(125, 1), (125, 3), (126, 5), (127, 2), (30, 4)])
def test_rollback_equals_feeding_the_accepted_tokens(model, start, keep):
    """A verify of 6 tokens from `start`, rolled back to `keep`: every layer's state equals
    the state of extending with the `keep` tokens alone (window rows, compressed entries,
    pending and overlap rows, indexer keys, group counts)."""
    ids = torch.tensor(_ids(start + 6))
    _, base = model.extend(ids[:start], None, "none")
    before = [snapshot_layer(s) for s in base.layers]
    with recording_compressor_rows(model.nx) as rec:
        _, after = model.extend(ids[start:], base, "none", phase="decode")
    by = rows_by_layer(model.cfg, rec)
    nx = model.nx
    rolled = [nx.spec_rollback(a, b, {"kv": by.get((i, "kv")), "index": by.get((i, "index"))}, 6, keep,
                               model.cfg.compress_ratios[i])
              for i, (a, b) in enumerate(zip(after.layers, before))]
    _, want = model.extend(ids[:start + keep], None, "none")
    for i, (r, w) in enumerate(zip(rolled, want.layers)):
        for f in ("window_kv", "comp_kv", "index_keys"):
            _same(getattr(r, f), getattr(w, f), (i, f))
        for c in ("comp", "index_comp"):
            for f in ("pending_kv", "pending_score", "prev_kv", "prev_score", "n_groups"):
                _same(getattr(getattr(r, c), f), getattr(getattr(w, c), f), (i, c, f))


def _same(a, b, where):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        na = 0 if a is None else a.shape[0]
        nb = 0 if b is None else b.shape[0]
        assert na == nb, where
        if na:
            assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_bad_settings_are_named(model, mtp):
    with pytest.raises(SpecError, match="integer >= 1"):
        SpecDecoder(model, mtp, 0, [5, 6], 4)
    with pytest.raises(SpecError, match="shorter than the sliding window"):
        SpecDecoder(model, mtp, 31, [5, 6], 4)
    other = Model(random_weights(tiny(), 1))
    with pytest.raises(SpecError, match="another model"):
        SpecDecoder(other, mtp, 2, [5, 6], 4)


def test_captures_decode_plainly(model, mtp):
    d = SpecDecoder(model, mtp, 2, _ids(20), 5, capture=["logits"])
    d.run()
    assert d.spec.verifies == 0 and len(d.out.tokens) == 5
