"""Quantisation-aware training: the weights the forward sees are the trainable fp32 masters
snapped onto the grids the checkpoint writer stores (FP8 e4m3 with 128×128 E8M0 scales, FP4
e2m1 with 1×32 E8M0 scales, bf16), with straight-through gradients. The grid values come
from the writer's own encoder + the reader's decoder, so what is trained is bit for bit
what is shipped.

Activations: `qat_numerics()` is the `reference` profile (bf16 storage, FP8 act-quant, FP8
KV, FP4 indexer) computed in fp32. Its casts and FP8 round trips already pass gradients
straight through; the FP4 e2m1 rounding does not (a table lookup), so the two indexer
kernels get an explicit straight-through wrapper."""
from __future__ import annotations

import torch

from reference_model import quant as Q
from reference_model.checkpoint import decode_fp4, decode_fp8, encode_fp4, encode_fp8
from reference_model.numerics import Numerics
from reference_model.specs import BF16, FP4, FP8, TensorSpec


def ste(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Forward value q, gradient of w."""
    return w + (q - w).detach()


@torch.no_grad()
def to_grid(spec: TensorSpec, w: torch.Tensor) -> torch.Tensor:
    """The value the shipped checkpoint holds for master weight w (fp32)."""
    if spec.fmt == FP8:
        return decode_fp8(*encode_fp8(w.detach().float())).float()
    if spec.fmt == FP4:
        return decode_fp4(*encode_fp4(w.detach().float())).float()
    if spec.fmt == BF16:
        return w.detach().to(torch.bfloat16).float()
    return w.detach()


def _pow2_at_least(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Smallest power of two s with amax <= top·s (the writer's scale rule; 1 for zero
    blocks), exactly, via frexp."""
    m, e = torch.frexp(amax / top)
    k = torch.where(m == 0.5, e - 1, e)
    return torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), k), torch.ones_like(amax))


@torch.no_grad()
def fake_fp8(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """to_grid for FP8 without the byte encoding (same values; tested)."""
    out, inp = w.shape
    wp = torch.nn.functional.pad(w, (0, -inp % block, 0, -out % block))
    amax = wp.unflatten(0, (-1, block)).unflatten(2, (-1, block)).abs().amax(dim=(1, 3))
    s = _pow2_at_least(amax, Q.FP8_MAX)
    se = s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return (w / se).clamp(-Q.FP8_MAX, Q.FP8_MAX).to(torch.float8_e4m3fn).float() * se


@torch.no_grad()
def fake_fp4(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """to_grid for FP4 (any leading dims, last dim a multiple of 32; tested)."""
    wb = w.unflatten(-1, (-1, block))
    s = _pow2_at_least(wb.abs().amax(-1, keepdim=True), Q.FP4_MAX)
    return (Q.round_to_e2m1((wb / s).clamp(-Q.FP4_MAX, Q.FP4_MAX)) * s).flatten(-2)


def effective_weights(params: dict, specs: dict[str, TensorSpec], buffers: dict) -> dict:
    """Name -> tensor as the forward consumes it: grid values with STE gradients. FP4
    tensors of equal shape are quantised in one stacked call (speed)."""
    out = dict(buffers)
    fp4: dict[tuple, list[str]] = {}
    for name, w in params.items():
        f = specs[name].fmt
        if f == FP8:
            out[name] = ste(w, fake_fp8(w.detach()))
        elif f == FP4:
            fp4.setdefault(tuple(w.shape), []).append(name)
        elif f == BF16:
            out[name] = ste(w, w.detach().to(torch.bfloat16).float())
        else:
            out[name] = w
    for names in fp4.values():
        q = fake_fp4(torch.stack([params[n].detach() for n in names]))
        for n, qi in zip(names, q):
            out[n] = ste(params[n], qi)
    return out


def _ste_kernel(name):
    exact = Numerics("exact")

    def fn(golden, x, *a):
        return ste(getattr(exact, name)(x, *a), getattr(golden, name)(x.detach(), *a))
    return fn


def qat_numerics() -> Numerics:
    """`reference` numerics in fp32 with straight-through FP4 indexer kernels."""
    return Numerics("reference", compute_dtype=torch.float32).with_kernels(
        "qat-ste", index_query=_ste_kernel("index_query"), index_key_store=_ste_kernel("index_key_store"))
