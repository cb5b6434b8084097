"""Request-level toggles (category `request`): how engines read a chat request and render
it, so `fidelity serve` can reproduce each engine behaviour and each misconfiguration and
`fidelity chat-check` can tell documented engine behaviour from a broken deployment.
They replace the request seam (`chat_request`: the fields as read; `chat_render`: the
template, and the DSML dialect the answer's tool calls are read in), never a numerics
kernel. Facts: docs/research/engine-integration.md §3, docs/v41-architecture.md §7. An engine
bug on this seam (`v4_dsml_parser`) is category `known-bug`."""
from __future__ import annotations

import json
from dataclasses import replace

from reference_model.chat_encoding import ChatRequest, Rendered

from .registry import Provenance, toggle

_B = dict(_builtin=True, category="request")


@toggle("thinking_default_off", kernel="chat_request", wraps=True, **_B,
        provenance=Provenance(("sglang",), ("SGLANG_DEFAULT_THINKING=0 (default)",),
                              ("engine-integration.md §3.3", "SGL-0.5.23 serving_chat._thinking_requested")),
        description="A request that does not say whether to think is answered without thinking "
                    "(SGLang's default; DeepSeek's API and library default to thinking on).")
def _thinking_default_off(golden, body):
    r = golden.chat_request(body)
    return r if r.thinking is not None else replace(r, thinking=False)


@toggle("effort_medium_dropped", kernel="chat_request", wraps=True, **_B,
        provenance=Provenance(("sglang",), ("deployments before the 0.5.23 mapping",),
                              ("sglang #33185", "issue: 'medium was silently turned into no thinking'"),
                              unconfirmed="which builds did it"),
        description="reasoning_effort 'medium' (what most harnesses send) turns thinking off "
                    "instead of meaning 'high' (DeepSeek's library maps medium to high).")
def _effort_medium_dropped(golden, body):
    r = golden.chat_request(body)
    return replace(r, thinking=False, effort=None) if r.effort == "medium" else r


@toggle("chat_sglang_0523", kernel="chat_request", subsumes=("thinking_default_off",), **_B,
        provenance=Provenance(("sglang",), ("SGLang 0.5.23 defaults",),
                              ("engine-integration.md §3.3", "serving_chat.py", "environ.py")),
        description="SGLang 0.5.23's reading: thinking only from chat_template_kwargs.thinking "
                    "(enable_thinking is not read), else SGLANG_DEFAULT_THINKING (off); "
                    "reasoning_effort 'none' or absent becomes the server default (the "
                    "library's high) and does not turn thinking off.")
def _chat_sglang_0523(golden, body):
    kw = body.get("chat_template_kwargs") or {}
    thinking = bool(kw["thinking"]) if "thinking" in kw else False
    effort = body.get("reasoning_effort", kw.get("reasoning_effort"))
    return ChatRequest(body.get("messages"), body.get("tools"), thinking,
                       None if effort in (None, "none") else effort)


@toggle("chat_vllm_033", kernel="chat_request", **_B,
        provenance=Provenance(("vllm",), ("--tokenizer-mode deepseek_v4",),
                              ("engine-integration.md §3.3", "vllm/tokenizers/deepseek_v4.py",
                               "chat_completion/protocol.py build_chat_params")),
        description="vLLM 0.33's reading: thinking = kwargs thinking or enable_thinking, on when "
                    "neither is given, and forced on by any effort other than 'none'; effort "
                    "none turns thinking off, low/minimal/medium render as low, max as max, "
                    "anything else as high.")
def _chat_vllm_033(golden, body):
    kw = dict(body.get("chat_template_kwargs") or {})
    effort = body.get("reasoning_effort", kw.get("reasoning_effort"))
    if effort is not None and "enable_thinking" not in kw:
        kw["enable_thinking"] = effort != "none"
    given = "thinking" in kw or "enable_thinking" in kw
    thinking = bool(kw.get("thinking")) or bool(kw.get("enable_thinking")) if given else True
    if effort == "none":
        thinking, tier = False, None
    elif effort in ("low", "minimal", "medium"):
        tier = "low"
    elif effort is None or effort == "max":
        tier = effort
    else:
        tier = "high"
    return ChatRequest(body.get("messages"), body.get("tools"), thinking, tier)


