"""Outside parity check of our DeepSeek-V4.1 golden against transformers' V4.1 port
(huggingface/transformers PR #48721, closed, not merged), run from its readable source.

The port is NOT part of this project: `--hf-source DIR` names a directory the user fills
with the PR's configuration_deepseek_v41.py and modular_deepseek_v41.py; bench/v41_hf_port.py
loads them against the installed transformers, fills the port with our weights and holds
the HF-side bridges (lowest-index top-k ties, Engram's tokenizer, fp32 RoPE tables).

What is compared. Our tiny V4.1 config (reference_model.v41.config.tiny_v41) is built in
HF's `DeepseekV41TextConfig`; our random weights (reference_model.v41.weights.
random_weights, already on their checkpoint grids: FP8 32x32 / FP4 values dequantised,
exact in bf16) are loaded into HF's `DeepseekV41ForCausalLM` in bf16 with the fp32
tensors HF keeps fp32 (mHC, sinks, gate biases). Both run the same token ids: a prefill
(every position) and then decode steps (HF with its DynamicCache). Arms of our golden:

  golden      Numerics("reference") as is.
  +no-actq    golden with the activation quantisation of V4.1's FP8/FP4 GEMMs off
              (doc §9 D11: HF's forward has none; bridged here with a kernel replacement
              of `fp8_linear32`, not a registered toggle).
  hf-reading  +no-actq and the toggles that read HF's choices in doc §9's HF column:
              index_scores_fp32 (D2), rmsnorm_cast_first (D4), attn_logits_bf16 (D5),
              lm_head_bf16 (D6). D1 (running index keys), D3, D9 (drop -inf picks) are
              already the golden's reading; D9's `candidate_underfill_keep` is REF's, not
              HF's, so it stays off.

The port also runs with fp32 RoPE tables (`fp32_rope_tables`) against hf-reading, and
hf-reading with fp32 accumulation against itself gives the noise floor.

Usage:  python bench/v41_hf_parity.py --hf-source /tmp/hf_v41 [--lengths 64,200]
                                       [--decode 4] [--seed 0] [--out bench/results/...]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from reference_model.numerics import Numerics  # noqa: E402
from reference_model.v41.config import tiny_v41  # noqa: E402
from reference_model.v41.model import ModelV41  # noqa: E402
from reference_model.v41.weights import random_weights  # noqa: E402
from v41_hf_port import (build_hf_model, fp32_rope_tables, hf_run, load_port,  # noqa: E402
                         lowest_index_topk_ties, port_cache, source_problem)

HF_READING = ("index_scores_fp32", "rmsnorm_cast_first", "attn_logits_bf16", "lm_head_bf16")

__all__ = ["ARMS", "FLOOR", "HF_READING", "HF_READING_FP32_ROPE", "ParitySetup",
           "arm_numerics", "build_hf_model", "compare", "golden_run", "layer0_table",
           "layer0_taps", "load_port", "main", "random_weights", "run", "source_problem",
           "table", "tiny_v41"]


def _no_act_quant(golden, x, w):
    """fp8_linear32 without the 1x32 activation quantisation (doc §9 D11, HF's forward)."""
    return golden.rs(golden.c(x) @ golden.c(w).T)


def arm_numerics(arm: str, compute_dtype=None):
    """compute_dtype None: the golden's fp64 wide accumulation; torch.float32 for the
    noise-floor arm (same semantics, fp32 accumulation)."""
    import kernel_toggles as K
    kw = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
    if arm == "golden":
        return Numerics("reference", **kw)
    base = Numerics("reference", **kw).with_kernels("no_act_quant", fp8_linear32=_no_act_quant)
    if arm == "+no-actq":
        return base
    if arm == "hf-reading":
        return K.ToggleSet.parse(",".join(HF_READING), model="v41").numerics(base=base)
    raise ValueError(arm)


ARMS = ("golden", "+no-actq", "hf-reading")
FLOOR = "floor"     # hf-reading with fp32 accumulation vs hf-reading (fp64): golden vs golden
HF_READING_FP32_ROPE = "hf-reading vs port+fp32-RoPE"   # the port with `fp32_rope_tables`


@torch.no_grad()
def golden_run(w, nx, toks: torch.Tensor, n_prefill: int):
    m = ModelV41(w, nx)
    pre, st = m.extend(toks[:n_prefill], None, "all")
    dec = []
    for j in range(n_prefill, toks.numel()):
        lg, st = m.extend(toks[j:j + 1], st, "last")
        dec.append(lg[-1])
    return pre.float(), (torch.stack(dec).float() if dec else pre[:0].float())


# ---- metrics ------------------------------------------------------------------------------
def compare(ours: torch.Tensor, hf: torch.Tensor, last: int = 8) -> dict:
    """max |Δ logit| over all rows, KLD(ours || hf) mean/max over the last `last` rows
    (fp64), top-1 agreement over all rows."""
    d = (ours.double() - hf.double()).abs()
    lp, lq = torch.log_softmax(ours[-last:].double(), -1), torch.log_softmax(hf[-last:].double(), -1)
    kld = (lp.exp() * (lp - lq)).sum(-1)
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "kld_mean": float(kld.mean()), "kld_max": float(kld.max()),
            "top1": float((ours.argmax(-1) == hf.argmax(-1)).double().mean()),
            "rows": int(ours.shape[0])}


