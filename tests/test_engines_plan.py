"""`fidelity engines plan` for SGLang 0.5.23 and vLLM 0.33: the research's reference-closest
configuration (engine-divergences.md §7) and each mapped toggle render to the current env
and flag names (engine-integration.md §4.3, written here from the research, not from our
output); toggles without a mapping, unconfirmed mappings and unknown versions are
refused by name; spec mistakes name their key; a transient 5xx on a start-up probe is
retried."""
import pytest

from fidelity.cli import main
from fidelity.engines.launch import plan_arm
from fidelity.engines.spec import SpecError, load_spec

SGLANG = """
[engines.sg]
kind = "sglang"
version = "0.5.23"
model = "/models/DeepSeek-V4-Flash"
port = 30000
flags = ["--tp", "8"]
allow_unconfirmed = true
[engines.vl]
kind = "vllm"
version = "0.33.0"
model = "/models/DeepSeek-V4-Flash"
port = 8000
allow_unconfirmed = true
[[arms]]
name = "sg-closest"
engine = "sg"
toggles = "closest"
[[arms]]
name = "sg-default"
engine = "sg"
[[arms]]
name = "vl-closest"
engine = "vl"
toggles = "closest"
[[designs]]
engine = "sg"
kind = "leave-one-out"
base = "engine:sglang"
toggles = ["kv_fp8_from_fp32", "wo_a_fp8", "mhc_tf32", "lm_head_bf16", "index_keys_fp8"]
"""

# docs/research/engine-divergences.md §7 ("Reference-closest SGLang config") with the names of
# engine-integration.md §4.3 (present in SGL-0.5.23)
SG_CLOSEST_ENV = {"SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE": "1", "SGLANG_OPT_FP8_WO_A_GEMM": "0",
                  "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0", "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0"}
SG_CLOSEST_FLAGS = ["--enable-fp32-lm-head", "--enable-deepseek-v4-fp4-indexer"]


def _plans(tmp_path, text=SGLANG, captures=True, max_logprobs=20):
    p = tmp_path / "s.toml"
    p.write_text(text)
    spec = load_spec(p)
    return {a.name: plan_arm(a, spec.engines[a.engine], captures, max_logprobs) for a in spec.arms}


def test_sglang_reference_closest_uses_the_research_names(tmp_path):
    p = _plans(tmp_path)["sg-closest"]
    assert p.cmd[:4] == ["python3", "-m", "sglang.launch_server", "--model-path"]
    assert p.env == SG_CLOSEST_ENV
    assert all(f in p.cmd for f in SG_CLOSEST_FLAGS) and p.cmd[p.cmd.index("--tp") + 1] == "8"
    assert "--enable-return-indexer-topk" in p.cmd and "--enable-return-routed-experts" in p.cmd
    assert any("unconfirmed mapping applied: index_keys_fp8" in n for n in p.notes)
    d = _plans(tmp_path)["sg-default"]                     # as started: only the base flags
    assert d.env == {} and not any(f in d.cmd for f in SG_CLOSEST_FLAGS)


