"""Registry, arm syntax (parse/print round trip, env var, errors), designs, custom toggles,
engine profiles and the `fidelity toggles` command."""
import json
from pathlib import Path

import pytest
import torch

import kernel_toggles as K
from kernel_toggles import profiles
from kernel_toggles.registry import Param, Provenance, ToggleError
from reference_model import KERNELS, Numerics

REQUIRED = {"index_keys_fp8", "index_no_hadamard", "index_keys_bf16", "index_scores_fp32",
            "splitk_decode", "mhc_bf16", "mhc_tf32", "routed_scaling_output_bf16",
            "kv_fp8_from_fp32", "kv_bf16", "wo_a_fp8", "lm_head_bf16", "compress_state_bf16",
            "routed_scaling_double", "yarn_on_swa_layers"}
RESEARCH = Path(__file__).resolve().parents[1] / "docs" / "research" / "engine-divergences.md"


# ---- registry ---------------------------------------------------------------------------
def test_required_toggles_and_fields():
    names = set(K.names())
    assert REQUIRED <= names
    bugs = {t.name for t in K.all_toggles("known-bug")}
    assert {"routed_scaling_double", "yarn_on_swa_layers"} <= bugs and len(bugs) >= 3
    for t in K.all_toggles():
        assert t.category in K.CATEGORIES
        assert t.kernels and all(k in KERNELS for k in t.kernels)
        assert len(t.description) > 80 and "\n\n" not in t.description
        assert t.provenance.engines and (t.provenance.settings or t.provenance.refs)
        for p in t.params:
            assert isinstance(p.default, p.type)


def test_decode_only_flag():
    decode_only = {"splitk_decode", "decode_splitk_by_batch", "decode_positions_wrap"}
    assert all(K.get(n).phase == "decode" for n in decode_only)
    assert all(t.phase == "all" for t in K.all_toggles() if t.name not in decode_only)


# ---- arm syntax -------------------------------------------------------------------------
def all_nondefault_arms():
    out = []
    for t in K.all_toggles():
        out.append(t.name)
        for p in t.params:
            if p.type is bool:
                v = not p.default
            elif p.choices:
                v = [c for c in p.choices if c != p.default][0]
            else:
                v = p.default + 3
            out.append(f"{t.name}({p.name}={p.format(v)})")
    return out


@pytest.mark.parametrize("text", all_nondefault_arms())
def test_round_trip_single(text):
    a = K.ToggleSet.parse(text)
    assert str(a) == text
    assert K.ToggleSet.parse(str(a)) == a


def test_round_trip_multi_and_canonical_order():
    a = K.ToggleSet.parse(" splitk_decode( splits = 8 ), lm_head_bf16,index_keys_fp8 ")
    assert str(a) == "index_keys_fp8,splitk_decode(splits=8),lm_head_bf16"
    assert K.ToggleSet.parse(str(a)) == a
    assert K.ToggleSet.parse("splitk_decode(8)") == K.ToggleSet.parse("splitk_decode(splits=8)")
    # defaults are not printed, and an explicit default is the same arm
    assert K.ToggleSet.parse("splitk_decode(splits=4)") == K.ToggleSet.parse("splitk_decode")
    assert str(K.ToggleSet.parse("splitk_decode(splits=4)")) == "splitk_decode"
    e = K.engine()
    assert K.ToggleSet.parse(str(e)) == e
    assert K.ToggleSet("lm_head_bf16,kv_bf16") == K.ToggleSet(["kv_bf16", "lm_head_bf16"])


def test_golden_and_aliases():
    for s in ("", "golden", "  "):
        assert K.ToggleSet.parse(s) == K.golden() and K.ToggleSet.parse(s).is_golden
    assert str(K.golden()) == "golden"
    assert K.ToggleSet.parse("engine") == K.engine()
    assert K.ToggleSet.parse("engine:sglang") == K.engine("sglang")


