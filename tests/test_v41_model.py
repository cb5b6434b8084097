"""The golden DeepSeek-V4.1 forward (reference_model/v41/model.py) on the tiny V4.1 config
with seeded random weights: decode = prefill and chunked = one-shot bit for bit, the
layer-major API, streamed = dense = resident-quantised = in-memory checkpoints, the lockstep
driving it, and the wiring of what V4.1 shares between layers (compressed KV and top-k from
their sources, the Engram history across decode steps, the lagged mHC pre-mix carried in
the stream).
The kernels themselves are hand-tested in test_v41_kernels.py."""
import copy

import pytest
import torch

from reference_model import Model, Numerics, Taps, build_model, random_weights as v4_random, tiny
from reference_model.v41 import kernels as K
from reference_model.v41 import stream
from reference_model.v41.config import tiny_v41
from reference_model.v41.model import EngramVocabularyError, ModelV41, token_map_for
from reference_model.v41.weights import random_weights

CFG = tiny_v41()
# 70 tokens: past the 16-token window, 35 ratio-2 / 70 ratio-1 entries (> index_topk 8),
# more than candidate_topk_blocks x block = 16 visible ratio-1 positions (layer 8's
# candidates bite); decoding from 52 crosses open and closed ratio-2 groups.
N, N_PRE = 70, 52


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, 0)