def test_sglang_leave_one_out_each_toggle_maps_to_one_setting(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(SGLANG)
    spec = load_spec(p)
    design = [a for a in spec.arms if a.name.startswith("sg:")]
    plans = {a.name: plan_arm(a, spec.engines["sg"], False, None) for a in design}
    base = design[0]                                       # engine:sglang, the engine's default
    assert plans[base.name].env == {} and not any(f in plans[base.name].cmd for f in SG_CLOSEST_FLAGS)
    want = {"kv_fp8_from_fp32": ({"SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE": "1"}, []),
            "wo_a_fp8": ({"SGLANG_OPT_FP8_WO_A_GEMM": "0"}, []),
            "mhc_tf32": ({"SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0", "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0"}, []),
            "lm_head_bf16": ({}, ["--enable-fp32-lm-head"]),
            "index_keys_fp8": ({}, ["--enable-deepseek-v4-fp4-indexer"])}
    for t, (env, flags) in want.items():
        (arm,) = [a for a in design[1:] if t not in a.toggles]
        pl = plans[arm.name]
        assert pl.env == env, (t, pl.env)
        assert [f for f in pl.cmd if f.startswith("--enable-")] == flags, t
    # dropping index_keys_fp8 brings back what it covered and SGLang cannot turn off
    (a,) = [a for a in design[1:] if "index_keys_fp8" not in a.toggles]
    assert "index_scores_fp32" in a.toggles


def test_vllm_033_names(tmp_path):
    p = _plans(tmp_path)["vl-closest"]
    assert p.cmd[:5] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/models/DeepSeek-V4-Flash"]
    i = p.cmd.index("--attention-config")
    assert p.cmd[i + 1] == '{"indexer_kv_dtype": "mxfp4"}'         # 0.33: use_fp4_indexer_cache is gone
    assert "use_fp4_indexer_cache" not in " ".join(p.cmd)
    assert p.cmd[p.cmd.index("--max-logprobs") + 1] == "20"
    assert p.cmd[p.cmd.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert any("unknown" in n and "splitk_decode" in n for n in p.notes)


@pytest.mark.parametrize("arm,engine_extra,frag", [
    ('toggles = "golden"', "", "splitk_decode: no known sglang setting turns it off"),
    ('toggles = "closest"', "allow_unconfirmed = false", "UNCONFIRMED"),
    ('toggles = "kv_bf16"', 'version = "0.6.0"', "sglang 0.6.0: engine_profiles.json has mappings for 0.5.23"),
])
def test_refusals_name_the_toggle(tmp_path, arm, engine_extra, frag):
    text = f"""
[engines.sg]
kind = "sglang"
version = "0.5.23"
model = "m"
allow_unconfirmed = true
{engine_extra.replace('version = "0.6.0"', '')}
[[arms]]
name = "a"
engine = "sg"
{arm}
"""
    if "0.6.0" in engine_extra:
        text = text.replace('version = "0.5.23"', 'version = "0.6.0"')
    if "allow_unconfirmed = false" in engine_extra:
        text = text.replace("allow_unconfirmed = true\n", "")
    with pytest.raises(SpecError, match=frag):
        _plans(tmp_path, text)


@pytest.mark.parametrize("text,frag", [
    ("[engines.x]\nkind = 'tgi'\n", "engines.x.kind must be one of"),
    ("[engines.x]\nkind = 'sglang'\nmodel = 'm'\n", "needs model and version"),
    ("[engines.x]\nkind = 'fidelity'\nprt = 1\n", "engines.x: unknown key 'prt'"),
    ("[engines.x]\nkind = 'fidelity'\n[[arms]]\nname = 'a'\nengine = 'y'\n", "engine 'y' is not one of"),
    ("[engines.x]\nkind = 'fidelity'\n[[arms]]\nname = 'a'\nengine = 'x'\ntoggles = 'nope'\n", r"arms\[0\]\.toggles: unknown toggle 'nope'"),
    ("[engines.x]\nkind = 'fidelity'\n[[arms]]\nname = 'a'\nengine = 'x'\n[[arms]]\nname = 'a'\nengine = 'x'\n",
     "arm names repeat: a"),
    ("[run]\ntasks = ['kld', 'mmlu']\n[engines.x]\nkind = 'fidelity'\n[[arms]]\nname = 'a'\nengine = 'x'\n",
     "unknown task 'mmlu'"),
    ("[engines.x\n", "not valid TOML"),
])
def test_spec_errors_name_the_key(tmp_path, text, frag):
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(SpecError, match=frag):
        load_spec(p)


def test_plan_command_prints_and_writes_script(tmp_path, capsys):
    p = tmp_path / "s.toml"
    p.write_text(f'[run]\nout = "{tmp_path}"\n' + SGLANG)
    assert main(["engines", "plan", str(p)]) == 0
    out = capsys.readouterr().out
    assert "SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE=1" in out and "--enable-fp32-lm-head" in out
    script = (tmp_path / "engines" / "s" / "launch.sh").read_text()
    assert script.startswith("#!/usr/bin/env bash") and script.count("sglang.launch_server") == 8
    assert main(["engines", "plan", str(tmp_path / "none.toml")]) == 2


def test_out_option_overrides_the_specs_out(tmp_path, capsys, monkeypatch):
    p = tmp_path / "s.toml"
    p.write_text(f'[run]\nout = "{tmp_path / "from-spec"}"\n' + SGLANG)
    assert main(["engines", "plan", str(p), "--out", str(tmp_path / "from-cli")]) == 0
    assert (tmp_path / "from-cli" / "engines" / "s" / "launch.sh").exists()
    assert not (tmp_path / "from-spec").exists()
    p.write_text(SGLANG)                                   # no [run] out: reports/ in the cwd
    monkeypatch.chdir(tmp_path)
    assert main(["engines", "plan", str(p)]) == 0
    assert (tmp_path / "reports" / "engines" / "s" / "launch.sh").exists()


def test_transient_5xx_on_models_is_retried():
    from infra.http import RetryPolicy
    from needle.stub import StubServer
    from fidelity.kld.endpoint import Endpoint
    s = StubServer(models_faults=["500", "502"]).start()
    try:
        ep = Endpoint("stub", f"http://127.0.0.1:{s.port}/v1", policy=RetryPolicy(retries=3, backoff=0.01)).connect()
        assert ep.model and s.models_requests == 3
    finally:
        s.stop()