def test_immutable_hashable():
    a = K.ToggleSet.parse("kv_bf16,wo_a_fp8")
    with pytest.raises(AttributeError):
        a.x = 1
    d = {a: 1}
    assert d[K.ToggleSet.parse("wo_a_fp8,kv_bf16")] == 1
    assert "kv_bf16" in a and "lm_head_bf16" not in a
    assert a.without("kv_bf16") == K.ToggleSet.parse("wo_a_fp8")
    assert a.with_("lm_head_bf16") == K.ToggleSet.parse("kv_bf16,wo_a_fp8,lm_head_bf16")
    assert (a | K.ToggleSet.parse("lm_head_bf16")) == a.with_("lm_head_bf16")


def test_from_env():
    assert K.ToggleSet.from_env({}) == K.golden()
    env = {K.ENV_VAR: "index_keys_fp8,splitk_decode(splits=4)"}
    assert str(K.ToggleSet.from_env(env)) == "index_keys_fp8,splitk_decode"
    assert K.ENV_VAR == "DSV4_FIDELITY_ARM"
    with pytest.raises(ToggleError, match="DSV4_FIDELITY_ARM"):
        K.ToggleSet.from_env({K.ENV_VAR: "nope"})


@pytest.mark.parametrize("text, must_contain", [
    ("nope", "valid: yarn_on_swa_layers"),
    ("kv_bf16,nope", "index_keys_fp8"),
    ("splitk_decode(splits=0)", "minimum"),
    ("splitk_decode(splits=two)", "not an int"),
    ("splitk_decode(blocks=2)", "valid: splits: int = 4"),
    ("splitk_decode(partials=fp16)", "bf16, fp32"),
    ("wo_a_fp8(pow2=maybe)", "boolean"),
    ("splitk_decode(2,bf16,3)", "takes 2 parameter"),
    ("splitk_decode(splits=2,splits=3)", "twice"),
    ("splitk_decode(splits=2", "unbalanced"),
    ("kv_bf16,,wo_a_fp8", "empty"),
    ("kv_bf16,kv_fp8_from_fp32", "pick one"),
    ("splitk_decode,splitk_decode(splits=2)", "different parameters"),
    ("9lives", "valid names"),
])
def test_errors_name_the_valid_choices(text, must_contain):
    with pytest.raises(ToggleError) as e:
        K.ToggleSet.parse(text)
    assert must_contain in str(e.value)
    if "nope" in text:
        for n in K.names():
            assert n in str(e.value)


def test_numerics_records_replacements():
    nx = K.ToggleSet.parse("splitk_decode(splits=8),kv_bf16").numerics()
    assert nx.replaced == {"sparse_attention": "splitk_decode(splits=8)", "kv_store": "kv_bf16"}
    assert K.golden().numerics().replaced == {}
    assert K.ToggleSet.parse("kv_bf16").numerics("exact").profile == "exact"


# ---- designs ----------------------------------------------------------------------------
def test_engine_all_optimizations():
    """V4's engine arm: every optimization documented for V4 (V4.1's: test_v41_toggles_kernels)."""
    e = K.engine()
    assert all(s.toggle.category == "optimization" for s in e)
    opts = [t for t in K.all_toggles("optimization") if "v4" in t.versions and t.engine_arm]
    assert {"kv_cache_ggml", "expert_act_q8_0", "bf16_gemm_input"}.isdisjoint(e.names)   # llama.cpp's own
    opt_groups = {t.group for t in opts if t.group}
    subsumed = {n for t in opts for n in t.subsumes}
    ungrouped = {t.name for t in opts if not t.group} - subsumed
    assert ungrouped <= set(e.names)
    assert len(e) == len(ungrouped) + len(opt_groups)
    assert "index_keys_fp8" in e and "mhc_tf32" in e and "kv_fp8_from_fp32" in e


def test_engine_profiles_arms():
    s, v = K.engine("sglang"), K.engine("vllm")
    assert {"kv_fp8_from_fp32", "index_keys_fp8", "wo_a_fp8", "mhc_tf32",
            "routed_scaling_output_bf16", "lm_head_bf16"} <= set(s.names)
    assert s["index_keys_fp8"].kwargs() == {"scale": "fp32"}
    assert {"index_no_hadamard", "index_keys_fp8"} <= set(v.names)
    assert v["index_keys_fp8"].kwargs() == {"scale": "pow2"}
    assert "kv_fp8_from_fp32" not in v
    with pytest.raises(ToggleError, match="sglang, vllm"):
        K.engine("trtllm")


