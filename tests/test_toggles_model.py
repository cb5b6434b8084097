"""Toggles inside the tiny model: isolation (taps bit-identical to golden up to the first
tap after the replaced kernel, different there) and composition of several toggles."""
import copy

import pytest
import torch

import kernel_toggles as K
from reference_model import Model, Numerics, Taps, random_weights, tiny

N_TOKENS = 128          # 32 compressed entries per CSA layer > index_topk 16: the indexer selects

# toggle (as an arm string) -> first tap that must differ. Decode-only toggles are checked
# on a one-token decode step after a prefill that must be identical to golden.
FIRST_TAP = {
    "yarn_on_swa_layers": "layers.0.attn.q",                 # layer 0 is window-only
    "yarn_on_swa_layers(theta=compressed)": "layers.0.attn.q",
    "rope_table_bf16": "layers.0.attn.q",
    "kv_fp8_from_fp32": "layers.0.attn.kv",
    "kv_bf16": "layers.0.attn.kv",
    "kv_nvfp4": "layers.0.attn.kv",
    # (its f16 type holds the reference's bf16 and FP8 values exactly: tests/test_toggles_llamacpp.py)
    "kv_cache_ggml(type=q8_0)": "layers.0.attn.out",         # stored rotated, inside attention
    "kv_cache_ggml(type=q8_0,rotate=false)": "layers.0.attn.kv",
    "compress_state_bf16": "layers.1.attn.compressed_kv",    # layer 1: first compressed layer
    "index_no_hadamard": "layers.1.attn.index.keys",         # the stored keys, before any pick
    "index_hadamard_q_only": "layers.1.attn.index.keys",
    "index_scores_fp32": "layers.1.attn.index.topk",
    "index_keys_fp8": "layers.1.attn.index.keys",
    "index_keys_fp8(scale=pow2)": "layers.1.attn.index.keys",
    "index_keys_bf16": "layers.1.attn.index.keys",
    "hisa(block=4,keep=4)": "layers.1.attn.index.topk",      # 32 entries >= 4 x 4 >= index_topk 16
    "index_topk_override(topk=24)": "layers.1.attn.index.topk",  # 24 of the 32 entries kept, not 16
    "splitk_decode": "layers.0.attn.out",
    "splitk_decode(splits=2,partials=fp32)": "layers.0.attn.out",
    "decode_positions_wrap(at=100)": "layers.0.attn.q",      # the decode step at 128 rotates as at 28
    "wo_a_fp8": "layers.0.attn.out",
    "mhc_tf32": "layers.0.hc_attn.post",
    "mhc_bf16": "layers.0.hc_attn.post",
    "moe_weight_after_w2": "layers.0.ffn.out",
    "expert_act_q8_0": "layers.0.ffn.out",
    "router_softplus_logf": "layers.0.ffn.router.weights",
    "routed_scaling_output_bf16": "layers.0.ffn.router.weights",
    "routed_scaling_double": "layers.0.ffn.out",              # weights untouched, output 1.5x
    "lm_head_bf16": "logits",
}


class _Stop(Exception):
    pass


class TapsUntil(Taps):
    """Capture everything, stop the forward right after `stop` is captured (the rest of
    the forward cannot matter for isolation, and skipping it keeps the test fast)."""

    def __init__(self, stop):
        super().__init__("*")
        self.stop = stop

    def put(self, name, value):
        super().put(name, value)
        if name == self.stop:
            raise _Stop


@pytest.fixture(scope="module")
def setup():
    w = random_weights(tiny(), 0)
    tokens = torch.randint(0, tiny().vocab_size, (N_TOKENS,), generator=torch.Generator().manual_seed(1))
    m = Model(w, Numerics("reference"))
    taps = Taps("*")
    _, st = m.extend(tokens, None, "all", taps)
    dtaps = Taps("*")
    m.extend(torch.tensor([7]), copy.deepcopy(st), "last", dtaps)
    return w, tokens, taps, dtaps


def first_difference(golden: Taps, arm: Taps):
    """(first differing tap in capture order or None, names compared)."""
    names = arm.names()
    assert names == golden.names()[: len(names)], "arm captured taps in a different order"
    for n in names:
        a, g = arm[n], golden[n]
        if a.shape != g.shape or a.dtype != g.dtype or not torch.equal(a, g):
            return n, names
    return None, names


SERVING_SEAM = {"chunk_boundary", "state_restore"}
REQUEST_SEAM = {"chat_request", "chat_render"}      # no tap: chat-check names these (v4_dsml_parser)
SPEC_SEAM = {"spec_verify", "spec_accept", "spec_rollback"}   # speculative decoding only
# the reference feeds these GEMMs bf16 values already: a no-op on the reference profile
# (checked there and on the exact profile in tests/test_toggles_llamacpp.py)
NOOP_ON_REFERENCE = {"bf16_gemm_input"}
# acts only where the k-th indexer score is tied, which random weights never give: hand-built
# ties in tests/test_index_topk_override.py
ACTS_ONLY_ON_TIES = {"index_topk_tie_break"}


