"""One case: the reference rendering (DeepSeek's encoder, the chosen checkpoint
generation, or DeepSeek-V4.1's encoding) tokenized by the engine's own raw-text tokenizer,
against the ids the engine gives the same chat request; verdict per case:

  identical     same ids
  documented    differs, but exactly as the named engine profile's documented reading
                (request toggles chat_sglang_0523 / chat_vllm_033) renders it
  differs       the first differing token with decoded context on both sides, and what
                the thinking state / effort preamble became (e.g. "medium -> no thinking")
  same-count    only counts were available and they agree (a weak check)
  error         the engine refused the request (reported, the run goes on)
  undefined     the request has no reference for this generation (original + low/medium/xhigh)

Behaviour (short completions): reasoning_content as the rendering says, and tool calls
read: a tool case asked to answer without thinking must not come back with the model's
DSML call block left in its content (an engine reading V4.1 output with V4's DSML parser
finds no call: the `v4_dsml_parser` toggle)."""
from __future__ import annotations

from dataclasses import dataclass

from kernel_toggles import ToggleSet
from reference_model import Numerics
from reference_model.chat_encoding import ChatEncodingError, preamble_of, thinking_of

from fidelity.kld.endpoint import EndpointError
from fidelity.serve.tool_calls import DIALECTS, dialect_in

PROFILES = {"sglang": "chat_sglang_0523", "vllm": "chat_vllm_033"}
CONTEXT = 8                                     # tokens of decoded context on each side
SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
SYSTEM_V41 = "<｜System｜>"                   # V4.1's system token (in the tokenizer probe)
TOOL_MAX_TOKENS = 256                         # a tool case's completion: room for one call
DSML_NAMES = {"v4": "DeepSeek-V4", "v41": "DeepSeek-V4.1"}


class TokenizerMismatch(RuntimeError):
    pass


@dataclass
class Reference:
    text: str
    thinking: bool
    preamble: str
    dsml: str = "v4"                            # the DSML dialect the answer's tool calls use


def reference(case, generation: str, nx=None) -> Reference | None:
    """The reference rendering (or, with `nx`, that arm's rendering) of a case; None when
    the generation does not define it."""
    nx = nx or Numerics("reference")
    try:
        r = nx.chat_render(nx.chat_request(case.body()), generation)
    except ChatEncodingError as e:
        if "not defined for the original" in str(e):
            return None
        raise
    return Reference(r.text, r.thinking, r.preamble, r.dsml)


def profile_numerics(engine_profile: str | None):
    if engine_profile is None:
        return None
    return ToggleSet.parse(PROFILES[engine_profile]).numerics()


def known_readings() -> dict:
    """name -> Numerics of every request toggle (each a known way an engine reads or renders
    a chat): a differing prompt one of them reproduces exactly has a named cause."""
    from kernel_toggles.registry import all_toggles
    return {t.name: ToggleSet.parse(t.name).numerics() for t in all_toggles("request")}


def reproduced_by(case, ids: list[int], probe, generation: str, readings: dict) -> str:
    """The known readings whose rendering of the case the engine's ids equal, space-separated."""
    hits = []
    for name, nx in readings.items():
        r = reference(case, generation, nx)
        if r is not None and probe.raw_ids(r.text) == ids:
            hits.append(name)
    return " ".join(hits)


def check_specials(probe, generation: str = "0731") -> None:
    """The engine's raw-text tokenizer must know DeepSeek-V4's special tokens; otherwise
    nothing rendered by the reference can be compared. Checking V4.1, the probe text
    carries `<｜System｜>` too (so a tokenizer without it differs from ours there)."""
    bad = []
    for s in SPECIALS:
        ids = probe.raw_ids(s)
        if ids is not None and len(ids) != 1:
            bad.append(f"{s} -> {len(ids)} tokens")
    if bad:
        raise TokenizerMismatch("the engine's tokenizer does not encode DeepSeek-V4's special tokens as "
                                f"single tokens ({'; '.join(bad)}): it is not the reference's tokenizer, "
                                "so its prompts cannot be compared with the reference rendering")
    local = probe.local
    if local is not None and probe.raw_route:
        probe_text = SPECIALS[0] + (SYSTEM_V41 if generation == "v41" else "") + "Tokenizer probe: 12345, naïve café."
        a, b = probe.raw_ids(probe_text), local.encode(probe_text)
        if a != b:
            raise TokenizerMismatch(f"the engine tokenizes a probe text to {a[:12]}..., our tokenizer "
                                    f"({local.name}) to {b[:12]}...: pass the served model's --tokenizer")


def state(thinking: bool | None, preamble: str) -> str:
    if thinking is False:
        return "no thinking"
    if thinking is None:
        return "no generation header"
    return "thinking" + (f", {preamble.replace('-', ' ')} preamble" if preamble else ", no preamble")


