"""Engine kernel numerics as plain functions of tensors (no model, no registry), so each
can be checked on small hand-made inputs.

Convention (same as reference_model.numerics): math runs in a compute dtype `cd` (fp64 or
fp32) and values are rounded explicitly where the engine stores them: `bf16(x)` for bf16
buffers, `f32(x)` for fp32 buffers/registers. An engine's fp32 accumulation is therefore
emulated as a wide sum rounded once to fp32 (summation order is not modelled)."""
from __future__ import annotations

import numpy as np
import torch

from reference_model import quant as Q
from reference_model import primitives as P

FP8_MAX = Q.FP8_MAX
FP8_AMAX_FLOOR = Q.FP8_AMAX_FLOOR


def bf16(x: torch.Tensor, cd=None) -> torch.Tensor:
    """Round to bf16, return in `cd` (default: x's dtype)."""
    return x.to(torch.bfloat16).to(cd or x.dtype)


def f32(x: torch.Tensor, cd=None) -> torch.Tensor:
    """Round to fp32, return in `cd` (default: x's dtype)."""
    return x.float().to(cd or x.dtype)


def tf32(w: torch.Tensor, rounding: str = "truncate") -> torch.Tensor:
    """fp32 values on the TF32 grid (10 explicit mantissa bits), as fp32. 'truncate' drops
    the low 13 bits (what tensor cores do with raw fp32 operands); 'nearest' rounds to
    nearest, ties to even."""
    b = w.float().contiguous().view(torch.int32)
    if rounding == "nearest":
        lsb = (b >> 13) & 1
        b = b + 0x0FFF + lsb
    elif rounding != "truncate":
        raise ValueError(f"tf32 rounding must be 'truncate' or 'nearest', got {rounding!r}")
    return (b & ~0x1FFF).view(torch.float32)


# ---- FP8 per-token (indexer cache) --------------------------------------------------------
def fp8_token_quant(x: torch.Tensor, scale_fmt: str = "fp32"):
    """One e4m3 block per row (the whole last dim): amax floored at 1e-4, scale =
    amax/448 as a plain fp32 number ('fp32', SGLang's "use normal fp32 scale") or rounded
    up to a power of two ('pow2', vLLM). Returns (codes as fp32 values, scale [..., 1])."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    s = amax / FP8_MAX
    if scale_fmt == "pow2":
        s = Q.pow2_ceil(s)
    elif scale_fmt != "fp32":
        raise ValueError(f"scale_fmt must be 'fp32' or 'pow2', got {scale_fmt!r}")
    codes = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return codes, s


def pack_codes(codes: torch.Tensor, scale: torch.Tensor, cd) -> torch.Tensor:
    """[..., d] codes + [..., 1] scale -> [..., d+1]: the engines' "d fp8 bytes + one fp32
    scale per token" cache row, carried through the model as one tensor."""
    return torch.cat([codes, scale], -1).to(cd)


def unpack_codes(packed: torch.Tensor):
    return packed[..., :-1], packed[..., -1:]


def fp8_index_logits(q_codes, q_scale, k_codes, k_scale, w, cd=torch.float64):
    """The FP8 MQA-logits contract (DeepGEMM `fp8_paged_mqa_logits`, SGLang's torch
    reference): the query scale is folded into the head weights (fp32), then per head
    relu(q8·K8) × folded weight, summed over heads, times the key's scale; fp32 out.
    q_codes [c,h,d], q_scale [c,h,1], k_codes [n,d], k_scale [n,1], w [c,h] -> [c,n]."""
    wf = f32(w.to(cd) * q_scale.to(cd).squeeze(-1))                       # [c,h]
    dots = f32(torch.einsum("chd,nd->chn", q_codes.to(cd), k_codes.to(cd)))
    per_head = f32(dots.relu() * wf.unsqueeze(-1))
    s = f32(per_head.sum(1))                                              # [c,n]
    return f32(s * k_scale.to(cd).squeeze(-1).unsqueeze(0))