def test_one_at_a_time_and_leave_one_out():
    base = K.ToggleSet.parse("kv_bf16,wo_a_fp8,lm_head_bf16")
    oat = K.one_at_a_time(base)
    assert [str(a) for a in oat] == ["kv_bf16", "wo_a_fp8", "lm_head_bf16"]
    loo = K.leave_one_out(base)
    assert [str(a) for a in loo] == ["wo_a_fp8,lm_head_bf16", "kv_bf16,lm_head_bf16",
                                     "kv_bf16,wo_a_fp8"]
    assert len(K.one_at_a_time()) == len(K.engine())
    assert all(len(a) == len(K.engine()) - 1 for a in K.leave_one_out())


def test_factorial():
    arms = K.factorial(["lm_head_bf16", "kv_bf16", "splitk_decode(splits=2)"])
    assert len(arms) == 8 and len(set(arms)) == 8
    assert arms[0] == K.golden() and str(arms[-1]) == "kv_bf16,splitk_decode(splits=2),lm_head_bf16"
    assert [len(a) for a in arms] == [0, 1, 1, 1, 2, 2, 2, 3]
    with pytest.raises(ToggleError, match="pick one"):
        K.factorial(["kv_bf16", "kv_fp8_from_fp32"])
    with pytest.raises(ToggleError, match="max_toggles"):
        K.factorial(list(K.engine()), max_toggles=3)


# ---- custom toggles ---------------------------------------------------------------------
@pytest.fixture
def custom():
    made = []

    def reg(name, **kw):
        made.append(name)
        return K.toggle(name, **kw)
    yield reg
    for n in made:
        if n in K.names() and not K.get(n).builtin:
            K.unregister(n)


def test_custom_single_kernel_toggle(custom):
    @custom("my_hot_attention", kernel="sparse_attention", category="optimization",
            params=(Param("temp", float, 1.0, "softmax temperature", min=0.1),),
            provenance=Provenance(("my-kernel",), refs=("PR #1",)))
    def hot(golden, q, kv, sink, idx, scale, phase="prefill", *, temp):
        """Sparse attention with the softmax scale divided by a temperature (test kernel)."""
        return golden.sparse_attention(q, kv, sink, idx, scale / temp, phase)

    arm = K.ToggleSet.parse("kv_bf16,my_hot_attention(temp=2)")
    assert str(arm) == "kv_bf16,my_hot_attention(temp=2.0)"
    assert K.ToggleSet.parse(str(arm)) == arm
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 2, 8, generator=g).double(), torch.randn(5, 8, generator=g).double()
    sink, idx = torch.zeros(2).double(), torch.tensor([[0, 1, 2, -1], [4, 3, 2, 1]])
    gold = Numerics()
    assert torch.equal(arm.numerics().sparse_attention(q, kv, sink, idx, 0.5),
                       gold.sparse_attention(q, kv, sink, idx, 0.25))
    assert "my_hot_attention" in K.render_text() and K.get("my_hot_attention").category == "optimization"
    assert "my_hot_attention" in K.names()[-1]
    with pytest.raises(ToggleError, match="minimum"):
        K.ToggleSet.parse("my_hot_attention(temp=0)")


def test_custom_factory_toggle_and_registration_errors(custom):
    @custom("my_fp32_head_and_kv", kernels=("lm_head", "kv_store"), params={"shift": 0.0},
            category="known-bug",
            description="Test toggle: two kernels from one factory.")
    def factory(shift):
        return {"lm_head": lambda g, x, w: g.lm_head(x, w) + shift,
                "kv_store": lambda g, nope: g.kv_store(nope)}

    nx = K.ToggleSet.parse("my_fp32_head_and_kv(shift=1.5)").numerics()
    x, w = torch.ones(1, 4).double(), torch.ones(2, 4).double()
    assert nx.lm_head(x, w).tolist() == [[5.5, 5.5]]
    with pytest.raises(ToggleError, match="already registered"):
        custom("my_fp32_head_and_kv", kernel="lm_head", category="known-bug",
               description="x")(lambda g, x, w: x)
    with pytest.raises(ToggleError, match="valid: fp8_linear"):
        custom("my_bad", kernel="not_a_kernel", category="known-bug", description="x")
    with pytest.raises(ToggleError, match="give category= explicitly"):
        custom("my_bad3", kernel="lm_head", description="x")
    with pytest.raises(ToggleError, match="clashes with the built-in"):
        custom("kv_bf16", kernel="kv_store", category="optimization", description="x")(lambda g, n: n)
    with pytest.raises(ToggleError, match="category"):
        custom("my_bad2", kernel="lm_head", category="speedup", description="x")
    with pytest.raises(ToggleError, match="built in"):
        K.unregister("kv_bf16")


