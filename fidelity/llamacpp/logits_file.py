"""llama.cpp's log-probability file, the one `llama-perplexity --kl-divergence-base FILE`
writes and `llama-perplexity --kl-divergence` reads (tools/perplexity/perplexity.cpp, read
there, written here independently):

  b"_logits_", uint32 n_ctx, int32 n_vocab, int32 n_chunk,
  int32 tokens[n_chunk * n_ctx]                (chunk c is tokens[c*n_ctx:(c+1)*n_ctx]; its
                                                first token is evaluated as BOS when the
                                                model adds BOS)
  per chunk, per position p in [n_ctx/2, n_ctx-2] (the distribution after token p):
      float32 scale, float32 min_log_prob (as four uint16), uint16 q[n_vocab] (+1 pad when
      n_vocab is odd)
      log p(i) = scale * q[i] + min_log_prob   (q = 0 below max - 16: a floor, not a value)

Writing the golden's distributions in it lets a llama.cpp user run llama.cpp's own KLD tool
against the golden; reading one that llama.cpp wrote gives llama.cpp's prefill-path
distributions (llama-perplexity evaluates whole batches), the reading llama-server cannot
give."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"_logits_"
SPAN = 16.0                        # log-prob range kept below the top (llama.cpp's choice)


class LogitsFileError(ValueError):
    pass


def row_width(n_vocab: int) -> int:
    """uint16 values per row: 4 for the two float32 header values (8 bytes), the vocabulary
    rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def first_scored(n_ctx: int) -> int:
    """The first position a chunk scores: llama-perplexity scores the second half only."""
    return n_ctx // 2


def quantize_row(logits: np.ndarray) -> np.ndarray:
    """One row of uint16 from logits (or log-probs: only differences matter), in float32
    as llama.cpp computes it."""
    x = np.asarray(logits, np.float32)
    top = x.max()
    low = max(x.min(), top - np.float32(SPAN))
    lse = np.float32(np.log(np.exp((x - top).astype(np.float64)).sum()))
    min_log_prob = np.float32(low - top - lse)
    scale = np.float32((top - low) / np.float32(65535.0))
    out = np.zeros(row_width(len(x)), np.uint16)
    out[:4].view(np.float32)[:] = [scale, min_log_prob]
    if scale:
        q = np.rint((x - low) * (np.float32(1.0) / scale))
        out[4:4 + len(x)] = np.where(x > low, q, 0).astype(np.uint16)
    return out


def dequantize_row(row: np.ndarray, n_vocab: int) -> np.ndarray:
    """Log-probs (float64) of one row, as llama.cpp reads them."""
    scale, min_log_prob = row[:4].view(np.float32)[:2].astype(np.float64)
    return scale * row[4:4 + n_vocab].astype(np.float64) + min_log_prob


@dataclass
class LogitsFile:
    """A file's header and tokens; `rows(c)` yields chunk c's n_ctx - 1 - n_ctx/2 rows as
    log-probs, one at a time (a memory map: a 129K vocabulary never holds a whole chunk)."""
    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray                  # (n_chunk, n_ctx) int32

    @property
    def per_chunk(self) -> int:
        return self.n_ctx - 1 - first_scored(self.n_ctx)

    def rows(self, c: int):
        if not 0 <= c < self.n_chunk:
            raise IndexError(c)
        nv = row_width(self.n_vocab)
        start = 20 + 4 * self.n_ctx * self.n_chunk + 2 * c * self.per_chunk * nv
        m = np.memmap(self.path, np.uint16, "r", start, (self.per_chunk, nv))
        for r in m:
            yield dequantize_row(np.asarray(r), self.n_vocab)


def read(path) -> LogitsFile:
    """The header and tokens of a logits file, checked against its size (a truncated or
    foreign file is an error naming what is wrong)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(20)
        if len(head) < 20 or head[:8] != MAGIC:
            raise LogitsFileError(f"{path} is not a llama.cpp logits file (no {MAGIC!r} header)")
        n_ctx = int(np.frombuffer(head, "<u4", 1, 8)[0])
        n_vocab, n_chunk = (int(v) for v in np.frombuffer(head, "<i4", 2, 12))
        if n_ctx < 4 or n_vocab < 2 or n_chunk < 1:
            raise LogitsFileError(f"{path}: implausible header n_ctx={n_ctx} n_vocab={n_vocab} n_chunk={n_chunk}")
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), "<i4")
    lf = LogitsFile(path, n_ctx, n_vocab, n_chunk, tokens.reshape(n_chunk, n_ctx) if tokens.size == n_ctx * n_chunk
                    else tokens)
    want = 20 + 4 * n_ctx * n_chunk + 2 * n_chunk * lf.per_chunk * row_width(n_vocab)
    size = path.stat().st_size
    if tokens.size != n_ctx * n_chunk or size < want:
        raise LogitsFileError(f"{path} is truncated: {size} bytes, its header (n_ctx {n_ctx}, "
                              f"{n_chunk} chunks, vocabulary {n_vocab}) needs {want}")
    return lf


def write(path, tokens: np.ndarray, n_vocab: int, chunk_logits) -> Path:
    """Write `tokens` (n_chunk, n_ctx) and, per chunk, its logits at positions
    n_ctx/2 .. n_ctx-2 (`chunk_logits(c)` -> an iterable of n_ctx - 1 - n_ctx/2 rows of
    n_vocab), written to a temporary name and renamed when whole."""
    path, tokens = Path(path), np.asarray(tokens, np.int32)
    tmp = path.with_name(path.name + ".part")
    try:
        _write(tmp, tokens, n_vocab, chunk_logits)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return path


def _write(tmp: Path, tokens: np.ndarray, n_vocab: int, chunk_logits) -> None:
    n_chunk, n_ctx = tokens.shape
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(np.array([n_ctx], "<u4").tobytes() + np.array([n_vocab, n_chunk], "<i4").tobytes())
        f.write(tokens.astype("<i4").tobytes())
        want = n_ctx - 1 - first_scored(n_ctx)
        for c in range(n_chunk):
            n = 0
            for r in chunk_logits(c):
                if len(r) != n_vocab:
                    raise LogitsFileError(f"chunk {c} row {n}: {len(r)} logits, vocabulary {n_vocab}")
                f.write(quantize_row(r).astype("<u2").tobytes())
                n += 1
            if n != want:
                raise LogitsFileError(f"chunk {c}: {n} rows, expected {want} (positions "
                                      f"{first_scored(n_ctx)}..{n_ctx - 2})")
