"""Engram in the forward (docs/v41-architecture.md §5.2): on its layers, before attention,
each position's n-grams over the compressed token history are hashed to table rows,
gathered, projected and gated into every stream. The history lives in the sequence state
so decode steps see the prompt's n-grams. The constants are v41/engram.py's; the steps are
seam kernels (engram_hash, engram_lookup, engram_gate)."""
from __future__ import annotations

import torch

from ..errors import InputError
from ..state import cat
from . import kernels as K
from .engram import compressed_token_map, engram_layout


class EngramVocabularyError(ValueError):
    """The compressed vocabulary the Engram hash runs over cannot be built or disagrees
    with the config (it would silently rehash every n-gram)."""


def _tokenizer_path(weights):
    """A tokenizer.json next to the checkpoint the weights came from, if any."""
    root = getattr(getattr(weights, "info", None), "root", None)
    if root is not None and (root / "tokenizer.json").is_file():
        return root / "tokenizer.json"
    return None


def token_map_for(cfg, weights=None, tokenizer=None) -> list[int]:
    """Token id -> compressed id (REF-E `build_compressed_token_map`) from, in order: the
    given tokenizer (path or `tokenizers.Tokenizer`), the checkpoint's tokenizer.json, or
    the shipped tiny tokenizer when its vocabulary is the model's. Its size must equal
    `engram_compressed_vocab_size`."""
    from tokenizers import Tokenizer

    from ..tokenizer import DEFAULT_PATH, VOCAB_SIZE
    src = tokenizer if tokenizer is not None else _tokenizer_path(weights)
    if src is None:
        if cfg.vocab_size != VOCAB_SIZE:
            raise EngramVocabularyError(
                f"Engram needs the tokenizer (its compressed vocabulary): none given and no "
                f"tokenizer.json next to the checkpoint (vocab_size {cfg.vocab_size})")
        src = DEFAULT_PATH
    tok = src if isinstance(src, Tokenizer) else Tokenizer.from_file(str(src))
    tmap, size = compressed_token_map(tok)
    if size != cfg.engram_compressed_vocab_size:
        raise EngramVocabularyError(f"compressed vocabulary of the tokenizer is {size}, config "
                                    f"engram_compressed_vocab_size is "
                                    f"{cfg.engram_compressed_vocab_size}: the hash would rehash")
    if len(tmap) < cfg.vocab_size:
        tmap = tmap + [0] * (cfg.vocab_size - len(tmap))         # ids the tokenizer lacks
    return tmap


class EngramStep:
    """Engram of a model: its bucket layout and compressed vocabulary, built once."""

    def __init__(self, model, token_map=None, tokenizer=None):
        self.m = model
        cfg = model.cfg
        self.layout = engram_layout(cfg)
        tm = token_map if token_map is not None else token_map_for(cfg, model.weights, tokenizer)
        self.token_map = torch.as_tensor(tm, dtype=torch.long)
        self.pad_c = int(self.token_map[cfg.engram_pad_id])

    def history(self, tokens, state, pos0: int) -> torch.Tensor:
        """The compressed history covering positions 0 .. pos0+n-1: the first Engram layer
        to see a chunk appends its tokens (all text: no DEAD image spans)."""
        n = tokens.shape[0]
        have = 0 if state.engram_hist is None else state.engram_hist.shape[0]
        if have < pos0:
            raise InputError(f"Engram history covers {have} positions, the chunk starts at {pos0}")
        if have < pos0 + n:
            new = K.compress_history(tokens[have - pos0:], self.token_map.to(tokens.device))
            state.engram_hist = cat(state.engram_hist, new)
        return state.engram_hist

    def __call__(self, i, w, H, tokens, state, pos0: int, t):
        cfg, nx = self.m.cfg, self.m.nx
        hist = self.history(tokens, state, pos0)
        pos = torch.arange(pos0, pos0 + H.shape[0], device=H.device)
        k = cfg.engram_layer_ids.index(i)
        ids = nx.engram_hash(hist.to(H.device), pos, self.layout, self.pad_c)[:, k]
        if t:
            t("engram.ids", ids)
        rows = nx.engram_lookup(w["engram.embed.weight"], ids)
        kv = self.m.gemm.lin(rows.flatten(1), w, "engram.wkv")
        H = nx.engram_gate(H, kv, w["engram.q_weight"], w["engram.k_weight"], cfg.norm_eps)
        if t:
            t("engram.out", H)
        return H
