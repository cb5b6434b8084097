"""The tiny model's tokenizer and DeepSeek-V4's chat encoding.

A byte-level BPE (`tokenizers` JSON, so every tool treats it like a real tokenizer) with
DeepSeek-V4's special-token strings at fixed low ids: 0 = `<｜begin▁of▁sentence｜>` (bos),
1 = `<｜end▁of▁sentence｜>` (eos = pad), then `<｜User｜>`, `<｜Assistant｜>`, `<think>`,
`</think>`; the 256 byte symbols follow, and merges learnt from `data/corpus.txt` (text
written for this project) fill the vocabulary up to 512 = tiny().vocab_size. Digits are
split one per token so numbers tokenize the same everywhere. `build_tokenizer_json()`
regenerates the shipped `data/tokenizer.json` byte for byte (tests check this).

Chat encoding: DeepSeek's own encoder (deepseek-recipe, via chat_encoding.py): BOS +
[effort preamble, thinking only] + system + "<｜User｜>" + user + "<｜Assistant｜>" +
("<think>" if thinking else "</think>")."""
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
    def render_chat(self, messages: list[dict], thinking: bool | None = False,
                    reasoning_effort: str | None = None,
                    add_generation_prompt: bool = True) -> ChatPrompt:
        from .chat_encoding import ChatEncodingError, ChatRequest, render
        try:
            r = render(ChatRequest(messages, None, thinking, reasoning_effort), "0731", add_generation_prompt)
        except ChatEncodingError as e:
            raise TokenizerError(str(e)) from None
        return ChatPrompt(r.text, r.thinking)


def render_chat(messages: list[dict], thinking: bool | None = False, reasoning_effort: str | None = None,
                add_generation_prompt: bool = True, tools: list | None = None,
                generation: str = "0731") -> str:
    """DeepSeek-V4 encoding of a conversation as text, by DeepSeek's own encoder
    (reference_model/chat_encoding.py, deepseek-recipe). thinking None = DeepSeek's default
    (on)."""
    from .chat_encoding import ChatEncodingError, ChatRequest, render
    try:
        return render(ChatRequest(messages, tools, thinking, reasoning_effort), generation,
                      add_generation_prompt).text
    except ChatEncodingError as e:
        raise TokenizerError(str(e)) from None


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
        raise TokenizerError(f"{p} is not a tokenizer.json (the `tokenizers` library could not read "
                             f"it: {str(e).strip()[:200]})") from None
    return ChatTokenizer(tok, name=str(p))


if __name__ == "__main__":
    print(write_tokenizer_json())
