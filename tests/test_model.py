"""The golden forward: decode equals prefill, chunking invariance, layer-major API, taps,
bad input. (Numerics of single kernels: test_kernels.py; outside oracle:
test_transformers_oracle.py.)"""
import pytest
import torch

from reference_model import InputError, Model, Numerics, Taps, random_weights, tiny


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny(), 0)


def _tokens(n, seed=1):
    return torch.randint(0, tiny().vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm())


def _decode_logits(model, toks, n_prefill):
    _, st = model.extend(toks[:n_prefill], logits="none")
    out = []
    for j in range(n_prefill, len(toks)):
        lg, st = model.extend(toks[j:j + 1], st)
        out.append(lg[0])
    return torch.stack(out)


# 300 tokens: crosses the 32-token window, 75 ratio-4 groups (> index_topk 16) and two
# ratio-128 groups; decoding from 200 crosses both compressor boundaries at 255/256.
@pytest.mark.parametrize("profile,bound", [("exact", 1e-5), ("reference", 0.0)])
def test_decode_equals_prefill(weights, profile, bound):
    model = Model(weights, Numerics(profile))
    toks = _tokens(300)
    full = model.prefill_logits(toks)
    dec = _decode_logits(model, toks, 200)
    assert _rel(full[200:], dec) <= bound


def test_reference_decode_is_bit_identical_in_every_tap(weights):
    """The reference profile accumulates in fp64 and rounds at the reference's storage
    points, so row count / chunking cannot change a single bit anywhere."""
    model = Model(weights, Numerics("reference"))
    toks = _tokens(140, seed=3)
    full = Taps("layers.*")
    model.prefill_logits(toks, full)
    inc = Taps("layers.*")
    _, st = model.extend(toks[:100], logits="none", taps=inc)
    for j in range(100, 140):
        model.extend(toks[j:j + 1], st, taps=inc)
    names = [n for n in full.names() if "compressed_kv" not in n and "last_scores" not in n]
    assert names
    for n in names:
        assert torch.equal(full[n], inc[n]), n


@pytest.mark.parametrize("chunk", [1, 37, 128])
def test_chunked_prefill_invariance(weights, chunk):
    toks = _tokens(260, seed=2)
    a = Model(weights, Numerics("reference")).prefill_logits(toks)
    b = Model(weights, Numerics("reference"), chunk_tokens=chunk).prefill_logits(toks)
    assert torch.equal(a, b)


def test_layer_major_api_equals_extend(weights):
    model = Model(weights, Numerics("reference"))
    toks = _tokens(90, seed=4)
    ref = model.prefill_logits(toks)
    st = model.new_state()
    H = model.embed(toks)
    for i in range(model.cfg.n_layers):
        H = model.layer(i, H, toks, st)
    assert torch.equal(model.head(H), ref)


def test_exact_fp64_and_reference_profiles_differ_by_the_noise_floor(weights):
    toks = _tokens(200, seed=5)
    ex32 = Model(weights, Numerics("exact")).prefill_logits(toks)
    ex64 = Model(weights, Numerics("exact", torch.float64)).prefill_logits(toks)
    ref = Model(weights, Numerics("reference")).prefill_logits(toks)
    assert ex64.dtype == torch.float64 and ref.dtype == torch.float32
    assert _rel(ex64, ex32) < 1e-5                 # fp32 vs fp64: rounding only
    assert 1e-3 < _rel(ex64, ref) < 0.5            # simulated quantisation is visible


def test_taps_are_captured_only_when_asked(weights):
    model = Model(weights, Numerics("reference"))
    taps = Taps(["layers.1.attn.index.topk", "logits"])
    model.prefill_logits(_tokens(120), taps)
    assert sorted(taps.names()) == ["layers.1.attn.index.topk", "logits"]
    topk = taps["layers.1.attn.index.topk"]
    cfg = tiny()
    assert topk.shape == (120, cfg.index_topk)
    t = torch.arange(120)
    # a query sees only complete groups: every pick j satisfies j < (t+1)//4
    assert bool(((topk < ((t + 1) // 4).unsqueeze(1)) | (topk == -1)).all())
    # once more than index_topk groups are visible, exactly index_topk are picked
    assert bool((topk[(t + 1) // 4 >= cfg.index_topk] >= 0).all())
    with pytest.raises(KeyError, match="was not captured"):
        taps["layers.0.out"]


def test_bad_input_errors(weights):
    cfg = tiny()
    model = Model(weights, Numerics("reference"))
    with pytest.raises(InputError, match="out of range"):
        model.prefill_logits(torch.tensor([1, cfg.vocab_size]))
    with pytest.raises(InputError, match="out of range"):
        model.prefill_logits(torch.tensor([-1, 2]))
    with pytest.raises(InputError, match="empty"):
        model.prefill_logits(torch.tensor([], dtype=torch.long))
    with pytest.raises(InputError, match="1-D"):
        model.prefill_logits(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InputError, match="integer"):
        model.prefill_logits(torch.zeros(3))
    small = Model(random_weights(cfg.replace(max_seq_len=64), 0), Numerics())
    with pytest.raises(InputError, match="exceeds max_seq_len=64"):
        small.prefill_logits(_tokens(65))
    with pytest.raises(ValueError, match="unknown numerics profile"):
        Numerics("fast")
