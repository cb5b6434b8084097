"""The golden's MTP layer (reference_model/mtp.py): the MTP-specific math against an fp64
computation written out here, the Block wired as a window-only, score-routed layer,
decode = prefill, taps named mtp.0.*, checkpoint names and sizes, bad input."""
import pytest
import torch

from reference_model import Model, Numerics, Taps, random_weights, tiny
from reference_model.checkpoint_format import disk_entries, expected_entries
from reference_model.config import flash
from reference_model.model import LayerState, SequenceState
from reference_model.mtp import MTP, MTPError, block_config, mtp_specs, random_mtp_weights


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny(), 0)


@pytest.fixture(scope="module")
def mtpw():
    return random_mtp_weights(tiny(), 0, seed=3)


def _toks(n, seed=1):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


def test_prelude_and_head_match_an_fp64_hand_computation(weights, mtpw):
    """exact/fp64 profile: X = e_proj(enorm(embed(next))) + h_proj(hnorm(H)) per copy, and
    logits = head(norm(Σ_j sigmoid(mix_j·scale + base)+eps · H_j)) with the MTP's own
    hc_head and norm, the mixes normalised by the stream's RMS: written out in fp64 here."""
    model = Model(weights, Numerics("exact", torch.float64))
    mtp = MTP(model, mtpw)
    toks = _toks(10)
    H = model.extend(toks[:-1], None, "hidden")[0]
    taps = Taps(["mtp.0.*"])
    lg, out = mtp.forward(H, toks[1:], mtp.new_state(), "all", taps)
    g = weights.global_weights()
    e = _rms(g["embed.weight"][toks[1:]].double(), mtpw["enorm.weight"])
    h = _rms(H.double(), mtpw["hnorm.weight"])
    X = (e @ mtpw["e_proj.weight"].double().T).unsqueeze(1) + h @ mtpw["h_proj.weight"].double().T
    assert torch.allclose(taps["mtp.0.in"].double(), X, rtol=1e-12, atol=1e-12)
    O = out.double().reshape(9, -1)
    mix = (O @ mtpw["hc_head_fn"].double().T) * torch.rsqrt(O.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mix * mtpw["hc_head_scale"].double() + mtpw["hc_head_base"].double()) + 1e-6
    x = _rms((pre.unsqueeze(-1) * out.double()).sum(1), mtpw["norm.weight"])
    ref = x @ g["head.weight"].double().T
    assert torch.allclose(lg.double(), ref, rtol=1e-10, atol=1e-10)
    # the MTP's head is not the main head: other hc_head params and norm
    assert not torch.allclose(model.head(out).double(), ref)


def test_block_is_a_window_only_score_routed_layer(weights, mtpw):
    """The Block equals layer 0 of a one-layer model with compress ratio 0, no hash layers
    and the MTP's block tensors; its router used the bias (scored), no indexer ran."""
    cfg = tiny()
    mtp = MTP(Model(weights), mtpw)
    one = cfg.replace(n_layers=1, compress_ratios=(0,), n_hash_layers=0)
    blk = {n: v for n, v in mtpw.items() if n in {s.name[len("mtp.0."):] for s in mtp_specs(cfg)[:-8]}}
    w1 = dict(weights.global_weights())
    w1.update({f"layers.0.{n}": v for n, v in blk.items()})
    from reference_model import InMemoryWeights
    m1 = Model(InMemoryWeights(one, w1))
    X = torch.randn(7, 4, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    toks = _toks(7)
    taps = Taps("*")
    a = mtp.runner.layer(5, X, toks, mtp.new_state(), taps)
    b = m1.layer(0, X, toks, SequenceState([LayerState()]))
    assert torch.equal(a, b)
    assert "ffn.gate.bias" in blk and "ffn.gate.tid2eid" not in blk and "attn.compressor.ape" not in blk
    assert not any("index" in n for n in taps.names())
    assert block_config(cfg).compress_ratios[-1] == 0 and not block_config(cfg).is_hash_layer(5)


def test_decode_equals_prefill_and_taps_are_named_mtp(weights, mtpw):
    """40 positions cross the 32-token window: one piece = one token at a time, bit for bit."""
    model = Model(weights)
    mtp = MTP(model, mtpw)
    toks = _toks(41)
    H = model.extend(toks[:-1], None, "hidden")[0]
    full, _ = mtp.forward(H, toks[1:], mtp.new_state(), "all")
    st = mtp.new_state()
    mtp.forward(H[:30], toks[1:31], st)
    rows = []
    for j in range(30, 40):
        lg, _ = mtp.forward(H[j:j + 1], toks[j + 1:j + 2], st)
        rows.append(lg[0])
    assert torch.equal(torch.stack(rows), full[30:])
    taps = Taps("*")
    mtp.forward(H[:3], toks[1:4], mtp.new_state(), "last", taps)
    names = set(taps.names())
    assert {"mtp.0.in", "mtp.0.out", "mtp.0.attn.out", "mtp.0.ffn.router.experts",
            "mtp.0.logits", "mtp.0.final_hidden"} <= names
    assert not any(n.startswith("layers.") for n in names)


def test_a_late_start_gives_the_same_last_output(weights, mtpw):
    """Window-only attention: a state started window positions before the end is exact."""
    model = Model(weights)
    mtp = MTP(model, mtpw)
    toks = _toks(61)
    H = model.extend(toks[:-1], None, "hidden")[0]
    full, _ = mtp.forward(H, toks[1:], mtp.new_state(), "last")
    late, _ = mtp.forward(H[28:], toks[29:], mtp.new_state(28), "last")
    assert torch.equal(full, late)


def test_flash_mtp_layer_has_deepseeks_names_and_size():
    """mtp.0.* of V4-Flash (docs/research/dsv4-architecture.md §3.1): main + MTP bytes = the real index's total."""
    cfg = flash()
    main = sum(e.nbytes for e in expected_entries(cfg).values())
    specs = mtp_specs(cfg)
    extra = sum(e.nbytes for s in specs for e in disk_entries(s))
    assert main + extra == 159_609_485_896
    names = {s.name for s in specs}
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
            "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.gate.bias",
            "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.255.w2.weight"} <= names
    assert not any("compressor" in n or "indexer" in n or "tid2eid" in n or "embed" in n for n in names)


def test_bad_input_is_named(weights, mtpw):
    model = Model(weights)
    with pytest.raises(MTPError, match="missing e_proj.weight"):
        MTP(model, {k: v for k, v in mtpw.items() if k != "e_proj.weight"})
    mtp = MTP(model, mtpw)
    with pytest.raises(MTPError, match=r"must be \[2, 4, 256\]"):
        mtp.forward(torch.zeros(3, 4, 256), torch.tensor([1, 2]), mtp.new_state())
