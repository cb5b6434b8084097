"""`fidelity chat-check` against real `fidelity serve` processes: with no request toggle
every case renders as DeepSeek's encoder; each request toggle alone is flagged on exactly
the cases it changes (the expected set derived here from docs/research/engine-integration.md
§3.3's rules, not from our renderer); an engine profile turns SGLang's documented reading
into 'documented'; bad input: no tokenize route (counts, weaker), a tokenizer mismatch
(stops), a server that errors on tools (reported per case, the run goes on). DeepSeek-V4.1
(`--chat-version v41`, issue 25): a V4.1 server renders every case like the V4.1 reference
and its tool call is read; the same server reading V4.1 output with V4's DSML parser
(`v4_dsml_parser`) is named on the tool case; V4 and V4.1 servers checked as each other
differ, tools named by their DSML tags."""
import json

import pandas as pd
import pytest

from fidelity.chat_check.cases import all_cases
from fidelity.cli import main

from needle_util import served
from test_chat_encoding_v41 import SCRIPT_PLUGIN

CASES = {c.id: c for c in all_cases()}


def _run(tmp_path, url, run_id, *extra):
    rc = main(["chat-check", "--endpoint", url, "--out", str(tmp_path), "--run-id", run_id, "--quiet", *extra])
    rep = tmp_path / "chat-check" / run_id
    return rc, (pd.read_csv(rep / "cases.csv") if (rep / "cases.csv").exists() else None), rep


def _thinking(c) -> bool:
    """§3.3: thinking omitted -> on; effort none turns it off unless thinking is enabled."""
    if c.thinking is not None:
        return c.thinking
    return c.effort != "none"


def _preamble(c) -> bool:
    """§3.3: with thinking on, absent/medium/high/xhigh/max (and none with thinking enabled)
    render a preamble; minimal/low do not."""
    return _thinking(c) and c.effort not in ("low", "minimal")


EXPECTED = {
    "thinking_default_off": lambda c: c.thinking is None and c.effort != "none",
    "effort_medium_dropped": lambda c: c.effort == "medium" and c.thinking is not False,
    # V3.2's template: other tool format, no preamble, thinking only when asked for
    "chat_template_v32": lambda c: bool(c.tools) or _preamble(c) or (c.thinking is None and _thinking(c)),
}


@pytest.fixture(scope="module")
def servers():
    names = ["golden", *EXPECTED, "chat_sglang_0523", "chat_vllm_033"]
    with served(*names) as urls:
        yield dict(zip(names, urls))


def test_golden_server_renders_every_case_like_the_reference(tmp_path, servers):
    rc, df, rep = _run(tmp_path, servers["golden"], "golden")
    assert rc == 0 and len(df) == len(CASES) == 93
    assert set(df.status) == {"identical"}
    checked = df.behaviour.dropna()
    assert len(checked) >= 9 and (checked == "ok").all()
    m = json.loads((rep / "manifest.json").read_text())
    assert m["meta"]["method"] == "sglang-tokenize" and not m["failed"]
    assert (m["meta"]["chat_version"], m["meta"]["chat_version_from"]) == ("v4", "architecture DeepseekV4ForCausalLM")


@pytest.mark.parametrize("toggle", list(EXPECTED))
def test_each_request_toggle_is_flagged_on_exactly_its_cases(tmp_path, servers, toggle):
    rc, df, _ = _run(tmp_path, servers[toggle], toggle, "--no-behaviour")
    flagged = set(df[df.status == "differs"].case)
    want = {cid for cid, c in CASES.items() if EXPECTED[toggle](c)}
    assert rc == 1 and flagged == want and set(df.status) == {"identical", "differs"}
    row = df[df.case == "nosys-notools-think=on-effort=medium"].iloc[0]
    if toggle == "effort_medium_dropped":
        assert row.became.endswith("-> no thinking") and "medium" in row.became
    if toggle == "chat_template_v32":
        assert "not in DeepSeek-V4's DSML" in df[df.case == "tool-round-trip-think=on"].iloc[0].detail