@dataclass(frozen=True)
class ParitySetup:
    """What `run` compares: prompts of each length (tokens drawn with tok_seed + length),
    `decode` steps after each, our random weights of `seed`, the golden's `arms`, and the
    two extra rows: `floor` (hf-reading with fp32 accumulation vs hf-reading) and
    `rope_bridge` (hf-reading vs the port with fp32 RoPE tables)."""
    lengths: tuple = (64, 200)
    decode: int = 4
    seed: int = 0
    arms: tuple = ARMS
    tok_seed: int = 3
    floor: bool = True
    rope_bridge: bool = True


def run(src, setup: ParitySetup = ParitySetup()):
    """Rows of `compare` per (arm, length, phase), and the transformers version."""
    cfg_mod, mod, tv = load_port(src)
    cfg = tiny_v41()
    w = random_weights(cfg, setup.seed)
    decode = setup.decode
    model = build_hf_model(mod, cfg_mod, cfg, w)
    bridged = fp32_rope_tables(build_hf_model(mod, cfg_mod, cfg, w)) if setup.rope_bridge else None
    rows = []
    for n in setup.lengths:
        toks = torch.randint(2, cfg.vocab_size, (n + decode,),
                             generator=torch.Generator().manual_seed(setup.tok_seed + n))
        t0 = time.time()
        hf = hf_run(model, toks, n)
        th = time.time() - t0
        runs = {}
        for arm in setup.arms:
            t0 = time.time()
            runs[arm] = golden_run(w, arm_numerics(arm), toks, n)
            rows += _rows(arm, n, decode, runs[arm], hf, t_hf=th, t_golden=time.time() - t0)
        if bridged is not None and "hf-reading" in runs:
            rows += _rows(HF_READING_FP32_ROPE, n, decode, runs["hf-reading"], hf_run(bridged, toks, n))
        if setup.floor and "hf-reading" in runs:
            floor = golden_run(w, arm_numerics("hf-reading", torch.float32), toks, n)
            rows += _rows(FLOOR, n, decode, floor, runs["hf-reading"])
    return rows, tv


def _rows(arm: str, n: int, decode: int, ours, theirs, **timing) -> list[dict]:
    """One comparison's prefill row (with `timing`) and, after decode steps, its decode row;
    `ours` and `theirs` are (prefill logits, decode logits)."""
    out = [{"arm": arm, "length": n, "phase": "prefill", **compare(ours[0], theirs[0]), **timing}]
    if decode:
        out.append({"arm": arm, "length": n, "phase": f"decode x{decode}",
                    **compare(ours[1], theirs[1], last=decode)})
    return out


