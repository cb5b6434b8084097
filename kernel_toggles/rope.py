"""Built-in RoPE toggles (registered from builtin.py at their place in forward order): the
per-layer-type frequency table and the precision of the cos/sin table, as engines and
ports get them wrong. The golden's RoPE is reference_model/numerics.py's rope_inv_freq /
rope_apply (fp32 or wider tables, as DeepSeek's complex64 `freqs_cis`)."""
from __future__ import annotations

import torch

from reference_model import primitives as P

from .registry import Param, Provenance, toggle

_B = dict(_builtin=True)


@toggle("yarn_on_swa_layers", kernel="rope_inv_freq", category="known-bug", **_B,
        params=(Param("theta", str, "swa", "base of the window-only layers' table: their own "
                      "rope_theta ('swa') or the compressed layers' ('compressed')",
                      choices=("swa", "compressed")),),
        provenance=Provenance(("sglang", "vllm", "mlx-lm"),
                              ("sglang builds between #25144 and the fix",),
                              ("sglang #25144", "sglang PR #34788", "vLLM PR #54815",
                               "mlx-lm PR #1189")),
        description="YaRN frequency re-mixing applied on window-only (compress ratio 0) "
                    "layers too. The reference uses base rope_theta without YaRN there and "
                    "YaRN only on compressed layers; SGLang regression #25144 made YaRN "
                    "unconditional (fixed by PR #34788), vLLM had the same bug class (PR "
                    "#54815), and mlx-lm used the wrong per-layer theta (collapse after ~210 "
                    "tokens). theta='compressed' gives window-only layers the compressed "
                    "layers' whole table.")
def _yarn_on_swa(golden, cfg, ratio, *, theta):
    if ratio != 0:
        return golden.rope_inv_freq(cfg, ratio)
    dt = golden.rope_inv_freq(cfg, ratio).dtype
    base = cfg.rope_theta if theta == "swa" else cfg.compress_rope_theta
    return P.rope_inv_freq(cfg.rope_head_dim, base, cfg.rope_factor, cfg.original_seq_len,
                           cfg.beta_fast, cfg.beta_slow, dtype=dt)


@toggle("rope_table_bf16", kernel="rope_apply", category="known-bug", **_B,
        provenance=Provenance(("transformers",),
                              ("DeepseekV4RotaryEmbedding returns cos/sin in its input's dtype "
                               "(bf16 in a bf16 model); the V4.1 port reuses it",),
                              ("transformers PR #48721", "bench/results/v41_hf_parity.md"),
                              "whether sglang / vLLM kernels hold the table in bf16 was not "
                              "checked"),
        description="RoPE cos/sin table held in bf16: angles t·f in fp32, cos and sin rounded "
                    "to bf16, then the fp32 rotation, at every site (q, window KV, compressed "
                    "entries, index q/k, the output's inverse rotation). transformers' rotary "
                    "module casts its table to the input dtype; DeepSeek's reference and the "
                    "golden keep it in fp32 (complex64 freqs_cis). Found by the V4.1 parity "
                    "run (bench/v41_hf_parity.py): with it bridged, layer 0 of the port and the "
                    "golden agree bit for bit.")
def _rope_table_bf16(golden, x, inv_freq, positions, site, inverse=False, phase="prefill"):
    table = bf16_rope_table(positions, inv_freq.to(positions.device))
    return golden.rs(P.apply_rope(x, table, inverse))


def bf16_rope_table(positions, inv_freq):
    """transformers' table: fp32 angles, cos / sin rounded to bf16, as a complex table."""
    ang = torch.outer(positions.float(), inv_freq.float())
    cos, sin = (f(ang).to(torch.bfloat16).float() for f in (torch.cos, torch.sin))
    return torch.complex(cos, sin)
