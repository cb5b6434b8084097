"""A checkpoint with its attention heads widened (e.g. head_dim 128 -> 512, the released
constant), computing the same function, for engines that cannot run the narrow one.

Why: llama.cpp b11434 cannot load a DeepSeek-V4 whose head_dim equals index_head_dim (our
tiny models: 128 and 128). Its KV cache constructor forces the indexer's Hadamard rotation
whenever `n_embd_head_k_full == indexer_head_size`, also for the iSWA pair's empty non-SWA
cache (every V4 layer is SWA), whose head size stays 0; `while (0 % (2*n_rot_k) == 0)
n_rot_k *= 2` then doubles until the uint32 wraps to 0 and the modulo divides by zero
(SIGFPE while loading, src/llama-kv-cache.cpp). The released models (512 vs 128) never
reach it.

The widening inserts zero dims between each head's no-RoPE and RoPE parts, so:
  q, kv, compressed kv: zeros there (zero weight rows), the RoPE dims still last;
  the weights feeding q's per-head RMS rescale and the kv / compressor RMSNorms are doubled
  (FP8 scale exponents + 1; bf16 x 2), so their mean over 4x the dims -- and the eps added
  to it -- is the old one; the norm weights are halved, q comes out doubled, and the
  softmax scale head_dim^-0.5 halves: q.k * scale is unchanged, every factor a power of two;
  the FP8 KV round trip (1x64 blocks) sees the same blocks plus all-zero ones;
  wo_a gets zero columns for the zero output dims.
FP8 weights keep their values and block scales (a widened 128-row block takes the scale of
the block its rows came from), so nothing is re-quantised."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = 128                                  # FP8 weight block (rows x columns)
E8M0_ONE = 127                               # scale 2^0 for all-zero blocks
COPY = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class PadError(ValueError):
    pass


def dim_map(heads: int, hd: int, wide: int, rope: int) -> torch.Tensor:
    """For each widened dim, the old dim it holds (-1: a zero dim): per head, the no-RoPE
    dims first, zeros, the RoPE dims last."""
    out = torch.full((heads * wide,), -1, dtype=torch.long)
    nope = hd - rope
    for h in range(heads):
        out[h * wide:h * wide + nope] = torch.arange(h * hd, h * hd + nope)
        out[(h + 1) * wide - rope:(h + 1) * wide] = torch.arange(h * hd + nope, (h + 1) * hd)
    return out


def _take(t: torch.Tensor, m: torch.Tensor, dim: int) -> torch.Tensor:
    """t with `dim` re-indexed by m (-1: zeros), in t's own dtype."""
    src = t.view(torch.uint8) if t.dtype.itemsize == 1 else t      # fp8 / e8m0: move the bytes
    shape = list(src.shape)
    shape[dim] = len(m)
    out = torch.zeros(shape, dtype=src.dtype)
    keep = m >= 0
    idx = [slice(None)] * src.dim()
    idx[dim] = keep.nonzero().squeeze(1)
    out[tuple(idx)] = src.index_select(dim, m[keep])
    return out.view(t.dtype) if t.dtype.itemsize == 1 else out


def block_map(m: torch.Tensor) -> torch.Tensor:
    """Per widened 128-block, the old block its dims come from (-1: all zeros); a block
    drawing on two old blocks would need re-quantising, which is refused."""
    out = []
    for b in range(0, len(m), BLOCK):
        src = {int(v) // BLOCK for v in m[b:b + BLOCK] if v >= 0}
        if len(src) > 1:
            raise PadError(f"widened block {b // BLOCK} mixes old blocks {sorted(src)}")
        out.append(src.pop() if src else -1)
    return torch.tensor(out, dtype=torch.long)


def _fp8(tensors: dict, name: str, m: torch.Tensor, dim: int, up: int = 0) -> None:
    """An FP8 weight and its block scales widened along `dim` (0 rows, 1 columns), its
    values times 2^up (the E8M0 scale exponents raised: exact)."""
    w, s = tensors[name + ".weight"], tensors[name + ".scale"]
    bm = block_map(m)
    scale = _take(s, bm, dim)
    scale.view(torch.uint8).add_(up)
    pad = (bm < 0).nonzero().squeeze(1)
    scale.view(torch.uint8).index_fill_(dim, pad, E8M0_ONE)
    tensors[name + ".weight"], tensors[name + ".scale"] = _take(w, m, dim), scale


def widen(tensors: dict, cfg: dict, wide: int) -> dict:
    """The widened tensors (in place) of a DeepSeek-native checkpoint with HF config `cfg`."""
    hd, rope, heads = cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["num_attention_heads"]
    factor = wide // hd
    if wide % hd or factor < 4 or factor & (factor - 1) or factor.bit_length() % 2 == 0:
        raise PadError(f"head_dim {hd} -> {wide}: the factor must be 4, 16, ... (its square "
                       "root a power of two, so the rescales are exact)")
    up = (factor.bit_length() - 1) // 2                  # log2 sqrt(factor): 1 for 4x
    per_group = heads // cfg["o_groups"]
    # the main layers and the MTP layers (window-only: no compressor), so the widened
    # checkpoint's MTP computes the same function too
    for p in ([f"layers.{i}.attn." for i in range(cfg["num_hidden_layers"])]
              + [f"mtp.{k}.attn." for k in range(cfg.get("num_nextn_predict_layers") or 0)]):
        _fp8(tensors, p + "wq_b", dim_map(heads, hd, wide, rope), 0, up)
        _fp8(tensors, p + "wkv", dim_map(1, hd, wide, rope), 0, up)
        _fp8(tensors, p + "wo_a", dim_map(per_group, hd, wide, rope), 1)
        for norm in (p + "kv_norm.weight", p + "compressor.norm.weight"):
            if norm in tensors:
                tensors[norm] = (_take(tensors[norm].float(), dim_map(1, hd, wide, rope), 0)
                                 / 2 ** up).to(tensors[norm].dtype)
        if p + "compressor.wkv.weight" in tensors:
            coff = tensors[p + "compressor.wkv.weight"].shape[0] // hd
            m = dim_map(coff, hd, wide, rope)
            for n, d in (("wkv.weight", 0), ("wgate.weight", 0), ("ape", 1)):
                tensors[p + "compressor." + n] = _take(tensors[p + "compressor." + n], m, d)
            kv = tensors[p + "compressor.wkv.weight"]
            tensors[p + "compressor.wkv.weight"] = (kv.float() * 2 ** up).to(kv.dtype)
    return tensors


def pad_checkpoint(src: Path, out: Path, wide: int = 512) -> Path:
    """Write `src` widened to head_dim `wide` into `out` (one shard, config and tokenizer
    copied, PADDED.json saying from what)."""
    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    widen(tensors, cfg, wide)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")      # concurrent writers never share one
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shard = "model-00001-of-00001.safetensors"
    save_file(tensors, tmp / shard, metadata={"format": "pt"})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: shard for n in sorted(tensors)}}, indent=1))
    (tmp / "config.json").write_text(json.dumps({**cfg, "head_dim": wide}, indent=2))
    for f in COPY:
        if (src / f).is_file():
            shutil.copy(src / f, tmp / f)
    (tmp / "PADDED.json").write_text(json.dumps({"source": src.name, "head_dim": [cfg["head_dim"], wide],
                                                 "why": "llama.cpp b11434 cannot load head_dim == index_head_dim"}))
    try:
        tmp.rename(out)
    except OSError:                                # another process finished it first
        shutil.rmtree(tmp)
    return out
