"""DeepSeek-V4.1 toggles (kernel_toggles/v41.py) on the tiny V4.1 model: each alternative
reading moves the logits (in prefill, or only on the decode steps it is about) and leaves
every tap before its kernel bit-identical to golden; V4 toggles on kernels V4.1 shares act
too; V4.1 toggles never act on a V4 model; `fidelity ab` on a tiny V4.1 checkpoint names a
planted one."""
import pytest
import torch

import kernel_toggles as K
from reference_model import Model, Numerics, Taps, random_weights as v4_random, tiny
from reference_model.v41.config import tiny_v41
from reference_model.v41.model import ModelV41
from reference_model.v41.numerics import V41_KERNELS
from reference_model.v41.weights import random_weights

CFG = tiny_v41()
N_PRE, N = 20, 22          # decode at 20 (a ratio-2 group stays open) and 21 (it closes)

# toggle -> (first tap that differs from golden, moves the one-shot prefill?)
FIRST_TAP = {
    "engram_history_microbatch": ("layers.1.engram.ids", False),
    "v41_v4_hc_order": ("layers.0.attn.q", True),          # layer 0 collapses with its own pre
    "v41_q_head_norm": ("layers.0.attn.q", True),
    "v41_window_kv_v4_grid": ("layers.0.attn.kv", True),
    "v41_fp8_scale_block128": ("layers.0.attn.q", True),   # wq_a/wq_b rescaled
    "v41_stale_index_keys": ("layers.2.attn.index.topk", False),
}

# engines' readings of doc §9 (optimizations, V4.1's engine arm) -> first tap that differs
ENGINE_TAP = {
    "rmsnorm_cast_first": "layers.0.attn.q",
    "compressor_norm_fp32": "layers.2.attn.compressed_kv",
    "compressed_kv_mxfp8": "layers.2.attn.compressed_kv",
    "compressed_kv_bf16": "layers.2.attn.compressed_kv",
    "attn_logits_bf16": "layers.0.attn.out",
    "index_keys_fp8": "layers.2.attn.index_keys",             # V4's toggle on V4.1's index keys
}


@pytest.fixture(scope="module")
def setup():
    w = random_weights(CFG, 0)
    toks = torch.randint(0, CFG.vocab_size, (N,), generator=torch.Generator().manual_seed(3))
    return w, toks, _run(w, toks, Numerics("reference"))


def _run(w, toks, nx):
    """(prefill logits, prefill taps, decode logits, decode taps)."""
    m = ModelV41(w, nx)
    pt = Taps("*")
    full, st = m.extend(toks[:N_PRE], None, "all", pt)
    dt, dec = Taps("*"), []
    for j in range(N_PRE, N):
        lg, st = m.extend(toks[j:j + 1], st, "last", dt)
        dec.append(lg[0])
    return full, pt, torch.stack(dec), dt


def _first_difference(g: Taps, a: Taps):
    for n in g.names():
        if n.endswith("last_scores"):            # per-call widths: kept for margins only
            continue
        if n in a and not torch.equal(g[n], a[n]):
            return n
    return None


def test_every_v41_toggle_is_listed_here():
    v41 = {t.name for t in K.all_toggles() if t.builtin and set(t.kernels) <= set(V41_KERNELS)}
    assert v41 == set(FIRST_TAP) | (set(ENGINE_TAP) - {"rmsnorm_cast_first", "attn_logits_bf16",
                                                       "index_keys_fp8"}) | {"candidate_underfill_keep"}
    assert all(K.get(n).category == "known-bug" for n in FIRST_TAP)
    assert all(K.get(n).versions == ("v41",) for n in v41 | {"rmsnorm_cast_first", "attn_logits_bf16"})


@pytest.mark.parametrize("name", list(ENGINE_TAP))
def test_engine_reading_moves_logits_from_its_kernel_on(setup, name):
    w, toks, (gfull, gpt, gdec, _) = setup
    full, pt, dec, _ = _run(w, toks, K.ToggleSet.parse(name).numerics())
    assert not torch.equal(full, gfull) and not torch.equal(dec, gdec)
    assert _first_difference(gpt, pt) == ENGINE_TAP[name]


@pytest.mark.parametrize("name", list(FIRST_TAP))
def test_v41_toggle_moves_logits_from_its_kernel_on(setup, name):
    w, toks, (gfull, gpt, gdec, gdt) = setup
    tap, in_prefill = FIRST_TAP[name]
    full, pt, dec, dt = _run(w, toks, K.ToggleSet.parse(name).numerics())
    assert not torch.equal(dec, gdec), "decode logits unmoved"
    if in_prefill:
        assert not torch.equal(full, gfull)
        assert _first_difference(gpt, pt) == tap
    else:
        assert torch.equal(full, gfull) and _first_difference(gpt, pt) is None
        assert _first_difference(gdt, dt) == tap


