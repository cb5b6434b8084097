"""Prompts as token ids for the logit-level A/Bs (`fidelity ab`, `fidelity kld`,
`fidelity engines`), all in one place: the built-in exact-length needle haystacks (ab's
per-length prompts and kld's (length, depth, rep) grid, one seed formula), random token
ids for an untrained model, or the user's own from a JSONL file, one per line:
{"text": ...}, {"messages": [...]} (rendered with the DeepSeek-V4 chat encoding,
generation prompt included) or {"token_ids": [...]}, each optionally with an "id"."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from needle.haystack import (HaystackSpec, LocalCounter, PromptFormat, build_prompt,
                             value_token_positions)


@dataclass
class Prompt:
    id: str
    tokens: torch.Tensor
    group: str = ""                     # e.g. the length bucket it was built for
    needle_tokens: tuple[int, ...] = ()  # positions of the needle value's tokens (if any)

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


class PromptFileError(ValueError):
    pass


def prompt_seed(seed: int, length: int, rep: int, depth: float = 0) -> int:
    """The seed of one built-in prompt: the run's seed, its length, its needle depth
    (kld's grid; ab's prompts spread depths by rep and leave it 0) and its repetition."""
    return seed * 1_000_003 + length * 101 + int(depth) * 7 + rep


def haystack_ids(tokenizer, length: int, depth: float, seed: int) -> tuple[list[int], tuple[int, ...]]:
    """Token ids of an exact-length haystack and the positions of the needle value's tokens."""
    p = build_prompt(HaystackSpec(), PromptFormat(), LocalCounter(tokenizer), length, depth, seed)
    ids, offsets = tokenizer.encode_with_offsets(p.text)
    if len(ids) != length:
        raise ValueError(f"could not build a {length}-token haystack (got {len(ids)})")
    return ids, tuple(value_token_positions(offsets, p.value_spans))


def builtin_prompts(cfg, lengths, per_length: int, seed: int, tokenizer=None) -> list[Prompt]:
    """`fidelity ab`'s deterministic prompts at each length. With a tokenizer: needle
    haystacks (the task the embedded model was trained on) of exactly that many tokens,
    needle depths spread over the context; without one (an untrained model): random token
    ids. Lengths should include ones where compressed entries exceed index_topk
    (length/4 > index_topk)."""
    out = []
    for L in lengths:
        for j in range(per_length):
            if tokenizer is None:
                g = torch.Generator().manual_seed(prompt_seed(seed, L, j))
                toks = torch.randint(2, cfg.vocab_size, (L,), generator=g)
                needle = ()
            else:
                ids, needle = haystack_ids(tokenizer, L, (j + 0.5) / per_length * 100,
                                           prompt_seed(seed, L, j))
                toks = torch.tensor(ids)
            out.append(Prompt(f"L{L}-{j}", toks, group=f"L{L}", needle_tokens=needle))
    return out


def all_token_ids(path) -> bool:
    """Whether every prompt of the file is given as token ids (no tokenizer needed)."""
    return all("token_ids" in json.loads(x) for x in Path(path).read_text().splitlines() if x.strip())


def describe(prompts) -> dict[str, str]:
    """Prompt id -> how the verdict names it: "511 tokens, needle at 70%" (the needle's
    first token as a share of the prompt), "250 tokens" without a needle."""
    out = {}
    for p in prompts:
        words = f"{p.length} tokens"
        if p.needle_tokens:
            words += f", needle at {round(100 * p.needle_tokens[0] / max(1, p.length))}%"
        out[p.id] = words
    return out


def grid_prompts(tokenizer, lengths, depths, reps: int, seed: int) -> list[Prompt]:
    """`fidelity kld`'s and `fidelity engines`' haystacks on a (length, depth, rep) grid."""
    out = []
    for L in lengths:
        for d in depths:
            for r in range(reps):
                out.append(_grid_point(tokenizer, L, d, r, seed))
    return out


def _grid_point(tokenizer, L: int, d, r: int, seed: int) -> Prompt:
    """The grid's haystack at length L, needle depth d (percent), repetition r."""
    ids, needle = haystack_ids(tokenizer, L, d, prompt_seed(seed, L, r, d))
    return Prompt(f"L{L}-d{int(d)}-r{r}", torch.tensor(ids), group=f"L{L}", needle_tokens=needle)


def grid_prompt(tokenizer, prompt_id: str, seed: int) -> Prompt:
    """One prompt of `grid_prompts` rebuilt from its id (L<length>-d<depth>-r<rep>), so a
    finding on one prompt of a kld run can be replayed on exactly that prompt."""
    m = re.fullmatch(r"L(\d+)-d(\d+)-r(\d+)", prompt_id)
    if not m:
        raise ValueError(f"{prompt_id!r} is not a grid prompt id (L<length>-d<depth>-r<rep>, e.g. L511-d90-r0)")
    return _grid_point(tokenizer, *(int(x) for x in m.groups()), seed)


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