# ---- split-K decode attention -------------------------------------------------------------
def splitk_attention(q, kv, sink, idx, scale, splits: int, cd=torch.float64,
                     round_p=bf16, round_partial=bf16, round_out=bf16):
    """Split-K sparse attention with a log-sum-exp merge.

    The k selected rows are cut into `splits` contiguous chunks (in index order). Per
    chunk: fp32 scores, local max m_s, p = exp(s - m_s), l_s = Σp, acc_s = round_p(p)·V
    (wide accumulate), partial o_s = round_partial(acc_s / l_s), lse_s = m_s + log l_s.
    Merge in `cd`: M = max(max_s lse_s, sink), o = Σ e^(lse_s-M) o_s / (Σ e^(lse_s-M) +
    e^(sink-M)) — the sink is added once, here. Empty chunks have lse = -inf.
    Pass None for a rounding to skip it (then, in fp64, this equals the single pass).
    q [c,H,D], kv [N,D], sink [H], idx [c,k] (-1 = empty) -> [c,H,D]."""
    ident = (lambda t: t)
    round_p, round_partial, round_out = (r or ident for r in (round_p, round_partial, round_out))
    c, H, D = q.shape
    k = idx.shape[1]
    qc = q.to(cd)
    step = -(-k // splits) if k else 1
    los, lses = [], []
    for a in range(0, max(k, 1), step):
        ix = idx[:, a:a + step]
        valid = (ix >= 0).unsqueeze(1)                                    # [c,1,ks]
        rows = kv.to(cd)[ix.clamp(min=0)]                                 # [c,ks,D]
        s = torch.einsum("chd,ckd->chk", qc, rows) * scale
        s = s.masked_fill(~valid, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m_safe)                                         # 0 where masked
        l = p.sum(-1, keepdim=True)
        acc = torch.einsum("chk,ckd->chd", round_p(p), rows)
        o = round_partial(torch.where(l > 0, acc / l.clamp_min(1e-300), torch.zeros_like(acc)))
        lse = torch.where(l > 0, m_safe + torch.log(l.clamp_min(1e-300)),
                          torch.full_like(l, float("-inf")))
        los.append(o)
        lses.append(lse)
    O = torch.stack(los, 0)                                               # [S,c,H,D]
    L = torch.stack(lses, 0)                                              # [S,c,H,1]
    sk = sink.to(cd).view(1, H, 1)
    M = torch.maximum(L.amax(0), sk)
    wts = torch.exp(L - M)                                                # 0 for empty
    num = (wts * O).sum(0)
    den = wts.sum(0) + torch.exp(sk - M)
    return round_out(num / den)


# ---- MoE epilogues ------------------------------------------------------------------------
def eager_attention(q, kv, sink, idx, scale, rs, cd=torch.float64):
    """Attention as transformers' eager path computes it: bf16 logits (q·kᵀ rounded to bf16,
    then times `scale` in bf16), the per-head sink appended as one more logit, an fp32
    softmax, the normalised probabilities of the rows rounded to bf16 (the sink's dropped),
    P·V with fp32 accumulation, bf16 out (`rs` rounds to bf16). q [c,H,D], kv [N,D] (K =
    V), sink [H], idx [c,k] (-1 = empty) -> [c,H,D]."""
    q, kv = q.to(cd), kv.to(cd)
    c, k = idx.shape
    rows = kv.index_select(0, idx.clamp(min=0).reshape(-1)).view(c, k, kv.shape[-1])
    s = rs(rs(torch.einsum("chd,ckd->chk", q, rows)) * scale)
    s = s.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
    sinks = sink.to(cd).view(1, -1, 1).expand(c, -1, 1)
    p = f32(torch.softmax(torch.cat([s, sinks], -1), -1))[..., :k]
    return rs(torch.einsum("chk,ckd->chd", rs(p), rows))


def rsf_on_output(routed_sum, shared, rsf: float, mode: str, cd):
    """SGLang's routed-scaling epilogue on bf16 tensors. 'mul_then_add':
    routed = bf16(routed); routed *= rsf (bf16); out = bf16(routed + shared).
    'fused_add': shared.add_(routed, alpha=rsf) — one rounding of shared + rsf·routed."""
    r = bf16(routed_sum.to(cd))
    if mode == "mul_then_add":
        r = bf16(r * rsf)
        return r if shared is None else bf16(r + shared.to(cd))
    if mode == "fused_add":
        return bf16(r * rsf) if shared is None else bf16(shared.to(cd) + rsf * r)
    raise ValueError(f"mode must be 'mul_then_add' or 'fused_add', got {mode!r}")


def splitk_mixes(X: torch.Tensor, fn: torch.Tensor, eps: float, splits: int, round_partial) -> torch.Tensor:
    """The mHC mixing GEMM with K cut in `splits` pieces: each piece's partial product
    rounded by `round_partial` (fp32), the partials summed in that order, each sum rounded
    again, then the RMS scale of the whole row (as the reference computes it)."""
    r = torch.rsqrt(X.square().mean(-1, keepdim=True) + eps)
    acc = None
    for Xs, Fs in zip(X.chunk(splits, -1), fn.chunk(splits, -1)):
        part = round_partial(Xs @ Fs.T)
        acc = part if acc is None else round_partial(acc + part)
    return acc * r


def q8_0(x: torch.Tensor, cd=None) -> torch.Tensor:
    """ggml's Q8_0 quantise-dequantise along the last dim, as its x86 CPU backend does for
    the activations of a quantised-weight GEMM (quantize_row_q8_0): blocks of 32 fp32
    values, id = 127 / amax, codes round(x * id) to nearest-even (_MM_ROUND_NEAREST), the
    block scale amax / 127 stored as fp16; the value is code x fp16 scale."""
    cd = cd or x.dtype
    xf = x.float()
    n = xf.shape[-1]
    if n % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 values, got {n}")
    b = xf.reshape(*xf.shape[:-1], n // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(b * inv)
    d = (amax / 127.0).half().float()
    return (codes * d).reshape(xf.shape).to(cd)


def attention_rotation(head_dim: int, device="cpu") -> torch.Tensor | None:
    """llama.cpp's attention rotation for a quantised K cache (llama-kv-cache.cpp): an
    orthonormal natural-order Walsh-Hadamard matrix of size n, n = 64 doubled while it
    still divides the head twice over (512 for a 512 head); None when the head is not a
    multiple of 64 (llama.cpp then does not rotate)."""
    if head_dim % 64:
        return None
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return P.hadamard_matrix(n, torch.float32, device)


def rotate(x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """x @ h on consecutive blocks of h's size along the last dim, in fp32 (h is symmetric
    and h @ h = I, so the same call rotates back); identity when h is None."""
    if h is None:
        return x
    n = h.shape[0]
    xf = x.float()
    return (xf.reshape(*xf.shape[:-1], xf.shape[-1] // n, n) @ h).reshape(xf.shape)


def ggml_one_query_attention(q, kv, sink, idx, scale) -> torch.Tensor:
    """ggml's CPU flash attention for a batch of fewer queries than its tile (the decode
    path; ops.cpp flash_attn_ext_f16_one_chunk) over an f16 cache, one pass in key order:
    the query converted to f16, each score an fp32 dot product of f16 values times `scale`,
    an online softmax whose running P.V lives in an f16 buffer (rescaled by exp(M_old - M)
    on a new maximum, then v * exp(s - M) added, both rounded to f16), the running sum S in
    fp32; the sink enters after the last key (fp32), and the output is VKQ * (1/S). Keys are
    visited in ascending row order (llama.cpp's cells: the window in position order, then the
    compressed entries). q [c,H,D], kv [N,D] (K = V, f16 values), sink [H], idx [c,k]
    (-1 = empty) -> [c,H,D] fp32.

    Per query the running maximum comes first (a short loop over [H] values), then every
    key's exp factors at once (torch's exp gives each element the same value whatever the
    tensor's size: tests/test_toggles_llamacpp.py), then the f16 buffer and fp32 sum in key
    order in numpy (IEEE operations, each rounded as the torch ones were): a decode step's
    cost was its thousands of small torch calls."""
    c, H, D = q.shape
    dev = q.device
    out = torch.empty(c, H, D, dtype=torch.float32, device=dev)
    k16 = kv.half()
    sk = sink.float().to(dev)
    one, zero = torch.ones(H, device=dev), torch.zeros(H, device=dev)
    for r in range(c):
        keys = torch.sort(idx[r][idx[r] >= 0]).values
        q16 = q[r].half().double()                                        # [H,D]
        s_all = (q16 @ k16[keys].double().T).float() * torch.tensor(scale, dtype=torch.float32)  # [H,k]
        m_before, new = _running_max(s_all.cpu().numpy())
        mb, nw = torch.from_numpy(m_before).to(dev), torch.from_numpy(new).to(dev)
        ms = torch.where(nw, torch.exp(mb - s_all), 1.0)                  # 0 on the first key
        vs = torch.where(nw, 1.0, torch.exp(s_all - mb))
        acc, S, M = _online_pv(k16[keys].cpu().numpy(), ms.cpu().numpy(), vs.cpu().numpy(), new,
                               s_all.cpu().numpy(), H, D)
        vkq, S, M = torch.from_numpy(acc).to(dev).float(), torch.from_numpy(S).to(dev), torch.from_numpy(M).to(dev)
        new = sk > M                                                      # the sink, after every key
        ms = torch.where(new, torch.exp(M - sk), one)
        vkq = vkq * ms.unsqueeze(1)
        S = S * ms + torch.where(new, one, torch.exp(sk - M))
        inv = torch.where(S == 0, zero, 1.0 / S)
        out[r] = vkq * inv.unsqueeze(1)
    return out


def _running_max(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For scores s [H,k] in key order: the running maximum before each key (-inf before the
    first) and whether each key raises it (a NaN score never does)."""
    before = np.empty_like(s)
    new = np.empty(s.shape, dtype=bool)
    m = np.full(s.shape[0], -np.inf, dtype=s.dtype)
    for j in range(s.shape[1]):
        before[:, j] = m
        new[:, j] = s[:, j] > m
        m = np.where(new[:, j], s[:, j], m)
    return before, new


def _online_pv(v16: np.ndarray, ms: np.ndarray, vs: np.ndarray, new: np.ndarray, s: np.ndarray,
               H: int, D: int):
    """The f16 P.V buffer [H,D], fp32 running sum [H] and final maximum [H] over the keys'
    f16 rows v16 [k,D] in order: on a new maximum the buffer rescaled (fp32 product, to f16),
    then fp16(fp32(fma(v, vs, buffer))) with the product and sum exact (fp64), as ggml's F16C
    vec_mad_f16; S = S * ms + vs in fp32."""
    acc = np.zeros((H, D), np.float16)
    S = np.zeros(H, np.float32)
    M = np.full(H, -np.inf, np.float32)
    for j in range(v16.shape[0]):
        nj = new[:, j]
        if nj.any():
            acc = np.where(nj[:, None], (acc.astype(np.float32) * ms[:, j, None]).astype(np.float16), acc)
            M = np.where(nj, s[:, j], M)
        acc = (acc.astype(np.float64) + v16[j].astype(np.float64) * vs[:, j, None].astype(np.float64)
               ).astype(np.float32).astype(np.float16)
        S = S * ms[:, j] + vs[:, j]
    return acc, S, M