def test_stale_index_keys_acts_only_where_a_ratio2_group_stays_open(setup):
    """At position 20 layer 2 closes no group and reads layer 6's keys; at 21 it closes
    one and reads its own again (its picks match golden's there)."""
    w, toks, (_, _, _, gdt) = setup
    _, _, _, dt = _run(w, toks, K.ToggleSet.parse("v41_stale_index_keys").numerics())
    g, a = gdt["layers.2.attn.index.topk"], dt["layers.2.attn.index.topk"]
    assert not torch.equal(g[0], a[0]) and torch.equal(g[1], a[1])


def test_v4_toggles_on_shared_kernels_act_on_v41(setup):
    w, toks, (gfull, *_ ) = setup
    for name in ("lm_head_bf16", "wo_a_fp8"):
        assert not torch.equal(_run(w, toks, K.ToggleSet.parse(name).numerics())[0], gfull), name


def test_v41_toggles_never_act_on_v4():
    w = v4_random(tiny(), 0)
    toks = torch.randint(0, tiny().vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    g = Model(w, Numerics("reference")).prefill_logits(toks)
    arm = K.ToggleSet.parse(",".join(FIRST_TAP))
    assert torch.equal(Model(w, arm.numerics()).prefill_logits(toks), g)


def test_v41_toggles_compose_and_record_their_kernels():
    nx = K.ToggleSet.parse("v41_q_head_norm,v41_stale_index_keys").numerics()
    assert set(nx.replaced) == {"q_head_norm", "index_key_source"}
    with pytest.raises(K.ToggleError, match="unknown toggle"):
        K.ToggleSet.parse("v41_no_such_reading")


def test_fidelity_ab_names_planted_v41_bugs():
    """The whole ab pipeline on a DeepSeek-V4.1 checkpoint (random weights): the planted
    readings are named by outcome (answer/final-logit KLD) or by mechanism (indexer picks,
    expert sets). v41_stale_index_keys acts on decode steps only, where the verdict has no
    mechanism signal and this untrained model's QAT floor hides its KLD: it moves the
    decode rows but is not named here (docs/v41-architecture.md §8)."""
    from fidelity.ab.design import ABSettings
    from fidelity.ab.run import ReportTarget, RunSite, run_ab
    from fidelity.weights.source import load_weights
    w, label = load_weights("tiny-v41")            # the embedded one: random_weights(CFG, 0)
    s = ABSettings.of(arms=list(FIRST_TAP), lengths=(48, 64), prompts_per_length=2,
                      decode_steps=2, shapley_top=0, n_boot=200, checkpoint=label)
    res = run_ab(w, s, ReportTarget(None), RunSite())
    v = res["verdict"]
    named = {n["toggle"] for n in v["named"]} | {f["toggle"] for f in v["mechanism"]}
    assert named == set(FIRST_TAP) - {"v41_stale_index_keys"}, v["sentence"]
    assert {n["toggle"] for n in v["named"]} >= {"engram_history_microbatch", "v41_fp8_scale_block128"}
    kld = res["kld"]
    stale = kld[kld.arm == "v41_stale_index_keys"]
    assert stale[stale.phase == "prefill"].kld.max() == 0 and stale[stale.phase == "decode"].kld.max() > 0


def test_ab_arms_on_v41_use_v41s_engine_arm():
    """The default design's engine, leave-one-out and single arms on a V4.1 model are V4.1's
    optimizations; V4's design is unchanged."""
    from fidelity.ab.design import ABSettings, arm_sets, base_toggles
    s = ABSettings.of()
    arms, toggles, _ = arm_sets(s, "v41")
    v41 = K.engine(model="v41")
    assert arms["engine"] == v41 and toggles == list(v41.names)
    assert "engine-compressor_norm_fp32" in arms and "kv_fp8_from_fp32" not in arms
    assert base_toggles(s, "v41") == frozenset(v41.names)
    assert arm_sets(s)[0]["engine"] == K.engine()


def test_fidelity_ab_on_v41_names_a_planted_bug_beside_v41s_engine_arm():
    """`fidelity ab` on a tiny V4.1 checkpoint: the report's `engine` arm holds V4.1's
    engine toggles, and a planted V4.1 bug is named (here by mechanism: indexer picks and
    expert sets; its KLD stays within this untrained model's QAT floor)."""
    from fidelity.ab.design import ABSettings
    from fidelity.ab.run import ReportTarget, RunSite, run_ab
    from fidelity.weights.source import load_weights
    w, label = load_weights("tiny-v41")            # the embedded one: random_weights(CFG, 0)
    s = ABSettings.of(arms=["engine", "v41_q_head_norm"], lengths=(48, 64), prompts_per_length=2,
                      decode_steps=1, shapley_top=0, n_boot=200, checkpoint=label)
    res = run_ab(w, s, ReportTarget(None), RunSite())
    assert res["manifest"]["arms"]["engine"] == sorted(K.engine(model="v41").names)
    v = res["verdict"]
    named = {n["toggle"] for n in v["named"]} | {f["toggle"] for f in v["mechanism"]}
    assert "v41_q_head_norm" in named, v["sentence"]
