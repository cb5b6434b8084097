"""Engram constants of DeepSeek-V4.1 (docs/v41-architecture.md §5.2): the prime bucket
layout of each Engram layer's hashed table, the odd hash multipliers, and the compressed
token vocabulary the n-grams are hashed over. Derived from the config (and the tokenizer),
not stored in the checkpoint, so a port that derives them differently silently rehashes:
config validation and the checkpoint reader check them against `engram_num_embeddings`."""
from __future__ import annotations

from dataclasses import dataclass

# Release multipliers (doc §5.2; numpy 2.4.6 and five public ports agree). numpy does not
# promise its generator stream across versions, so the release values are carried here and
# only other configs derive theirs. Keyed by (compressed vocab, max n-gram, layer id).
RELEASE_MULTIPLIERS = {
    (99092, 4, 1): (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    (99092, 4, 14): (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}
MULTIPLIER_SEED = 10007          # default_rng(10007 * layer_id)
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)   # deterministic below 3.3e24


class EngramLayoutError(ValueError):
    """The Engram constants of a config do not tie out (primes vs row counts)."""


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n < 3.3e24)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramLayout:
    """Per Engram layer (in `engram_layer_ids` order): primes[l][n-2][head], the flat
    column offsets into the layer's table (columns ordered 2-gram heads, 3-gram heads, ...),
    the table height (sum of the layer's primes) and the N hash multipliers."""
    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]
    multipliers: tuple[tuple[int, ...], ...]

    @property
    def columns(self) -> int:
        """Hashed rows looked up per token per layer: (N-1) n-gram sizes x heads."""
        return (self.max_ngram - 1) * self.n_heads

    def flat_primes(self, k: int) -> tuple[int, ...]:
        return tuple(p for per_n in self.primes[k] for p in per_n)


def bucket_primes(layer_ids, max_ngram: int, n_heads: int, vocab_start: int):
    """REF-E `EngramLayout.from_args`: for each layer, each n-gram size, restart at
    `vocab_start - 1` and take for each head the smallest prime above the last one that no
    earlier (layer, n, head) has taken."""
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        per_layer = []
        for _n in range(2, max_ngram + 1):
            cur, heads = vocab_start - 1, []
            for _h in range(n_heads):
                cur += 1
                while not is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                heads.append(cur)
            per_layer.append(tuple(heads))
        out.append(tuple(per_layer))
    return tuple(out)


def hash_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> tuple[int, ...]:
    """REF-E `compute_hash_multipliers`: odd 2v+1 with v drawn from
    numpy.random.default_rng(10007·layer_id) below max(1, (2^63-1)//C//2), so that
    token·multiplier < 2^63 for every compressed token (int64 never overflows)."""
    key = (compressed_vocab, max_ngram, layer_id)
    if key in RELEASE_MULTIPLIERS:
        return RELEASE_MULTIPLIERS[key]
    import numpy as np
    bound = max(1, (2 ** 63 - 1) // compressed_vocab // 2)
    v = np.random.default_rng(MULTIPLIER_SEED * layer_id).integers(0, bound, size=max_ngram,
                                                                   dtype=np.int64)
    return tuple(int(2 * x + 1) for x in v)


def engram_layout(cfg) -> EngramLayout:
    """The layout of a V41Config (EngramLayoutError if its row counts disagree)."""
    primes = bucket_primes(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                           cfg.engram_vocab_size)
    offsets, rows = [], []
    for per_layer in primes:
        flat = [p for per_n in per_layer for p in per_n]
        acc, offs = 0, []
        for p in flat:
            offs.append(acc)
            acc += p
        offsets.append(tuple(offs))
        rows.append(acc)
    mults = tuple(hash_multipliers(l, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size)
                  for l in cfg.engram_layer_ids)
    return EngramLayout(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                        primes, tuple(offsets), tuple(rows), mults)


def check_rows(cfg, layout: EngramLayout | None = None) -> list[str]:
    """Problems where a layer's primes do not sum to its `engram_num_embeddings` entry."""
    layout = layout or engram_layout(cfg)
    return [f"Engram layer {l}: primes sum to {got}, config engram_num_embeddings says {want}"
            for l, got, want in zip(layout.layer_ids, layout.rows, cfg.engram_num_embeddings)
            if got != want]


# ---- the compressed vocabulary (tokenizer-derived runtime state) ----------------------------
def _normalizer():
    from tokenizers import Regex, normalizers as N
    return N.Sequence([N.NFKC(), N.NFD(), N.StripAccents(), N.Lowercase(),
                       N.Replace(Regex(r"[ \t\r\n]+"), " "), N.Replace(Regex(r"^ $"), "\ue000"),
                       N.Strip(), N.Replace("\ue000", " ")])


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """REF-E `build_compressed_token_map`: token id -> compressed id, and the compressed
    vocabulary size C. A token decoding to a partial UTF-8 sequence (U+FFFD) keys on its
    raw token string; otherwise on its normalised text (NFKC, NFD, accents stripped,
    lowercase, whitespace runs -> one space, a lone space kept, stripped) or the text when
    that is empty. Keys get ids in order of first appearance. `tokenizer`: a `tokenizers`
    Tokenizer (the backend of an HF tokenizer)."""
    norm = _normalizer()
    ids: dict[str, int] = {}
    out = []
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)