def _ulps(d: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|Δ| in units of the bf16 spacing at the RMS of ref's row (2^(floor(log2 rms) - 7)):
    elements near 0 are sums with cancellation, so their own spacing is not the scale."""
    rms = ref.reshape(ref.shape[0], -1).pow(2).mean(-1).sqrt().clamp_min(2.0 ** -126)
    e = torch.floor(torch.log2(rms)).view(-1, *([1] * (ref.dim() - 1)))
    return d / torch.exp2(e - 7)


@torch.no_grad()
def layer0_taps(src, n=64, seed=0, arms=ARMS, tok_seed=3, rope_bridge=False):
    """Layer 0 (window-only: no compressed entry, no top-k upstream, so the only discrete
    step is the router) of the port vs each arm: attention output, FFN output and layer
    output streams; max |Δ| in bf16 ulps, mean |Δ|, fraction bit-equal, and the rows whose
    routed experts differ (excluded from the FFN / out maxima)."""
    cfg_mod, mod, _ = load_port(src)
    cfg = tiny_v41()
    w = random_weights(cfg, seed)
    model = build_hf_model(mod, cfg_mod, cfg, w)
    if rope_bridge:
        fp32_rope_tables(model)
    toks = torch.randint(2, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(tok_seed + n))
    rec = {}
    L0 = model.model.layers[0]
    hooks = [L0.attn.register_forward_hook(lambda m, i, o: rec.__setitem__("attn.out", o[0][0])),
             L0.ffn.register_forward_hook(lambda m, i, o: rec.__setitem__("ffn.out", o[0])),
             L0.ffn.gate.register_forward_hook(lambda m, i, o: rec.__setitem__("experts", o[1])),
             L0.register_forward_hook(lambda m, i, o: rec.__setitem__("out", o[0][0]))]
    with lowest_index_topk_ties():
        model(input_ids=toks.view(1, -1), past_key_values=port_cache(model), use_cache=True)
    for h in hooks:
        h.remove()
    from reference_model import Taps
    out = []
    for arm in arms:
        t = Taps("layers.0.*")
        ModelV41(w, arm_numerics(arm)).extend(toks, None, "none", t)
        he, ge = rec["experts"].sort(-1).values, t["layers.0.ffn.router.experts"].sort(-1).values
        flips = (~(he == ge).all(-1)).nonzero().flatten().tolist()
        keep = torch.ones(n, dtype=torch.bool)
        keep[flips] = False
        r = {"arm": arm + (" vs port+fp32-RoPE" if rope_bridge else ""),
             "router_rows_differing": flips}
        for k in ("attn.out", "ffn.out", "out"):
            h, g = rec[k].double(), t[f"layers.0.{k}"].double()
            d = (h - g).abs()
            r[k] = {"max_ulps": float(_ulps(d[keep], g[keep]).max()), "mean_abs": float(d[keep].mean()),
                    "bit_equal": float((d[keep] == 0).double().mean())}
        out.append(r)
    return out


def layer0_table(rows) -> str:
    out = ["| arm | router rows differing | attn.out: max Δ in bf16 ulps (at the row RMS) / mean abs Δ / bit-equal | "
           "ffn.out | layer out streams |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]['max_ulps']:.3g} / {r[k]['mean_abs']:.2g} / {r[k]['bit_equal']:.0%}"
                 for k in ("attn.out", "ffn.out", "out")]
        out.append(f"| {r['arm']} | {r['router_rows_differing']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def table(rows) -> str:
    out = ["| arm | prompt | phase | max abs Δ logit | mean abs Δ | KLD mean (last rows) | "
           "KLD max | top-1 agree |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['arm']} | {r['length']} | {r['phase']} | {r['max_abs']:.3g} | "
                   f"{r['mean_abs']:.3g} | {r['kld_mean']:.3g} | {r['kld_max']:.3g} | "
                   f"{r['top1'] * r['rows']:.0f}/{r['rows']} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-source", required=True,
                    help="directory holding the PR's configuration_deepseek_v41.py and "
                         "modular_deepseek_v41.py")
    ap.add_argument("--lengths", default="64,200")
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    rows, tv = run(a.hf_source, ParitySetup(tuple(int(x) for x in a.lengths.split(",")), a.decode,
                                            a.seed, tuple(a.arms.split(","))))
    t = table(rows)
    l0 = layer0_table(layer0_taps(a.hf_source, seed=a.seed)
                      + layer0_taps(a.hf_source, seed=a.seed, arms=("hf-reading",),
                                    rope_bridge=True))
    print(f"transformers {tv}, port from {a.hf_source}\n{t}\n\nlayer 0 (64 tokens):\n{l0}")
    if a.out:
        Path(a.out).write_text(t + "\n\n" + l0 + "\n")
    return rows


if __name__ == "__main__":
    main()
