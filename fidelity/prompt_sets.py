"""Prompts as token ids for the logit-level A/Bs (`fidelity ab`, `fidelity kld`): the
built-in exact-length needle haystacks on a (length, depth, rep) grid, or the user's own
from a JSONL file, one per line: {"text": ...}, {"messages": [...]} (rendered with the
DeepSeek-V4 chat encoding, generation prompt included) or {"token_ids": [...]}, each
optionally with an "id"."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .lockstep import Prompt


class PromptFileError(ValueError):
    pass


def grid_prompts(tokenizer, lengths, depths, reps: int, seed: int) -> list[Prompt]:
    from .ab import haystack_ids
    out = []
    for L in lengths:
        for d in depths:
            for r in range(reps):
                ids, needle = haystack_ids(tokenizer, L, d, seed * 1_000_003 + L * 101 + int(d) * 7 + r)
                out.append(Prompt(f"L{L}-d{int(d)}-r{r}", torch.tensor(ids), group=f"L{L}",
                                  needle_tokens=needle))
    return out


def file_prompts(path: str | Path, tokenizer, vocab_size: int, group: str | None = None) -> list[Prompt]:
    """The file's prompts; each one's group is its kind (text / messages / token_ids)
    unless `group` names one for all."""
    p = Path(path)
    if not p.is_file():
        raise PromptFileError(f"prompts file not found: {p}")
    out, seen = [], set()
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise PromptFileError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: each line must be a JSON object")
        kinds = [k for k in ("text", "messages", "token_ids") if k in obj]
        if len(kinds) != 1:
            raise PromptFileError(f"{where}: give exactly one of text, messages, token_ids "
                                  f"(found {kinds or 'none'})")
        kind = kinds[0]
        if kind == "text":
            if not isinstance(obj["text"], str) or not obj["text"]:
                raise PromptFileError(f"{where}: text must be a non-empty string")
            ids = tokenizer.encode(obj["text"])
        elif kind == "messages":
            try:
                ids = tokenizer.encode(tokenizer.render_chat(obj["messages"], bool(obj.get("thinking"))).text)
            except ValueError as e:
                raise PromptFileError(f"{where}: {e}") from None
        else:
            ids = obj["token_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size
                                                          for i in ids)):
                raise PromptFileError(f"{where}: token_ids must be a non-empty list of ids in "
                                      f"[0, {vocab_size})")
        if len(ids) < 2:
            raise PromptFileError(f"{where}: the prompt has {len(ids)} token(s); at least 2 are needed")
        pid = str(obj.get("id", f"p{n}"))
        if pid in seen:
            raise PromptFileError(f"{where}: duplicate id {pid!r}")
        seen.add(pid)
        out.append(Prompt(pid, torch.tensor(ids), group=group or kind))
    if not out:
        raise PromptFileError(f"{p}: no prompts")
    return out
