"""The weights a training run starts from and the weights it ships: fresh masters
(init_params), a warm start from a shipped checkpoint (init_from_checkpoint), and the
masters snapped onto the checkpoint grids (grid_weights)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from reference_model import InMemoryWeights
from reference_model.config import ModelConfig
from reference_model.specs import F32, I64, all_specs

from .qat import to_grid


def init_params(cfg: ModelConfig, seed: int):
    """Master weights (fp32 leaves) and fixed buffers (hash routing table), keyed by native
    name. Residual-friendly: mHC starts as 'average the streams in, add the block output to
    every stream, keep each stream' (mixing GEMMs near zero), output projections small."""
    g = torch.Generator().manual_seed(seed)
    hc = cfg.hc_mult
    params, buffers = {}, {}
    for s in all_specs(cfg):
        n, shape = s.name, s.shape
        if s.fmt == I64:                                    # tid2eid: distinct experts per token
            rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]] for _ in range(shape[0])]
            buffers[n] = torch.stack(rows).long()
            continue
        if n.endswith("norm.weight"):
            t = torch.ones(shape)
        elif n.endswith("_fn"):
            t = torch.randn(shape, generator=g) * (0.02 / math.sqrt(shape[1]))
        elif n.endswith("_scale"):
            t = torch.ones(shape)
        elif n.endswith("hc_head_base"):
            t = torch.zeros(shape)
        elif n.endswith("_base"):
            t = torch.zeros(shape)
            t[:hc] = math.log(1 / (hc - 1))                  # sigmoid = 1/hc: mean of the streams
            t[2 * hc:] = 4.0 * torch.eye(hc).flatten()        # comb ~ identity
        elif n.endswith(("attn_sink", "ape", "gate.bias")):
            t = torch.zeros(shape)
        elif n == "embed.weight":
            t = torch.randn(shape, generator=g)
        else:                                               # linear [out, in]
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            if n.endswith(("wo_b.weight", "w2.weight")):
                t = t / math.sqrt(2 * cfg.n_layers)
        params[n] = t.float().requires_grad_(True)
    return params, buffers


def init_from_checkpoint(cfg: ModelConfig, path):
    """Warm start (--init-from): the masters are a shipped checkpoint's dequantised weights
    (fp32; they already sit on their grids, so the first forward sees exactly that
    checkpoint), the buffers (hash routing table) are the checkpoint's. `cfg` may differ
    from the checkpoint's config only in name and index_topk (no weight shape depends on
    them)."""
    from reference_model.checkpoint import load_checkpoint
    w = load_checkpoint(Path(path))
    if w.cfg.replace(name=cfg.name, index_topk=cfg.index_topk) != cfg:
        raise ValueError(f"--init-from {path}: its config differs from {cfg.name}'s beyond "
                         "name and index_topk")
    params, buffers = {}, {}
    for s in all_specs(cfg):
        t = w.tensors[s.name]
        if s.fmt == I64:
            buffers[s.name] = t.long().clone()
        else:
            params[s.name] = t.float().clone().requires_grad_(True)
    return params, buffers


def grid_weights(cfg, params, buffers) -> InMemoryWeights:
    """The shipped weights: masters snapped onto the checkpoint grids, in the in-memory
    dtypes of the reader (bf16 for FP8/FP4/bf16 tensors, fp32, int64)."""
    specs = {s.name: s for s in all_specs(cfg)}
    t = dict(buffers)
    for n, w in params.items():
        v = to_grid(specs[n], w)
        t[n] = v.float() if specs[n].fmt == F32 else v.to(torch.bfloat16)
    return InMemoryWeights(cfg, t)
