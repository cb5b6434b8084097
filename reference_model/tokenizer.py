"""The tiny model's tokenizer and DeepSeek-V4's chat encoding.

A byte-level BPE (`tokenizers` JSON, so every tool treats it like a real tokenizer) with
DeepSeek-V4's special-token strings at fixed low ids: 0 = `<｜begin▁of▁sentence｜>` (bos),
1 = `<｜end▁of▁sentence｜>` (eos = pad), then `<｜User｜>`, `<｜Assistant｜>`, `<think>`,
`</think>`; the 256 byte symbols follow, and merges learnt from `data/corpus.txt` (text
written for this project) fill the vocabulary up to 512 = tiny().vocab_size. Digits are
split one per token so numbers tokenize the same everywhere. `build_tokenizer_json()`
regenerates the shipped `data/tokenizer.json` byte for byte (tests check this).

Chat encoding (research dsv4-architecture §11): BOS + [max-effort prefix, thinking only] +
system + "<｜User｜>" + user + "<｜Assistant｜>" + ("<think>" if thinking else "</think>").
No template engine: the string is built here, as DeepSeek's encoding_dsv4.py does."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).with_name("data")
DEFAULT_PATH = DATA / "tokenizer.json"
CORPUS_PATH = DATA / "corpus.txt"
VOCAB_SIZE = 512

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)

# DeepSeek's encoder puts a fixed English preamble first when thinking with effort "max".
# Its exact wording is not in our research notes (UNCONFIRMED); this stand-in keeps the
# position and the rule (thinking mode only, "max" only) so harness code paths are real.
REASONING_EFFORT_MAX_PREFIX = (
    "Reasoning effort: maximum. Think through the problem carefully and completely. "
    "Check your answer before you give it.")


class TokenizerError(ValueError):
    """Missing or malformed tokenizer file, or a bad chat request."""


def build_tokenizer_json(corpus: str | None = None, vocab_size: int = VOCAB_SIZE) -> str:
    """Train the byte-level BPE on `corpus` (default: the shipped corpus) and return the
    tokenizer JSON. Deterministic: same corpus, same bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = CORPUS_PATH.read_text(encoding="utf-8") if corpus is None else corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator([line for line in text.splitlines() if line.strip()], trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise TokenizerError(f"special token {s} landed at id {tok.token_to_id(s)}, not {i}")
    if tok.get_vocab_size() > vocab_size:
        raise TokenizerError(f"vocabulary {tok.get_vocab_size()} exceeds {vocab_size}")
    return json.dumps(json.loads(tok.to_str()), indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def write_tokenizer_json(path: str | Path = DEFAULT_PATH) -> Path:
    """Regenerate the shipped tokenizer file (atomically)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(build_tokenizer_json(), encoding="utf-8")
    tmp.replace(path)
    return path


@dataclass
class ChatPrompt:
    """A rendered chat prompt: the text the model sees and the mode it was rendered in."""
    text: str
    thinking: bool


class ChatTokenizer:
    """`tokenizers.Tokenizer` plus the ids and the chat encoding the toolkit needs."""

    def __init__(self, tok, name: str = "tokenizer"):
        self.tok = tok
        self.name = name
        ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
        missing = [s for s, i in ids.items() if i is None]
        if missing:
            raise TokenizerError(f"{name}: special token(s) missing: {', '.join(missing)}")
        self.special_ids = ids
        self.bos_id, self.eos_id = ids[BOS], ids[EOS]
        self.think_id, self.end_think_id = ids[THINK], ids[END_THINK]

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def fingerprint(self) -> str:
        """Content hash: the same tokenizer anywhere on disk gets the same value."""
        import hashlib
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings inside it become their ids. Nothing
        is added (DeepSeek-V4: add_bos_token false; the chat encoding writes BOS itself)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        e = self.tok.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids) -> list[str]:
        return [self.tok.id_to_token(int(i)) for i in ids]

    def split_reasoning(self, ids, thinking: bool) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of generated ids. Thinking mode: reasoning runs up
        to </think>; without it the answer never started (content None)."""
        ids = list(ids)
        if not thinking:
            return None, self.decode(ids)
        if self.end_think_id in ids:
            k = ids.index(self.end_think_id)
            return self.decode(ids[:k]), self.decode(ids[k + 1:])
        return self.decode(ids), None

    # ---- DeepSeek-V4 chat encoding ------------------------------------------------------
    def render_chat(self, messages: list[dict], thinking: bool = False,
                    reasoning_effort: str | None = None,
                    add_generation_prompt: bool = True) -> ChatPrompt:
        return ChatPrompt(render_chat(messages, thinking, reasoning_effort, add_generation_prompt),
                          thinking)


def render_chat(messages: list[dict], thinking: bool = False, reasoning_effort: str | None = None,
                add_generation_prompt: bool = True) -> str:
    """DeepSeek-V4 encoding of a conversation as text. System messages go first (no
    separator), user turns are prefixed with <｜User｜>, assistant turns with
    <｜Assistant｜></think> and closed with EOS; the generation prompt opens the assistant
    turn with <think> (thinking) or </think> (non-thinking). Reasoning of earlier turns is
    dropped (DeepSeek's drop_thinking default)."""
    effort = _effort(reasoning_effort)
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list")
    out = [BOS]
    if thinking and effort == "max":
        out.append(REASONING_EFFORT_MAX_PREFIX)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise TokenizerError(f"message {i} must be an object with a role")
        role, content = m["role"], _content(m.get("content"), i)
        if role in ("system", "developer"):
            out.append(content)
        elif role == "user":
            out.append(USER + content)
        elif role == "assistant":
            out.append(ASSISTANT + END_THINK + content + EOS)
        else:
            raise TokenizerError(f"message {i}: unsupported role {role!r}")
    if add_generation_prompt:
        out.append(ASSISTANT + (THINK if thinking else END_THINK))
    return "".join(out)


def _effort(e):
    """DeepSeek's mapping: None/low/medium/high -> high (no prompt change), xhigh/max -> max."""
    if e is None:
        return None
    if e in ("low", "medium", "high", "none", "minimal"):
        return "high"
    if e in ("xhigh", "max"):
        return "max"
    raise TokenizerError(f"reasoning_effort must be one of low, medium, high, xhigh, max; got {e!r}")


def _content(c, i) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):                       # OpenAI content parts: keep the text parts
        parts = []
        for p in c:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise TokenizerError(f"message {i}: only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise TokenizerError(f"message {i}: content must be a string or a list of text parts")


def load_tokenizer(path: str | Path | None = None) -> ChatTokenizer:
    """The shipped tiny tokenizer, or any `tokenizers` JSON with DeepSeek-V4's special
    tokens (a directory is searched for tokenizer.json)."""
    from tokenizers import Tokenizer

    p = Path(path) if path is not None else DEFAULT_PATH
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(f"tokenizer file not found: {p}")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises its own Exception type
        raise TokenizerError(f"cannot read tokenizer {p}: {e}") from None
    return ChatTokenizer(tok, name=str(p))


if __name__ == "__main__":
    print(write_tokenizer_json())
