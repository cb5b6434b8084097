"""llama-server's flags as numerics (fidelity.llamacpp.flags) and `fidelity engines` plans
of llama.cpp arms: a twin's toggles become -ctk/-ctv and LLAMA_ATTN_ROT_DISABLE, toggles
llama.cpp has no setting for are refused by name, and an arm's own flags give the toggle
attribution credits. Written from llama.cpp b11434's option names (common/arg.cpp), not
from our output; no build needed (plans only)."""
import pytest

from fidelity.engines.launch import plan_arm
from fidelity.engines.spec import SpecError, load_spec
from fidelity.llamacpp import flags as LF
from kernel_toggles import ToggleSet


def test_flags_read_as_the_twins_toggles():
    assert LF.read([]).toggles() == ToggleSet.parse("expert_act_q8_0,router_softplus_logf,bf16_gemm_input,kv_cache_ggml")
    q8 = LF.read(["-ctk", "q8_0", "-ctv", "q8_0", "-ub", "64"])
    assert q8.toggles() == ToggleSet.parse("expert_act_q8_0,router_softplus_logf,bf16_gemm_input,kv_cache_ggml(type=q8_0)")
    assert q8.factors() == {"kv_cache_ggml"} and LF.read(["-np", "4"]).factors() == frozenset()
    assert any(n.startswith("-ub: physical batch") for n in q8.notes)
    flat = LF.read(["--cache-type-k=q8_0"], {"LLAMA_ATTN_ROT_DISABLE": "1"})
    assert flat.toggles()["kv_cache_ggml"].kwargs() == {"type": "q8_0", "rotate": False}


@pytest.mark.parametrize("flags, frag", [
    (["-ctk", "q4_0"], "-ctk q4_0: kv_cache_ggml models f16 and q8_0 only"),
    (["-ctk", "q8_0", "-ctv", "f16"], "give the same type to both"),
    (["-ctk"], "flag -ctk has no value"),
])
def test_flags_no_toggle_models_are_named(flags, frag):
    with pytest.raises(LF.FlagError, match=frag):
        LF.read(flags)


def test_only_numerics():
    assert LF.only_numerics(["-ctk", "q8_0", "--cache-type-v=q8_0"], {"LLAMA_ATTN_ROT_DISABLE": "1"})
    assert not LF.only_numerics(["-ctk", "q8_0", "-ub", "64"])
    assert not LF.only_numerics([], {"OMP_NUM_THREADS": "1"})


SPEC = """
[engines.llama]
kind = "llamacpp"
model = "/models/tiny.gguf"
port = 8080
[engines.ref]
kind = "inprocess"
devices = "cpu"
[[arms]]
name = "golden"
engine = "ref"
[[arms]]
name = "llama"
engine = "llama"
[[arms]]
name = "llama-q8"
engine = "llama"
flags = ["-ctk", "q8_0", "-ctv", "q8_0"]
[[arms]]
name = "llama-q8-ub"
engine = "llama"
flags = ["-ctk", "q8_0", "-ctv", "q8_0", "-ub", "64"]
[[arms]]
name = "twin-q8-norot"
engine = "llama"
toggles = "expert_act_q8_0,router_softplus_logf,bf16_gemm_input,kv_cache_ggml(type=q8_0,rotate=false)"
"""


def _spec(tmp_path, text):
    p = tmp_path / "spec.toml"
    p.write_text(text)
    return load_spec(p)


def test_engines_plans_llamacpp_arms_from_toggles_and_credits_their_flags(tmp_path):
    spec = _spec(tmp_path, SPEC)
    arms = {a.name: a for a in spec.arms}
    assert arms["llama"].factors == {"llama"}                   # llama.cpp as it starts
    assert arms["llama-q8"].factors == {"kv_cache_ggml"}        # the flags' toggle, nothing else
    assert arms["llama-q8-ub"].factors == {"kv_cache_ggml", "llama-q8-ub"}
    e = spec.engines["llama"]
    plan = plan_arm(arms["twin-q8-norot"], e)
    assert plan.cmd[plan.cmd.index("-ctk") + 1] == "q8_0" and plan.cmd[plan.cmd.index("-ctv") + 1] == "q8_0"
    assert plan.env["LLAMA_ATTN_ROT_DISABLE"] == "1"
    assert any("exact profile" in n for n in plan.notes)
    assert "-ctk" not in plan_arm(arms["llama"], e).cmd


@pytest.mark.parametrize("toggles, frag", [
    ("expert_act_q8_0,router_softplus_logf,bf16_gemm_input,kv_bf16", "llama.cpp has no setting for kv_bf16"),
    ("router_softplus_logf,bf16_gemm_input,kv_cache_ggml(type=q8_0)", "always computes expert_act_q8_0 "),
    ("expert_act_q8_0,router_softplus_logf", "always computes bf16_gemm_input "),
])
def test_engines_refuses_what_llamacpp_cannot_be_set_to(tmp_path, toggles, frag):
    spec = _spec(tmp_path, SPEC.split("[[arms]]")[0] + f'[[arms]]\nname = "x"\nengine = "llama"\ntoggles = "{toggles}"\n')
    with pytest.raises(SpecError, match=frag):
        plan_arm(spec.arms[0], spec.engines["llama"])


def test_engines_spec_names_an_unmodelled_cache_type(tmp_path):
    text = SPEC.split("[[arms]]")[0] + '[[arms]]\nname = "x"\nengine = "llama"\nflags = ["-ctk", "q4_0"]\n'
    with pytest.raises(SpecError, match=r"arms\[0\] \(x\): -ctk q4_0"):
        _spec(tmp_path, text)