@toggle("chat_template_v32", kernel="chat_render", **_B,
        provenance=Provenance(("sglang",), ("--chat-template pointing at DeepSeek-V3.2's template",),
                              ("issue: V3.2 template on V4",),
                              unconfirmed="V3.2 tool strings written from DeepSeek-V3.x's public "
                                          "template as we recall it, not from the research"),
        description="The conversation rendered with DeepSeek-V3.2's chat template instead of "
                    "V4's encoder: tools described and called in V3's format (not DSML), tool "
                    "results in V3's tool-output markers, no reasoning-effort preamble, thinking "
                    "only when asked for (V3.x's default is off), earlier reasoning always dropped.")
def _chat_template_v32(golden, req, generation="0731", add_generation_prompt=True):
    text, thinking = _render_v32(req, add_generation_prompt)
    return Rendered(text, thinking, "")


def _render_v32(req, add_generation_prompt) -> tuple[str, bool]:
    thinking = req.thinking is True              # V3.x templates think only when asked
    system = [m.get("content") or "" for m in req.messages if m.get("role") == "system"]
    out = ["<｜begin▁of▁sentence｜>", "\n\n".join(system)]
    if req.tools:
        out.append("\n\n## Tools\nYou have access to the following tools:\n")
        for t in req.tools:
            f = t.get("function", t)
            out.append(f"\n### {f.get('name')}\nDescription: {f.get('description', '')}\n\n"
                       f"Parameters: {json.dumps(f.get('parameters', {}))}\n")
        out.append("\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                   "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"
                   "tool_call_arguments<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n")
    for m in req.messages:
        role, content = m.get("role"), m.get("content") or ""
        if role in ("user", "developer"):
            out.append("<｜User｜>" + content)
        elif role == "assistant":
            calls = "".join(f"<｜tool▁call▁begin｜>{c['function']['name']}<｜tool▁sep｜>"
                            f"{c['function']['arguments']}<｜tool▁call▁end｜>" for c in m.get("tool_calls") or [])
            out.append("<｜Assistant｜></think>" + content
                       + (f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>" if calls else "")
                       + "<｜end▁of▁sentence｜>")
        elif role == "tool":
            out.append(f"<｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜>")
    if add_generation_prompt:
        out.append("<｜Assistant｜>" + ("<think>" if thinking else "</think>"))
    return "".join(out), thinking


@toggle("v4_dsml_parser", kernel="chat_render", wraps=True, _builtin=True, category="known-bug",
        provenance=Provenance(("sglang", "vllm"),
                              ("a V4 tool-call parser (--tool-call-parser deepseekv4 / deepseek_v4) "
                               "serving a DeepSeek-V4.1 checkpoint",),
                              ("docs/v41-architecture.md §7, §9 (v4_dsml_parser)",
                               "sglang #40236: the V4 detector keys on <｜DSML｜tool_calls>; other "
                               "block names come back as content"),
                              unconfirmed="no engine release is known to have shipped a V4 parser "
                                          "for V4.1; zero tool calls follows from the tag strings"),
        description="Tool calls in a DeepSeek-V4.1 answer are read with V4's DSML parser "
                    "(<｜DSML｜tool_calls>, <｜DSML｜invoke>) while V4.1 writes spaced tags "
                    "(<｜DSML｜ calls>, <｜DSML｜ invoke>): no tool call is found, the markup comes "
                    "back as content and finish_reason stays 'stop'. No effect on a V4 chat.")
def _v4_dsml_parser(golden, req, generation="0731", add_generation_prompt=True):
    return replace(golden.chat_render(req, generation, add_generation_prompt), dsml="v4")
