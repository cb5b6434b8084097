"""chat-check's causes without a server: each failing case's cause in words, the request
settings a cause's cases share (against every case checked), the status grid's axes in the
request's own order, and next steps that fit the cause and that the real CLI parses. The
rows are built from the real case matrix with a stated rule, so the expected words follow
from the rule, not from the code under test."""
import shlex

import pandas as pd
import pytest

from fidelity.chat_check.cases import EFFORTS, all_cases
from fidelity.chat_check.causes import cause_table, causes, label, next_steps, pattern, verdict_lines
from fidelity.chat_check.report import status_grid
from fidelity.cli import build_parser

URL = "http://127.0.0.1:30000"
META = {"endpoint": {"url": URL, "model": "m"}, "server": {"models": ["m"]}, "generation": "0731",
        "chat_version": "v4", "chat_version_from": "architecture DeepseekV4ForCausalLM", "engine_profile": None}


def parsed(line: str):
    """A suggested command as the shell splits it (comment dropped), parsed by the real CLI;
    a `serve --arm` also resolved as serve resolves it. Fails naming the line."""
    argv = shlex.split(line, comments=True)
    assert argv[:1] == ["fidelity"], line
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"the CLI rejects {line!r} (exit {e.code})")
    if argv[1] == "serve":
        from fidelity.design.arms import parse_arm
        from fidelity.serve import parse_arm_options
        for _, spec in parse_arm_options(args.arm):
            parse_arm(spec)
    return args


def rows(rule, state=("thinking, high preamble", "no thinking"), **extra) -> list[dict]:
    """Every case of the matrix as a report row: those `rule` picks differ (reference state
    -> engine state), the rest are identical."""
    out = []
    for c in all_cases():
        r = {"case": c.id, "kind": c.kind, "thinking_sent": c.thinking, "effort_sent": c.effort,
             "tools": bool(c.tools), "system": bool(c.tags["system"]), "status": "identical", "behaviour": None}
        if rule(c):
            r.update(status="differs", reference_state=state[0], engine_state=state[1], first_diff=3, **extra)
        out.append(r)
    return out


def table(rs):
    df = pd.DataFrame(rs)
    return cause_table(df[df.status != "identical"], df), df


def test_a_cause_names_what_changed_and_the_settings_its_cases_share():
    t, _ = table(rows(lambda c: c.effort == "medium" and c.thinking is not False,
                      reproduced_by="effort_medium_dropped"))
    assert len(t) == 1
    r = t.iloc[0]
    assert r.cause == "thinking turned off" and r["reproduced by"] == "effort_medium_dropped"
    assert r.cases == sum(1 for c in all_cases() if c.effort == "medium" and c.thinking is not False)
    assert "effort medium" in r.requests and "thinking any but off" in r.requests
    assert "tools" not in r.requests            # both with and without: not a shared setting


def test_thinking_absent_any_effort_but_none():
    t, _ = table(rows(lambda c: c.thinking is None and c.effort != "none"))
    assert t.iloc[0].requests == "thinking absent; effort any but none"


def test_a_case_with_two_causes_counts_in_both():
    rs = rows(lambda c: bool(c.tools), tools_format="tools are not in DeepSeek-V4's DSML format")
    t, _ = table(rs)
    n = sum(1 for c in all_cases() if c.tools)
    assert dict(zip(t.cause, t.cases)) == {"thinking turned off": n, "tools are not in DeepSeek-V4's DSML format": n}
    assert all(r["requests"] == "with tools" for r in t.to_dict("records"))


def test_preamble_changes_and_unchanged_state():
    r = {"status": "differs", "first_diff": 5}
    assert causes({**r, "reference_state": "thinking, high preamble", "engine_state": "thinking, no preamble"}) \
        == ["effort preamble dropped"]
    assert causes({**r, "reference_state": "thinking, high preamble", "engine_state": "thinking, max preamble"}) \
        == ["another effort preamble"]
    assert causes({**r, "reference_state": "no thinking", "engine_state": "no thinking"}) \
        == ["prompt text differs, same thinking state"]
    assert causes({"status": "differs", "reference_state": "no thinking"}) == ["prompt length differs (counts only)"]


@pytest.mark.parametrize("extra, state, want", [
    ({"reproduced_by": "chat_sglang_0523"}, None, "--engine-profile sglang"),
    ({"reproduced_by": "effort_medium_dropped"}, None, "serve --arm effort_medium_dropped"),
    ({}, ("thinking, high preamble", "thinking, no preamble"), "--generation original"),
    ({"tools_format": "tools are in DeepSeek-V4.1's DSML tags, not DeepSeek-V4's"},
     ("no thinking", "no thinking"), "--chat-version v41"),
    ({}, ("no thinking", "no thinking"), "--tokenizer"),
])
def test_next_steps_fit_the_cause_and_parse(extra, state, want):
    rs = rows(lambda c: c.thinking is None, state or ("thinking, high preamble", "no thinking"), **extra)
    t, _ = table(rs)
    steps = next_steps(META, t)
    assert steps and any(want in s for s in steps), steps
    for s in steps:
        args = parsed(s)
        if args.command == "chat-check":
            assert args.endpoint.rstrip("/") == URL
    if "reproduced_by" not in extra:
        assert not any("--engine-profile" in s for s in steps)     # no profile when none reproduces it


def test_refusals_and_response_problems_have_their_own_causes_and_steps():
    rs = rows(lambda c: False)
    for r in rs:
        if r["tools"]:
            r.update(status="error", detail="HTTP 503 from /v1/chat/completions: timed out; retried 4 times")
        if r["kind"] == "multi-turn":
            r["behaviour"] = "thinking should be on (the reference) but the response has no reasoning_content"
    t, _ = table(rs)
    got = dict(zip(t.cause, t.cases))
    assert got["refused: HTTP 503 from /v1/chat/completions: timed out"] == sum(1 for c in all_cases() if c.tools)
    assert got["response: no reasoning_content though thinking is on"] == 3
    steps = next_steps(META, t)
    assert any("--retries" in s for s in steps) and any("--reasoning-parser" in s for s in steps)
    for s in steps:
        parsed(s)


def test_verdict_names_a_reading_behind_every_cause_once_with_what_it_does():
    t, _ = table(rows(lambda c: bool(c.tools), tools_format="tools are not in DeepSeek-V4's DSML format",
                      reproduced_by="chat_template_v32"))
    lines = verdict_lines(t)
    assert sum("chat_template_v32" in x for x in lines) == 1
    assert "V3.2's chat template" in lines[0] and lines[1].startswith("**")    # the root cause first


def test_a_settings_pattern_spans_nothing_when_every_value_is_hit():
    _, df = table(rows(lambda c: True))
    assert pattern(df, df) == "every kind of request"


def test_status_grid_effort_axis_in_request_order():
    df = pd.DataFrame(rows(lambda c: c.effort == "low"))
    fig = status_grid(df)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == [label(e) for e in EFFORTS]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["absent", "on", "off"]