def _sglang_thinks(c) -> bool:
    """§3.3, SGLang 0.5.23: thinking only from chat_template_kwargs.thinking, else off."""
    return bool(c.thinking)


def test_engine_profile_marks_documented_behaviour(tmp_path, servers):
    rc, df, _ = _run(tmp_path, servers["chat_sglang_0523"], "sg", "--no-behaviour")
    assert rc == 1 and (df.status == "differs").sum() > 0
    rc, df, rep = _run(tmp_path, servers["chat_sglang_0523"], "sg-doc", "--engine-profile", "sglang")
    assert rc == 0 and set(df.status) == {"identical", "documented"}
    # behaviour judged against the documented reading: thinking absent -> SGLang does not
    # think, so no reasoning_content is right there (the reference would want it)
    checked = df[df.behaviour.notna()]
    assert (checked.behaviour == "ok").all()
    absent = checked[checked.thinking_sent.isna()]
    assert len(absent) >= 3 and (absent.status == "documented").all()
    assert all(not _sglang_thinks(CASES[c]) and _thinking(CASES[c]) for c in absent.case)
    assert "No undocumented difference" in (rep / "summary.md").read_text()


def test_vllm_reading_passes_its_own_profile_and_fails_sglangs(tmp_path, servers):
    rc, df, _ = _run(tmp_path, servers["chat_vllm_033"], "vl-doc", "--engine-profile", "vllm")
    assert rc == 0 and set(df.status) == {"identical", "documented"}
    assert (df.behaviour.dropna() == "ok").all()
    rc, df, rep = _run(tmp_path, servers["chat_vllm_033"], "vl-sg", "--no-behaviour", "--engine-profile", "sglang")
    n = int((df.status == "differs").sum())
    assert rc == 1 and n > 0 and f"{n} case(s) differ" in (rep / "summary.md").read_text()


def test_engine_profile_still_fails_an_undocumented_rendering(tmp_path, servers):
    rc, df, rep = _run(tmp_path, servers["chat_template_v32"], "v32-doc", "--no-behaviour",
                       "--engine-profile", "sglang")
    want = sum(1 for c in CASES.values() if EXPECTED["chat_template_v32"](c))
    assert rc == 1 and 0 < (df.status == "differs").sum() <= want
    assert f"{(df.status == 'differs').sum()} case(s) differ" in (rep / "summary.md").read_text()


def test_engine_profile_still_fails_behaviour_against_the_documented_reading(tmp_path):
    """A server whose prompts are exactly SGLang's documented ones but whose responses
    say the opposite about thinking (reasoning split on when its own prompt closed the
    think block): every behaviour-checked case fails, documented or not."""
    plugin = tmp_path / "flip.py"
    plugin.write_text(
        "from dataclasses import replace\n"
        "from kernel_toggles import toggle\n"
        "@toggle('reasoning_flipped', kernel='chat_render', category='request', wraps=True,\n"
        "        description='Responses split reasoning as if thinking were the opposite.')\n"
        "def _flip(golden, req, generation='0731', add_generation_prompt=True):\n"
        "    r = golden.chat_render(req, generation, add_generation_prompt)\n"
        "    return replace(r, thinking=not r.thinking)\n")
    with served("chat_sglang_0523,reasoning_flipped", extra=("--plugin", str(plugin))) as (u,):
        rc, df, rep = _run(tmp_path, u, "flip", "--engine-profile", "sglang")
    assert set(df.status) == {"identical", "documented"}
    checked = df[df.behaviour.notna()]
    assert rc == 1 and len(checked) >= 9 and (checked.behaviour != "ok").all()
    doc = checked[checked.status == "documented"]
    assert len(doc) >= 3 and doc.behaviour.str.contains(r"thinking should be off \(the documented reading\)").all()
    text = (rep / "summary.md").read_text()
    assert f"{len(checked)} case(s) whose response does not behave" in text and "differ from" not in text


