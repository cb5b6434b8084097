"""Validation of a DeepSeek-V4.1 config (docs/v41-architecture.md §2, §11): what V4.1 adds to
the checks both versions make (config_base.common_checks): ratios 0/1/2 only, 32x32 weight
blocks, KV / index / candidate sources that fit the layer layout, Engram constants whose
bucket primes fill the tables. Each failure names the field."""
from __future__ import annotations

from ..config_base import ConfigError, common_checks, positive_int_errors
from .engram import check_rows

WEIGHT_BLOCK = 32                 # FP8 weight blocks 32x32, activation quant 1x32 (doc §4)
RATIOS = (0, 1, 2)


def validate(c):
    errs = positive_int_errors(c)
    if errs:
        raise ConfigError("invalid V4.1 config: " + "; ".join(errs))
    bs = c.weight_block_size
    checks = [
        (bs == WEIGHT_BLOCK, f"weight_block_size must be 32 (DeepSeek-V4.1), got {bs}"),
        (c.rope_head_dim % 2 == 0 and c.rope_head_dim < min(c.head_dim, c.index_head_dim),
         f"rope_head_dim ({c.rope_head_dim}) must be even and below head_dim ({c.head_dim}) "
         f"and index_head_dim ({c.index_head_dim})"),
        (c.head_dim % 32 == 0, f"head_dim ({c.head_dim}) must be a multiple of 32 (window KV "
                               "FP8 blocks; compressed KV FP4 blocks of 16)"),
        (c.index_head_dim % 32 == 0,
         f"index_head_dim ({c.index_head_dim}) must be a multiple of 32 (FP4 blocks)"),
        (c.n_heads % c.o_groups == 0, f"n_heads ({c.n_heads}) must be divisible by o_groups ({c.o_groups})"),
        (c.dim % 32 == 0 and c.moe_inter_dim % 32 == 0,
         f"dim ({c.dim}) and moe_inter_dim ({c.moe_inter_dim}) must be multiples of 32 "
         "(activation quantisation and FP4 expert blocks)"),
        (c.score_func == "sqrtsoftplus", f"score_func must be sqrtsoftplus, got {c.score_func!r}"),
        (c.gate_temp > 0, f"gate_temp must be > 0, got {c.gate_temp}"),
        (all(r == 0 for r in c.draft_ratios) and len(c.draft_ratios) in (0, c.n_mtp_layers),
         f"draft_ratios {list(c.draft_ratios)} must be {c.n_mtp_layers} zeros (or absent)"),
    ] + common_checks(c)
    errs = [msg for ok, msg in checks if not ok]
    bad = [f"compress_ratios[{i}] = {r}: DeepSeek-V4.1 supports 0, 1, 2"
           for i, r in enumerate(c.compress_ratios) if r not in RATIOS]
    errs += bad
    if not bad and len(c.compress_ratios) == c.n_layers:
        errs += source_problems(c)
    errs += engram_problems(c)
    if errs:
        raise ConfigError("invalid V4.1 config: " + "; ".join(errs))
    return c


def source_problems(c) -> list[str]:
    """Doc §11: every layer with ratio > 0 must find a KV source and an index source of its
    ratio at or before it; sources are backbone layers with ratio > 0; a KV source is also
    an index source (its indexer builds the keys later index sources score against); the
    candidate source is an index source."""
    errs, n, r = [], c.n_layers, c.compress_ratios
    for name, ids in (("kv_source_layer_ids", c.kv_source_layers),
                      ("index_source_layer_ids", c.index_source_layers)):
        if list(ids) != sorted(set(ids)):
            errs.append(f"{name} {list(ids)} must be strictly increasing")
        for s in ids:
            if not 0 <= s < n:
                errs.append(f"{name} has layer {s}, outside the backbone 0..{n - 1}")
            elif r[s] == 0:
                errs.append(f"{name} has layer {s}, whose compress ratio is 0")
    if errs:
        return errs
    for s in c.kv_source_layers:
        if s not in c.index_source_layers:
            errs.append(f"KV source layer {s} is not an index source (its indexer owns the "
                        "keys later index sources score against)")
    for s in c.index_source_layers:
        kv = c.kv_source(s)
        if kv is None:
            errs.append(f"index source layer {s} has no KV source at or before it")
    for i in range(n):
        if r[i] == 0:
            continue
        kv = c.kv_source(i)
        if kv is None:
            errs.append(f"layer {i} (ratio {r[i]}) has no KV source at or before it")
        elif r[kv] != r[i]:
            errs.append(f"layer {i} has ratio {r[i]} but reads KV source layer {kv} of ratio "
                        f"{r[kv]}")
        if c.index_source(i) is None and kv is not None:
            errs.append(f"layer {i} (ratio {r[i]}) has no index source at or before it")
    cs = c.candidate_source_layer
    if cs >= 0:
        if cs not in c.index_source_layers:
            errs.append(f"candidate_source_layer_id {cs} is not an index source")
        if c.candidate_topk_blocks <= 0 or c.candidate_block_size <= 0:
            errs.append(f"candidate_topk_blocks ({c.candidate_topk_blocks}) and "
                        f"candidate_block_size ({c.candidate_block_size}) must be positive")
    return errs


def engram_problems(c) -> list[str]:
    """Engram constants: layers in range, one row count per layer, shapes on the 32-grid,
    and each layer's bucket primes summing to its row count (doc §5.2)."""
    if not c.engram_layer_ids:
        return []
    errs = []
    ids = list(c.engram_layer_ids)
    if ids != sorted(set(ids)) or not all(0 <= i < c.n_layers for i in ids):
        errs.append(f"engram_layer_ids {ids} must be increasing backbone layers 0..{c.n_layers - 1}")
    if len(c.engram_num_embeddings) != len(ids):
        errs.append(f"engram_num_embeddings has {len(c.engram_num_embeddings)} entries for "
                    f"{len(ids)} Engram layers")
    for f in ("engram_vocab_size", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
              "engram_compressed_vocab_size"):
        v = getattr(c, f)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            errs.append(f"{f} must be a positive int, got {v!r}")
    if errs:
        return errs
    if c.engram_max_ngram_size < 2:
        errs.append(f"engram_max_ngram_size must be >= 2, got {c.engram_max_ngram_size}")
    if c.engram_head_dim % 32:
        errs.append(f"engram_head_dim ({c.engram_head_dim}) must be a multiple of 32 (E8M0 row scales)")
    if not 0 <= c.engram_pad_id < c.vocab_size:
        errs.append(f"engram pad id {c.engram_pad_id} outside the vocabulary 0..{c.vocab_size - 1}")
    if not errs:
        errs += check_rows(c)
    return errs


