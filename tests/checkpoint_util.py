"""Test helpers that turn a saved DeepSeek-native checkpoint into the other layouts
(docs/weight-formats.md): rewrite every shard through a function, dequantised floats,
and NVIDIA ModelOpt NVFP4 routed experts."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from reference_model import quant as Q
from reference_model.checkpoint_format import INDEX_NAME, is_routed_expert


def rewrite_shards(ck, fn) -> None:
    """Apply fn(name, tensor) -> {name: tensor} to every tensor of every shard of `ck`
    (return {} to drop one) and rebuild the index."""
    wm = {}
    for shard in sorted(ck.glob("*.safetensors")):
        out = {}
        for n, t in load_file(shard).items():
            out.update(fn(n, t))
        save_file(out, shard)
        wm.update({n: shard.name for n in out})
    (ck / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def nvfp4_cast(values: torch.Tensor, global_scale: float = 1.0):
    """ModelOpt NVFP4 entries for FP4-grid values (e2m1 x 2^k per 32): the same codes, the
    power-of-two block scale per 16 as e4m3 (exact), the given global scale."""
    codes, s32 = Q.quantize_fp4_weight(values.float())
    s16 = s32.repeat_interleave(2, -1).to(torch.float8_e4m3fn)
    assert torch.equal(s16.float(), s32.repeat_interleave(2, -1))
    return Q.pack_fp4(codes).view(torch.uint8), s16, torch.tensor(float(global_scale)), torch.tensor(0.5)


def to_nvfp4(tensors: dict, global_scale: float = 1.0, edit=None):
    """A rewrite_shards function turning routed experts into NVFP4 entries (their E8M0
    `.scale` dropped); `edit(name, entries)` may alter an expert's entries (bad input)."""
    def fn(n, t):
        if n.endswith(".scale") and is_routed_expert(n[: -len(".scale")] + ".weight"):
            return {}
        if not is_routed_expert(n):
            return {n: t}
        p, s16, g, inp = nvfp4_cast(tensors[n], global_scale)
        base = n[: -len(".weight")]
        e = {n: p, base + ".weight_scale": s16, base + ".weight_scale_2": g, base + ".input_scale": inp}
        return edit(n, e) if edit else e
    return fn


def to_dense(tensors: dict, dtype=torch.float32):
    """A rewrite_shards function storing the bf16 (incl. dequantised) tensors as `dtype`
    with no scales; fp32 tensors stay fp32."""
    def fn(n, t):
        if n.endswith(".scale"):
            return {}
        v = tensors[n]
        return {n: v.to(dtype) if v.dtype == torch.bfloat16 else t}
    return fn


def set_byte(root, name: str, index: tuple, value: int):
    """Overwrite one byte-sized element of tensor `name` in its shard of the checkpoint at
    `root` (e.g. a NaN code, bad input for a reader); returns the shard's path."""
    shard = root / json.loads((root / INDEX_NAME).read_text())["weight_map"][name]
    d = load_file(shard)
    raw = d[name].view(torch.uint8).clone()
    raw[index] = value
    d[name] = raw.view(d[name].dtype)
    save_file(d, str(shard))
    return shard


def tiny_mtp_checkpoint(root):
    """The tiny random V4 checkpoint (seed 0) with a random MTP layer (seed 3) added as its
    own shard: what the speculative-decoding tests serve."""
    from reference_model import random_weights, tiny
    from reference_model.checkpoint_write import save_checkpoint
    from reference_model.mtp import random_mtp_weights
    from reference_model.mtp_write import add_mtp_layer
    save_checkpoint(random_weights(tiny(), 0), root)
    add_mtp_layer(root, random_mtp_weights(tiny(), 0, seed=3))
    return root