def test_no_tokenize_route_falls_back_to_counts(tmp_path, capsys):
    from needle.stub import StubServer
    from reference_model.tokenizer import load_tokenizer
    s = StubServer(tokenize=False, tokenizer=load_tokenizer()).start()      # counts only
    try:
        rc, df, rep = _run(tmp_path, f"http://127.0.0.1:{s.port}/v1", "stub", "--no-behaviour")
    finally:
        s.stop()
    out = capsys.readouterr().out
    assert "counts only (a weaker check)" in out
    m = json.loads((rep / "manifest.json").read_text())
    assert m["meta"]["method"] == "usage-count" and m["meta"]["weak"] and "weaker check" in m["verdict"]
    assert set(df.status) <= {"same-count", "differs"} and (df.status == "same-count").any()


def test_tokenizer_mismatch_stops(tmp_path, capsys):
    from reference_model.tokenizer import build_tokenizer_json
    other = tmp_path / "other.json"
    other.write_text(build_tokenizer_json("the river runs under the old stone bridge " * 40, 300))
    with served("golden", extra=("--tokenizer", str(other))) as (u,):
        rc, df, _ = _run(tmp_path, u, "mismatch")
    assert rc == 2 and df is None
    assert "pass the served model's --tokenizer" in capsys.readouterr().err


def test_server_erroring_on_tools_is_reported_per_case(tmp_path):
    plugin = tmp_path / "no_tools.py"
    plugin.write_text(
        "from kernel_toggles import toggle\n"
        "@toggle('tools_refused', kernel='chat_request', category='request', wraps=True,\n"
        "        description='A deployment whose chat route refuses tools.')\n"
        "def _refuse(golden, body):\n"
        "    if body.get('tools'):\n"
        "        raise ValueError('tools are not supported by this deployment')\n"
        "    return golden.chat_request(body)\n")
    with served("tools_refused", extra=("--plugin", str(plugin))) as (u,):
        rc, df, _ = _run(tmp_path, u, "tools", "--no-behaviour")
    err = df[df.status == "error"]
    assert rc == 1 and set(err.case) == {cid for cid, c in CASES.items() if c.tools}
    assert err.detail.str.contains("tools are not supported").all()
    assert (df.status == "identical").sum() == len(CASES) - len(err)


# ---- DeepSeek-V4.1 -----------------------------------------------------------------------------
TOOL_PROBE = "nosys-tools-think=off-effort=absent"          # the tool case asked to answer at length


@pytest.fixture(scope="module")
def v41_servers(tmp_path_factory):
    """One V4.1 server, two models: the golden rendering with a model that always answers
    with a V4.1 DSML tool call (a test plugin), and the same with V4's DSML parser."""
    plug = tmp_path_factory.mktemp("plugin") / "dsml_script.py"
    plug.write_text(SCRIPT_PLUGIN)
    with served("golden", extra=("--plugin", str(plug), "--chat-version", "v41", "--no-prefix-cache",
                                 "--arm", "golden=dsml_script", "--arm", "buggy=dsml_script,v4_dsml_parser")) as (u,):
        yield u


def test_v41_server_renders_every_case_like_the_v41_reference(tmp_path, v41_servers):
    rc, df, rep = _run(tmp_path, v41_servers, "v41", "--chat-version", "v41", "--model", "golden")
    assert rc == 0 and set(df.status) == {"identical"} and len(df) == len(CASES)
    checked = df.behaviour.dropna()
    assert len(checked) >= 9 and (checked == "ok").all() and TOOL_PROBE in set(df[df.behaviour.notna()].case)
    assert df[df.case == "nosys-notools-think=on-effort=max"].iloc[0].reference_state == "thinking, effort 100 preamble"
    m = json.loads((rep / "manifest.json").read_text())
    assert m["meta"]["chat_version"] == "v41" and "DeepSeek-V4.1 encoding" in (rep / "summary.md").read_text()


def test_v4_dsml_parser_on_v41_output_is_named(tmp_path, v41_servers):
    rc, df, rep = _run(tmp_path, v41_servers, "v41-bug", "--chat-version", "v41", "--model", "buggy")
    assert rc == 1 and set(df.status) == {"identical"}              # the prompts are right
    bad = df[df.behaviour.notna() & (df.behaviour != "ok")]
    assert list(bad.case) == [TOOL_PROBE]
    assert "v4_dsml_parser" in bad.iloc[0].behaviour and "no tool_calls" in bad.iloc[0].behaviour
    assert "1 case(s) whose response does not behave" in (rep / "summary.md").read_text()