def run_case(case, probe, generation: str, profile_nx=None, readings: dict | None = None) -> dict:
    """The case's verdict row; with `readings`, a differing prompt also names the known
    readings that reproduce it (`reproduced_by`)."""
    row = {"case": case.id, "kind": case.kind, "thinking_sent": case.thinking, "effort_sent": case.effort,
           "tools": bool(case.tools), "system": bool(case.tags.get("system"))}
    ref = reference(case, generation)
    if ref is None:
        return {**row, "status": "undefined", "detail": f"effort {case.effort!r} has no reference in the "
                f"{generation} generation"}
    row["reference_state"] = state(ref.thinking, ref.preamble)
    try:
        ids, count = probe.chat_ids(case)
        ref_ids = probe.raw_ids(ref.text)
    except EndpointError as e:
        return {**row, "status": "error", "detail": str(e)[:300]}
    row.update(engine_tokens=count, reference_tokens=None if ref_ids is None else len(ref_ids))
    if ids is None:
        same = ref_ids is not None and count == len(ref_ids)
        return {**row, "status": "same-count" if same else "differs",
                "detail": f"only counts: engine {count}, reference {row['reference_tokens']} (weak check)"}
    if ids == ref_ids:
        return {**row, "status": "identical", "engine_state": row["reference_state"], "detail": ""}
    eng_text = probe.decode(ids)
    row["engine_state"] = state(thinking_of(eng_text), preamble_of(eng_text))
    j = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
    lo = max(0, j - CONTEXT)
    became = (f"{case.effort or 'absent'} effort, thinking {'absent' if case.thinking is None else case.thinking}: "
              f"{row['reference_state']} -> {row['engine_state']}")
    detail = (f"first difference at token {j} (engine {len(ids)} tokens, reference {len(ref_ids)}); "
              f"engine: ...{probe.decode(ids[lo:j + CONTEXT])!r}; reference: ...{probe.decode(ref_ids[lo:j + CONTEXT])!r}")
    note = _dsml_note(eng_text, ref) if case.tools else ""
    row.update(first_diff=j, became=became, detail=detail + (f"; {note}" if note else ""), status="differs",
               tools_format=note or None)
    if profile_nx is not None:
        exp = reference(case, generation, profile_nx)
        if exp is not None and probe.raw_ids(exp.text) == ids:
            row["status"] = "documented"
    if readings and row["status"] == "differs":
        row["reproduced_by"] = reproduced_by(case, ids, probe, generation, readings)
    return row


def _dsml_note(eng_text: str, ref: Reference) -> str:
    """What the engine's prompt says about its tool format, when it is not the reference's."""
    want = DIALECTS[ref.dsml]
    if "｜DSML｜" not in eng_text:
        return f"tools are not in {DSML_NAMES[ref.dsml]}'s DSML format"
    if want.opening not in eng_text:
        other = next((n for n, d in DIALECTS.items() if d.opening in eng_text and n != ref.dsml), None)
        if other:
            return f"tools are in {DSML_NAMES[other]}'s DSML tags, not {DSML_NAMES[ref.dsml]}'s"
    return ""


def tool_probe(case, ref: Reference | None) -> bool:
    """A case whose completion is long enough for a tool call: the matrix's tool cases
    rendered without thinking (a model thinking first may not reach its call)."""
    return bool(case.tools) and case.kind == "matrix" and ref is not None and not ref.thinking


def expected_reading(case, row: dict, generation: str, profile_nx=None) -> tuple[Reference | None, str]:
    """(rendering, its name) the engine's behaviour is judged against: the one its prompt
    matched. A documented row renders as the profile says, so its response must behave
    that way (SGLang's default thinking off -> no reasoning_content); every other row is
    judged against DeepSeek's reference."""
    if row.get("status") == "documented" and profile_nx is not None:
        return reference(case, generation, profile_nx), "the documented reading"
    return reference(case, generation), "the reference"


def behaviour(case, probe, ref: Reference | None, reading: str = "the reference") -> str:
    """'ok', or what is wrong with a short completion of the case: reasoning_content
    missing when thinking should be on (or present when off) under `reading`, a tool round
    trip refused."""
    if ref is None:
        return "ok"
    r = probe.complete(case, TOOL_MAX_TOKENS if tool_probe(case, ref) else 4)
    if "error" in r:
        return f"completion failed: {r['error'][:200]}"
    try:
        msg = r["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return f"malformed completion: {str(r)[:200]}"
    if ref.thinking and msg.get("reasoning_content") is None:
        return f"thinking should be on ({reading}) but the response has no reasoning_content"
    if not ref.thinking and msg.get("reasoning_content"):
        return f"thinking should be off ({reading}) but the response has reasoning_content"
    return (tool_calls_left_in_content(msg, ref.dsml) if case.tools else None) or "ok"


def tool_calls_left_in_content(msg: dict, dsml: str) -> str | None:
    """The problem when the model wrote a DSML call block but the response has no
    tool_calls (the engine's parser did not read it), else None."""
    found = dialect_in(msg.get("content"))
    if found is None or msg.get("tool_calls"):
        return None
    if found == dsml == "v41":
        return ("the model called a tool in DeepSeek-V4.1's DSML (<｜DSML｜ calls>) but the response "
                "has no tool_calls: the markup came back as content, as a V4 DSML parser reading V4.1 "
                "output leaves it (toggle v4_dsml_parser), or no tool parser is enabled")
    if found == dsml:
        return ("the model called a tool in DeepSeek-V4's DSML (<｜DSML｜tool_calls>) but the response "
                "has no tool_calls: the markup came back as content (no DSML tool parser on the "
                "serving path?)")
    return (f"the response's content holds {DSML_NAMES[found]}'s DSML call block and no tool_calls, "
            f"but the chat was rendered for {DSML_NAMES[dsml]}")
