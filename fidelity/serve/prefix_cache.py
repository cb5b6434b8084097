"""A prefix cache for the stand-in engine, as serving engines keep one: after a prompt is
prefilled, the state of the whole sequence (every layer's SequenceState entry) is kept at
each multiple of the page size, keyed by a chain of page hashes over the exact token ids
(vLLM's block hashes: a page's key hashes its parent's key and its own ids, so a key names
the whole prefix). A later request restores the longest cached prefix that ends on a page
boundary and is shorter than its prompt, through the served arm's own `state_restore`
kernel on every layer (golden: an exact copy; a planted restore bug shows on hits only),
and prefills only the rest. Snapshots are stored as exact copies; entries are evicted least
recently used first under a byte budget (each snapshot's tensor bytes).

The prompt is prefilled page by page so the snapshots exist (the golden's state is explicit,
so this is bit-identical to one piece on CPU); `chunk_boundary` runs where the one-piece
prefill would run it (every `chunk_tokens` from position 0), so a cold request's arithmetic
is the same as without the cache, for every arm."""
from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from reference_model.model import SequenceState
from reference_model.state import state_bytes

DEFAULT_PAGE_SIZE = 64
DEFAULT_BUDGET = 1 << 30


def page_keys(arm: str, ids, page: int) -> list[bytes]:
    """Keys of every full page of `ids`: key k names ids[:(k+1)*page] on this arm."""
    keys, h = [], hashlib.sha256(arm.encode()).digest()
    for a in range(0, len(ids) - len(ids) % page, page):
        h = hashlib.sha256(h + b"".join(int(i).to_bytes(4, "little") for i in ids[a:a + page])).digest()
        keys.append(h)
    return keys


@dataclass
class _Entry:
    state: SequenceState
    nbytes: int


class PrefixCache:
    """Snapshots of SequenceState at page boundaries, LRU under a byte budget; shared by
    the served arms (the arm is part of every key). Thread-safe: the model's worker thread
    reads and fills it, a flush route clears it."""

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE, budget: int = DEFAULT_BUDGET):
        if page_size < 1:
            raise ValueError(f"--page-size must be at least 1 token (got {page_size})")
        if budget < 1:
            raise ValueError(f"--prefix-cache-bytes must be at least 1 (got {budget}); "
                             "use --no-prefix-cache to serve without a prefix cache")
        self.page, self.budget = page_size, budget
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "hit_tokens": 0, "stored": 0, "evicted": 0,
                      "flushes": 0}

    def lookup(self, keys: list[bytes], n_prompt: int, limit: int) -> tuple[int, SequenceState | None]:
        """The longest cached prefix (tokens, stored state) among `keys` that is shorter than
        the prompt and at most `limit` tokens; (0, None) on a miss. Marks it recently used."""
        best = min((n_prompt - 1) // self.page, max(limit, 0) // self.page, len(keys))
        with self._lock:
            for k in range(best, 0, -1):
                e = self._entries.get(keys[k - 1])
                if e is not None:
                    self._entries.move_to_end(keys[k - 1])
                    self.stats["hits"] += 1
                    self.stats["hit_tokens"] += k * self.page
                    return k * self.page, e.state
            self.stats["misses"] += 1
        return 0, None

    def has(self, key: bytes) -> bool:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            return False

    def put(self, key: bytes, state: SequenceState) -> None:
        """Store an exact copy of `state` (it goes on being extended) and evict to the budget."""
        snap = copy.deepcopy(state)
        n = state_bytes(snap)
        with self._lock:
            if key in self._entries or n > self.budget:
                return
            self._entries[key] = _Entry(snap, n)
            self.bytes += n
            self.stats["stored"] += 1
            while self.bytes > self.budget:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.nbytes
                self.stats["evicted"] += 1

    def clear(self) -> int:
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            self.bytes = 0
            self.stats["flushes"] += 1
            return n

    def snapshot(self) -> dict:
        with self._lock:
            return {"page_size": self.page, "budget_bytes": self.budget, "bytes": self.bytes,
                    "entries": len(self._entries), **self.stats}


def restore(model, stored: SequenceState) -> SequenceState:
    """A cached prefix's state through the arm's own `state_restore` kernel, every layer
    (the golden's copies, so the stored snapshot is never touched). The sequence's other
    fields (V4.1: the Engram history, the last index-key writer) are kept as stored: the
    model replaces them, never writes into them."""
    if hasattr(model, "restore_state"):            # a pipeline model: every rank's layers
        return model.restore_state(stored)
    out = copy.copy(stored)
    out.layers = [model.nx.state_restore(st) for st in stored.layers]
    return out


def paged_prefill(model, ids: torch.Tensor, state: SequenceState, cache: PrefixCache | None,
                  keys: list[bytes], all_logits: bool | str):
    """Prefill ids[state.pos:] from `state` in pieces that end on every page boundary (a
    snapshot there, unless already cached) and every multiple of the model's chunk size
    (`chunk_boundary` there, as the one-piece prefill does). Returns (logits, state): the
    last position's [1, V], or with all_logits every prefilled position's rows, or with
    all_logits="hidden" every prefilled position's residual streams (a speculative
    decoder's MTP reads them)."""
    mode = "hidden" if all_logits == "hidden" else ("all" if all_logits else "last")
    n, start = len(ids), state.pos
    page = cache.page if cache is not None else n
    chunk = model.chunk_tokens
    cuts = sorted({b for b in range(page, n, page) if b > start}
                  | {b for b in range(chunk, n, chunk) if b > start} | {n})
    parts, pos = [], start
    for b in cuts:
        if pos > start and pos % chunk == 0:
            if hasattr(model, "chunk_boundary_state"):       # a pipeline model: every rank's layers
                state = model.chunk_boundary_state(state)
            else:
                state.layers = [model.nx.chunk_boundary(st) for st in state.layers]
        logits, state = model.extend(ids[pos:b], state, mode, phase="prefill")
        if all_logits:
            parts.append(logits)
        pos = b
        if cache is not None and b % page == 0 and b // page <= len(keys):
            key = keys[b // page - 1]
            if not cache.has(key):
                cache.put(key, state)
    return (torch.cat(parts, 0) if all_logits else logits), state