def test_every_builtin_toggle_has_an_isolation_case():
    """Serving-state toggles act only under a schedule: tests/test_schedule.py covers them;
    speculative decoding's only when a drafter drafts: tests/test_toggles_speculative.py;
    DeepSeek-V4.1 toggles (documented for V4.1 only) are covered by tests/test_v41_toggles.py."""
    covered = {K.ToggleSet.parse(s).names[0] for s in FIRST_TAP}
    assert covered | NOOP_ON_REFERENCE | ACTS_ONLY_ON_TIES == {t.name for t in K.all_toggles()
                       if t.builtin and t.category not in ("request", "serving")
                       and not any(set(t.kernels) <= seam for seam in (SERVING_SEAM, REQUEST_SEAM, SPEC_SEAM))
                       and "v4" in t.versions}


def test_request_toggles_leave_the_forward_untouched(setup):
    """Request-level toggles act on how a chat becomes a prompt, never on the numerics."""
    w, tokens, gtaps, gdec = setup
    req = [t.name for t in K.all_toggles("request")]
    assert len(req) == 5
    for name in req:
        taps = Taps("*")
        Model(w, K.ToggleSet.parse(name).numerics()).extend(tokens, None, "all", taps)
        assert first_difference(gtaps, taps)[0] is None, name


@pytest.mark.parametrize("arm_text", list(FIRST_TAP))
def test_isolation(setup, arm_text):
    w, tokens, gtaps, gdec = setup
    arm = K.ToggleSet.parse(arm_text)
    (spec,) = arm
    expected = FIRST_TAP[arm_text]
    m = Model(w, arm.numerics())
    if spec.toggle.phase == "decode":
        taps = Taps("*")
        _, st = m.extend(tokens, None, "all", taps)
        assert first_difference(gtaps, taps)[0] is None, "decode-only toggle changed prefill"
        assert taps.names() == gtaps.names()
        dt = TapsUntil(expected)
        with pytest.raises(_Stop):
            m.extend(torch.tensor([7]), st, "last", dt)
        first, names = first_difference(gdec, dt)
    else:
        taps = TapsUntil(expected)
        with pytest.raises(_Stop):
            m.extend(tokens, None, "all", taps)
        first, names = first_difference(gtaps, taps)
    assert names[-1] == expected
    assert first == expected, f"{arm_text}: first differing tap {first}, expected {expected}"


# ---- composition ------------------------------------------------------------------------
def run_all(w, tokens, nx):
    taps = Taps("*")
    Model(w, nx).extend(tokens, None, "all", taps)
    return taps


def test_arm_equals_toggles_applied_together_in_any_order(setup):
    w, tokens, _, _ = setup
    tokens = tokens[:48]
    a = K.ToggleSet.parse("lm_head_bf16,wo_a_fp8(pow2=false),kv_bf16")
    b = K.ToggleSet(["kv_bf16", ("wo_a_fp8", {"pow2": False}), "lm_head_bf16"])
    assert a == b and hash(a) == hash(b) and str(a) == str(b) == "kv_bf16,wo_a_fp8(pow2=false),lm_head_bf16"
    # the same three kernels applied by hand in one with_kernels call
    fns = {}
    for s in a:
        fns.update(s.toggle.build(s.params))
    manual = Numerics("reference").with_kernels("manual", **fns)
    ta, tm, tg = run_all(w, tokens, a.numerics()), run_all(w, tokens, manual), run_all(w, tokens, Numerics())
    assert ta.names() == tm.names()
    for n in ta.names():
        assert torch.equal(ta[n], tm[n]), n
    assert first_difference(tg, ta)[0] == "layers.0.attn.kv"      # earliest of the three
    assert not torch.equal(ta["logits"], tg["logits"])


def test_overlapping_toggles_compose_in_canonical_order():
    """index_no_hadamard and index_keys_fp8 both act on the indexer: whichever order they
    are listed in, the fp8 quantiser sees the unrotated vector."""
    a = K.ToggleSet.parse("index_keys_fp8(scale=pow2),index_no_hadamard")
    b = K.ToggleSet.parse("index_no_hadamard,index_keys_fp8(scale=pow2)")
    assert a == b and str(a) == "index_no_hadamard,index_keys_fp8(scale=pow2)"
    k = torch.zeros(1, 128, dtype=torch.float64)
    k[0, :2] = torch.tensor([1.0, -0.5])
    for nx in (a.numerics(), b.numerics()):
        out = nx.index_key_store(k)
        assert out[0, :2].tolist() == [256.0, -128.0] and out[0, -1].item() == 2.0 ** -8