def test_v4_and_v41_servers_checked_as_each_other_differ(tmp_path, servers, v41_servers):
    rc, df, _ = _run(tmp_path, servers["golden"], "v4-as-v41", "--chat-version", "v41", "--no-behaviour")
    trip = df[df.case == "tool-round-trip-think=on"].iloc[0]
    assert rc == 1 and (df.status == "differs").sum() > 0
    assert "tools are in DeepSeek-V4's DSML tags, not DeepSeek-V4.1's" in trip.detail
    rc, df, _ = _run(tmp_path, v41_servers, "v41-as-v4", "--chat-version", "v4", "--model", "golden", "--no-behaviour")
    trip = df[df.case == "tool-round-trip-think=on"].iloc[0]
    assert rc == 1 and "tools are in DeepSeek-V4.1's DSML tags, not DeepSeek-V4's" in trip.detail


def test_v41_refuses_the_original_generation(tmp_path, capsys):
    rc, df, _ = _run(tmp_path, "http://127.0.0.1:9", "bad", "--chat-version", "v41", "--generation", "original")
    assert rc == 2 and df is None and "'original' is a DeepSeek-V4 checkpoint generation" in capsys.readouterr().err


def test_auto_chat_version_follows_a_served_v41_checkpoint(tmp_path):
    """serve --chat-version auto (the default) renders a V4.1 checkpoint's chats in V4.1's
    encoding and reports its architecture; chat-check --chat-version auto (the default)
    reads that and checks against V4.1's reference."""
    with served("golden", extra=("--checkpoint", "tiny-v41", "--no-prefix-cache")) as (url,):
        rc, df, rep = _run(tmp_path, url, "auto", "--no-behaviour")
    m = json.loads((rep / "manifest.json").read_text())
    assert rc == 0 and set(df.status) == {"identical"} and len(df) == len(CASES)
    assert (m["meta"]["chat_version"], m["meta"]["chat_version_from"]) == ("v41", "architecture DeepseekV41ForCausalLM")
    assert m["meta"]["server"]["server_info"]["chat_encoding"] == "deepseek-recipe, DeepSeek-V4.1 encoding"


# ---- the failing page: causes and next steps (issue 38) -------------------------------------------
def _next_steps(summary: str) -> list[str]:
    block = summary.split("## What to run next", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("toggle", list(EXPECTED))
def test_failing_page_states_each_cause_and_steps_the_cli_parses(tmp_path, servers, toggle):
    """Each request toggle's server: every failing case has a cause, the causes name the
    reading the server runs (or one that includes it), the verdict states them in words,
    and every suggested command fits the cause and parses with the real CLI."""
    from kernel_toggles.registry import subsumed_by
    from test_chat_check_causes import parsed
    rc, df, rep = _run(tmp_path, servers[toggle], f"why-{toggle}", "--no-behaviour")
    m = json.loads((rep / "manifest.json").read_text())
    summary = (rep / "summary.md").read_text()
    assert rc == 1 and df[df.status == "differs"].cause.notna().all()
    named = {n for c in m["causes"] for n in c["reproduced by"].split()}
    assert toggle in named | subsumed_by(named)
    verdict = summary.split("**Verdict.**", 1)[1].split("##", 1)[0]
    top = m["causes"][0]
    assert f"{top['cause'][0].upper() + top['cause'][1:]}** in {top['cases']} case(s)" in verdict
    assert "| case | status | cause |" in summary                  # the cause before the long columns
    steps = _next_steps(summary)
    assert steps
    for s in steps:
        args = parsed(s)
        assert args.command == "serve" or args.endpoint == servers[toggle]
    profile = "--engine-profile sglang" if "chat_sglang_0523" in named else None
    assert any(profile in s for s in steps) if profile else not any("--engine-profile" in s for s in steps)
    if not profile:
        assert any(s.startswith(f"fidelity serve --arm {toggle} ") for s in steps)
