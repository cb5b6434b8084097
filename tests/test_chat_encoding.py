"""The reference chat encoding (deepseek-recipe via reference_model/chat_encoding.py)
against docs/research/engine-integration.md §3, written here as test data: BOS, role markers,
<think> / </think>, the drop-thinking rule and its exception with tools, DSML tool calls
and tool results, the effort preambles of both checkpoint generations, and the effort /
thinking table of §3.3."""
import pytest

from reference_model.chat_encoding import ChatEncodingError, ChatRequest, render, request_state

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
# §3.2, "Exact preamble strings": three lines joined by \n, then a blank line
ABS = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
       "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
       "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
       "edge cases, and adversarial scenarios.\n"
       "Explicitly write out your entire deliberation process, documenting every intermediate step, "
       "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
       "unchecked.\n\n")
BEYOND = ("Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
          "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
          "exhaustively decompose the problem into its most fundamental components, trace every causal "
          "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
          "Do not stop reasoning until you have independently verified the solution from multiple "
          "angles and are certain that no assumption remains unchecked and no error remains "
          "undiscovered.\n\n")
SYS_USER = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
TOOLS = [{"type": "function", "function": {"name": "get_w", "description": "weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": "", "reasoning_content": "need tool",
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "get_w", "arguments": '{"city": "Paris"}'}}]}


def text(messages, thinking=None, effort=None, tools=None, generation="0731"):
    return render(ChatRequest(messages, tools, thinking, effort), generation).text


def test_multi_turn_drops_earlier_reasoning():
    # §3.1 "Output measured on RECIPE, thinking with effort low"
    m = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B", "reasoning_content": "RB"},
         {"role": "user", "content": "C"}]
    assert text(m, True, "low") == BOS + U + "A" + A + "</think>B" + EOS + U + "C" + A + "<think>"
    assert text(m, False) == BOS + U + "A" + A + "</think>B" + EOS + U + "C" + A + "</think>"


def test_system_is_raw_and_headers():
    assert text(SYS_USER, False) == BOS + "S" + U + "Q" + A + "</think>"
    assert text(SYS_USER, True, "low") == BOS + "S" + U + "Q" + A + "<think>"


@pytest.mark.parametrize("thinking,effort,want_think,preamble", [
    # §3.3 RECIPE table (0731 tiers)
    (None, None, True, ABS),          # thinking omitted -> on; effort omitted -> high
    (True, "minimal", True, ""), (True, "low", True, ""),
    (True, "medium", True, ABS),      # medium -> high
    (True, "high", True, ABS), (True, "xhigh", True, ABS),
    (True, "max", True, BEYOND), (True, "ultra", True, BEYOND),
    (None, "none", False, ""),        # none -> thinking off ...
    (True, "none", True, ABS),        # ... unless thinking is enabled, then high
    (False, "max", False, ""),        # thinking disabled: no preamble, </think>
])
def test_effort_table_0731(thinking, effort, want_think, preamble):
    t = text(SYS_USER, thinking, effort)
    assert t == BOS + preamble + "S" + U + "Q" + A + ("<think>" if want_think else "</think>")


@pytest.mark.parametrize("effort,preamble", [(None, ""), ("high", ""), ("max", ABS)])
def test_effort_table_original(effort, preamble):
    # §3.2: the original encoder knows max / high / None; only max emits "Absolute maximum"
    assert text(SYS_USER, True, effort, generation="original") == BOS + preamble + "S" + U + "Q" + A + "<think>"


def test_original_generation_refuses_undefined_tiers():
    with pytest.raises(ChatEncodingError, match="not defined for the original"):
        render(ChatRequest(SYS_USER, None, True, "medium"), "original")


def test_tools_dsml_call_and_result():
    m = [{"role": "user", "content": "weather in Paris?"}, CALL,
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    t = text(m, True, "low", TOOLS)
    assert t.startswith(BOS + "\n\n## Tools\n")                                  # system = "" + tools block
    assert '"<｜DSML｜tool_calls>"' in t and '### Available Tool Schemas' in t
    assert '{"name": "get_w", "description": "weather", "parameters": ' in t       # one JSON per line
    # tools present: earlier reasoning is kept (drop_thinking disabled), call in DSML
    assert (A + "<think>need tool</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_w\">\n"
            "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS) in t
    # tool results merge into a user turn
    assert t.endswith(U + "<tool_result>sunny</tool_result>" + A + "<think>")


def test_request_state_reads_every_spelling():
    assert request_state({"chat_template_kwargs": {"thinking": False}}) == (False, None)
    assert request_state({"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "low"}}) == (True, "low")
    assert request_state({"thinking": {"type": "disabled"}, "reasoning_effort": "max"}) == (False, "max")
    assert request_state({}) == (None, None)
    with pytest.raises(ChatEncodingError):
        request_state({"reasoning_effort": 3})