@pytest.fixture(scope="module")
def toks():
    return torch.randint(0, CFG.vocab_size, (N,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def golden(weights, toks):
    """One-shot prefill logits and every tap."""
    taps = Taps("*")
    logits = ModelV41(weights, Numerics("reference")).prefill_logits(toks, taps)
    return logits, taps


def _decode(model, toks, n_pre, taps=None):
    _, st = model.extend(toks[:n_pre], logits="none", taps=taps)
    out = []
    for j in range(n_pre, len(toks)):
        lg, st = model.extend(toks[j:j + 1], st, taps=taps)
        out.append(lg[0])
    return torch.stack(out), st


# ---- decode = prefill, chunked = one-shot ----------------------------------------------------
def test_decode_equals_prefill_bit_for_bit_in_every_tap(weights, toks, golden):
    full, gtaps = golden
    inc = Taps("*")
    dec, st = _decode(ModelV41(weights, Numerics("reference")), toks, N_PRE, inc)
    assert torch.equal(dec, full[N_PRE:])
    per_call = ("compressed_kv", "index_keys", "last_scores", "logits", "final_hidden")
    names = [n for n in gtaps.names() if not n.endswith(per_call)]
    assert len(names) > 100
    for n in names:
        assert torch.equal(gtaps[n], inc[n]), n
    # the compressed caches and index keys grew to the same entries
    one = ModelV41(weights, Numerics("reference")).extend(toks, logits="none")[1]
    for s in CFG.kv_source_layers:
        assert torch.equal(st.layers[s].comp_kv, one.layers[s].comp_kv)
        assert torch.equal(st.layers[s].index_keys, one.layers[s].index_keys)


def test_decode_equals_prefill_exact_profile(weights, toks):
    m = ModelV41(weights, Numerics("exact"))
    full = m.prefill_logits(toks)
    dec, _ = _decode(m, toks, N_PRE)
    assert float((full[N_PRE:] - dec).norm() / full[N_PRE:].norm()) < 1e-5


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_equals_one_shot(weights, toks, golden, chunk):
    assert torch.equal(ModelV41(weights, Numerics("reference"), chunk_tokens=chunk).prefill_logits(toks),
                       golden[0])


def test_layer_major_api_equals_extend(weights, toks, golden):
    m = ModelV41(weights, Numerics("reference"))
    st = m.new_state()
    S = m.embed(toks)
    for i in range(CFG.n_layers):
        S = m.layer(i, S, toks, st)
    assert torch.equal(m.head(S), golden[0])
    H, _ = m.extend(toks, None, "hidden")
    assert torch.equal(torch.cat([m.head(H[a:a + 9]) for a in range(0, N, 9)]), golden[0])


def test_reference_and_exact_differ_by_the_quantisation_floor(weights, toks, golden):
    ex = ModelV41(weights, Numerics("exact", torch.float64)).prefill_logits(toks)
    rel = float((ex - golden[0].double()).norm() / ex.norm())
    assert 1e-3 < rel < 0.5 and bool(torch.isfinite(golden[0]).all())


# ---- checkpoints: streamed = dense = resident-quantised = in memory ---------------------------------------------
def test_streamed_and_dense_checkpoints_equal_in_memory(weights, toks, golden, tmp_path):
    from fidelity.weights.source import checkpoint_config, load_weights
    from reference_model.v41.checkpoint_write import save_checkpoint
    save_checkpoint(weights, tmp_path / "tiny-v41")
    streamed, _ = load_weights(str(tmp_path / "tiny-v41"), mode="streamed")
    dense, label = load_weights(str(tmp_path / "tiny-v41"), mode="dense")
    assert label.endswith("(dense)") and checkpoint_config(str(tmp_path / "tiny-v41")) == CFG
    resident, _ = load_weights(str(tmp_path / "tiny-v41"), mode="resident-quantised")
    for w in (streamed, dense, resident):
        m = build_model(w, Numerics("reference"))
        assert m.parts.name == "v4.1"            # the config picked V4.1's parts
        assert torch.equal(m.prefill_logits(toks), golden[0])
    assert streamed.loads == CFG.n_layers


# ---- the lockstep drives it -----------------------------------------------------------------
def test_lockstep_runs_v41(weights, toks):
    from fidelity.ab.lockstep import LockstepArm, LockstepRunner, RunnerSettings
    from fidelity.design.prompts import Prompt
    arms = [LockstepArm("golden", Numerics("reference"), role="golden"),
            LockstepArm("copy", Numerics("reference")),
            LockstepArm("exact", Numerics("exact"), role="floor")]
    res = LockstepRunner(weights, arms, RunnerSettings(decode_steps=2)).run([Prompt("p0", toks[:40])])
    assert not res.events
    copy_rows = [r for r in res.drift if r["arm"] == "copy"]
    assert copy_rows and all(r.get("rel_l2", 0) == 0 for r in copy_rows if "rel_l2" in r)
    taps = {r["tap"] for r in res.drift if r["arm"] == "exact"}
    assert {"attn.kv", "attn.index.topk", "attn.out", "ffn.router.experts", "out", "logits"} <= taps
    exact_kld = [r["kld"] for r in res.kld if r["arm"] == "exact"]
    assert len(exact_kld) == 40 + 2 and max(exact_kld) > 0
    # rows per layer: every layer is compared; top-k on the index sources only
    topk_layers = {r["layer"] for r in res.drift if r["tap"] == "attn.index.topk"}
    assert topk_layers == set(CFG.index_source_layers)


def test_build_model_picks_the_version():
    assert type(build_model(v4_random(tiny(), 0), Numerics())) is Model
    with pytest.raises(TypeError, match="DeepSeek-V4.1 configs"):
        ModelV41(v4_random(tiny(), 0), Numerics())


# ---- what V4.1 shares between layers --------------------------------------------------------
def _layer_major(m, toks, st=None, edit=None):
    """Run layer by layer, calling edit(i, state) after layer i; taps of every layer."""
    st = st or m.new_state()
    taps = Taps("*")
    S = m.embed(toks, taps)
    for i in range(CFG.n_layers):
        S = m.layer(i, S, toks, st, taps)
        if edit:
            edit(i, st)
    m.head(S, taps)
    st.pos += toks.numel()
    return taps, st


def test_reuse_layers_read_their_sources_kv_and_topk(weights, toks, golden):
    """Layers 3/5/7/9 own no compressed cache; a reuse layer attends with its index
    source's picks (blanking layer 8's picks changes layer 9 only, not layer 7)."""
    m = ModelV41(weights, Numerics("reference"))
    _, st = m.extend(toks, logits="none")
    for i in range(CFG.n_layers):
        own = i in CFG.kv_source_layers
        assert (st.layers[i].comp_kv is not None) == own and (st.layers[i].index_keys is not None) == own
        assert not st.layers[i].topk and not st.layers[i].blocks   # per-call scratch dropped

    def blank(i, s):
        if i == 8:
            s.layers[8].topk[0] = torch.full_like(s.layers[8].topk[0], -1)
    taps, _ = _layer_major(ModelV41(weights, Numerics("reference")), toks, edit=blank)
    g = golden[1]
    for i in range(9):
        assert torch.equal(taps[f"layers.{i}.out"], g[f"layers.{i}.out"]), i
    assert not torch.equal(taps["layers.9.attn.out"], g["layers.9.attn.out"])


def test_reuse_attends_to_the_sources_compressed_entries(weights, toks):
    """Perturbing layer 2's compressed cache before a decode step moves layers 2-3 (which
    read it) and nothing before them."""
    m = ModelV41(weights, Numerics("reference"))
    _, st = m.extend(toks[:N_PRE], logits="none")
    st2 = copy.deepcopy(st)
    st2.layers[2].comp_kv = st2.layers[2].comp_kv.flip(0)
    a, b = Taps("*"), Taps("*")
    m.extend(toks[N_PRE:N_PRE + 1], st, taps=a)
    m.extend(toks[N_PRE:N_PRE + 1], st2, taps=b)
    assert torch.equal(a["layers.1.out"], b["layers.1.out"])
    assert not torch.equal(a["layers.3.attn.out"], b["layers.3.attn.out"])


def test_candidates_restrict_the_reindex_layer(weights, toks, golden):
    """Layer 8 picks only inside layer 6's candidate blocks (and the newest block is
    always a candidate); with 70 visible ratio-1 entries, 4 blocks x 4 restrict it."""
    g = golden[1]
    picks = g["layers.8.attn.index.topk"]
    m = ModelV41(weights, Numerics("reference"))
    kept = []

    def grab(i, s):
        if i == 6:
            kept.append(s.layers[6].blocks[0].clone())
    _layer_major(m, toks, edit=grab)
    blocks = kept[0]
    t = torch.arange(N)
    for q in range(N):
        for j in picks[q][picks[q] >= 0].tolist():
            assert blocks[q, j // CFG.candidate_block_size], (q, j)
    assert bool(blocks[t, t // CFG.candidate_block_size].all())   # newest visible block kept
    assert int(blocks[-1].sum()) == CFG.candidate_topk_blocks
    # without the restriction layer 8 would pick differently somewhere
    assert not torch.equal(picks, g["layers.6.attn.index.topk"])


def test_engram_history_persists_across_decode_steps(weights, toks, golden):
    m = ModelV41(weights, Numerics("reference"))
    taps = Taps(["layers.1.engram.ids", "layers.4.engram.ids"])
    _, st = _decode(m, toks, N_PRE, taps)
    assert torch.equal(st.engram_hist, K.compress_history(toks, token_map_for(CFG)))
    for i in (1, 4):
        assert torch.equal(taps[f"layers.{i}.engram.ids"], golden[1][f"layers.{i}.engram.ids"])
    # a step hashed without its history would differ: the 4-gram at the first decode
    # position reaches back into the prefill
    lost = K.engram_hash(st.engram_hist[N_PRE:], torch.arange(0, N - N_PRE), m.engram.layout, m.engram.pad_c)
    assert not torch.equal(lost[:, 0], taps["layers.1.engram.ids"][N_PRE:])


def test_lagged_pre_mix_travels_in_the_stream_and_feeds_the_head(weights, toks, golden):
    """P after layer 0 is layer 0's FFN pre-mix, computed from the streams after its
    attention (doc §5.3), and the head collapses the last streams with the last P."""
    m = ModelV41(weights, Numerics("reference"))
    nx = m.nx
    g = golden[1]
    st = m.new_state()
    S0 = m.embed(toks)
    H0, P0 = stream.unpack(S0, CFG.dim)
    assert torch.equal(P0, K.identity_pre_mix(N, CFG.hc_mult))
    S1 = m.layer(0, S0, toks, st)
    H1, P1 = stream.unpack(S1, CFG.dim)
    w = m._weights(0)
    H_mid = nx.hc_post(g["layers.0.attn.out"], H0, g["layers.0.hc_attn.post"], g["layers.0.hc_attn.comb"])
    pre_f, post_f, _ = K.hc_mix(nx, H_mid, w["hc_ffn_fn"], w["hc_ffn_scale"], w["hc_ffn_base"],
                                CFG.hc_sinkhorn_iters, CFG.hc_eps, CFG.norm_eps)
    assert torch.equal(P1, pre_f.float()) and torch.equal(post_f, g["layers.0.hc_ffn.post"].double())
    assert torch.equal(H1, g["layers.0.out"])
    # the head: norm(collapse(H, P)) through the fp32 head weight
    S = S1
    for i in range(1, CFG.n_layers):
        S = m.layer(i, S, toks, st)
    H, P = stream.unpack(S, CFG.dim)
    gw = m._weights(None)
    x = K.head_collapse(nx, H, P, gw["norm.weight"], CFG.norm_eps)
    assert torch.equal(nx.lm_head(x, gw["head.weight"]), golden[0])
    # P matters: the head with P_0 instead moves the logits
    assert not torch.equal(m.head(stream.pack(H, torch.ones_like(P) / 4, nx.sd)), golden[0])


# ---- bad input -------------------------------------------------------------------------------
def test_bad_input_is_named(weights, toks):
    m = ModelV41(weights, Numerics("reference"))
    v4_stream = torch.zeros(3, CFG.hc_mult, CFG.dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="DeepSeek-V4.1 residual stream"):
        m.layer(0, v4_stream, toks[:3], m.new_state())
    with pytest.raises(EngramVocabularyError, match="config engram_compressed_vocab_size is 431"):
        token_map_for(CFG.replace(engram_compressed_vocab_size=431, engram_num_embeddings=(462, 630)))
    from reference_model import InputError
    with pytest.raises(InputError, match="out of range"):
        m.prefill_logits(torch.tensor([1, CFG.vocab_size]))


def test_placement_over_devices_equals_one_device(weights, toks, golden):
    m = build_model(weights, Numerics("reference"), devices=["cpu", "cpu"])
    assert sorted(set(m._owner)) == [0, 1]
    assert torch.equal(m.prefill_logits(toks), golden[0])