# ---- engine profiles --------------------------------------------------------------------
def test_profile_file_is_complete_and_valid():
    data = json.loads(profiles.PATH.read_text())
    assert profiles.validate(data) == []
    for t in K.all_toggles():
        if t.builtin:
            for eng in profiles.ENGINES:
                e = profiles.entry(t.name, eng)
                assert e["default"] in (True, False, None)


def test_profile_marks_research_unconfirmed_items():
    """Mappings the research flags UNCONFIRMED (§2.5 split-K partial dtype, §2.1 SGLang
    FP8 K scale, §2.8 vLLM lm_head, §2.7 routed-weight placement) are marked so."""
    for name, eng in [("splitk_decode", "sglang"), ("splitk_decode", "vllm"),
                      ("index_keys_fp8", "sglang"), ("lm_head_bf16", "vllm"),
                      ("moe_weight_after_w2", "sglang"), ("moe_weight_after_w2", "vllm"),
                      ("mhc_tf32", "sglang")]:
        assert profiles.entry(name, eng)["unconfirmed"] is True, (name, eng)
    assert profiles.entry("kv_fp8_from_fp32", "sglang")["unconfirmed"] is False


@pytest.mark.skipif(not RESEARCH.exists(), reason="research notes not present")
def test_profile_settings_exist_in_the_research():
    text = RESEARCH.read_text()
    for name, per in profiles.load()["toggles"].items():
        for eng, e in per.items():
            for side in ("on", "off"):
                for var in (e[side] or {}).get("env", {}):
                    assert var in text, (name, eng, var)
                for flag in (e[side] or {}).get("flags", []):
                    if flag.startswith("--"):
                        assert flag in text, (name, eng, flag)


def test_launch_settings():
    ls = profiles.launch_settings(K.golden(), "sglang")
    assert ls.env["SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE"] == "1"
    assert ls.env["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
    assert "--enable-fp32-lm-head" in ls.flags
    assert ("splitk_decode", "no known sglang setting turns it off") in ls.unrealisable
    ls2 = profiles.launch_settings(K.engine("sglang"), "sglang")
    assert ls2.env == {} and ls2.flags == [] and ls2.unrealisable == []


# ---- CLI --------------------------------------------------------------------------------
def run_cli(argv, capsys):
    from fidelity.cli import main
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_table(capsys):
    rc, out, _ = run_cli(["toggles"], capsys)
    assert rc == 0
    head = out.splitlines()[0].split()
    assert head == ["name", "category", "kernel", "provenance", "parameters"]
    for n in K.names():
        assert n in out
    rc, out, _ = run_cli(["toggles", "--markdown"], capsys)
    lines = out.strip().splitlines()
    assert lines[0].startswith("| Toggle |") and len(lines) == 2 + len(K.names())
    assert out == K.render_markdown()


def test_cli_arm_and_errors(capsys):
    rc, out, _ = run_cli(["toggles", "--arm", "splitk_decode(splits=8),index_keys_fp8"], capsys)
    assert rc == 0 and out.splitlines()[0] == "index_keys_fp8,splitk_decode(splits=8)"
    rc, out, err = run_cli(["toggles", "--arm", "nope"], capsys)
    assert rc == 2 and "valid:" in err and "kv_bf16" in err
    rc, out, _ = run_cli(["toggles", "--describe", "kv_fp8_from_fp32", "--engine", "sglang"], capsys)
    assert rc == 0 and "SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE" in out
    rc, out, _ = run_cli(["toggles", "--engine", "vllm"], capsys)
    assert rc == 0 and "fp8_ds_mla" in out
