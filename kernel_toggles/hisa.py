"""HISA (Hierarchical Indexing for Sparse Attention, arXiv 2603.28458), as mlx-vlm ships it for
DeepSeek-V4 (Blaizzy/mlx-vlm#1434; mlx_vlm/models/deepseek_v4/hisa_kernel.py and
Indexer._hisa_select, read for this, not copied): the lightning indexer's exact top-k over every
compressed entry replaced by a two-stage search once the entries outnumber keep x block:

  1. coarse: the keys of each full block of `block` entries averaged into one representative,
     scored as an indexer key (sum over heads of w_h relu(q_h . rep)); blocks starting at or
     after what the row can see are out; the best `keep` blocks are kept
  2. fine: the kept blocks' entries scored as usual (entries the row cannot see out), top-k.

Entries after the last full block are never candidates, and an entry outside the kept blocks
is lost however well it scores: the seeds' failure class (selection that drops the needle
past a length) as a shipping default. Registered from builtin.py beside the other indexer
toggles."""
from __future__ import annotations

import torch

from .registry import Param, Provenance, toggle


@toggle("hisa", kernel="index_select", category="optimization", wraps=True, engine_arm=False, _builtin=True,
        params=(Param("block", int, 64, "entries per block (mlx-vlm's config index_block)", min=1),
                Param("keep", int, 16, "blocks kept by the coarse stage (index_keep)", min=1)),
        provenance=Provenance(("mlx-vlm",), ("DeepSeek-V4 default: index_block 64, index_keep 16 "
                                             "(index_block 0 turns it off)",),
                              ("Blaizzy/mlx-vlm#1434", "arXiv 2603.28458"),
                              "mlx-vlm 0.7.10's code read here; other releases may differ"),
        description="The indexer's exact top-k replaced by HISA once the compressed entries number at "
                    "least block x keep (and block x keep >= index_topk): block-mean keys pick `keep` "
                    "blocks, top-k among their entries. Entries past the last full block and outside "
                    "the kept blocks cannot be picked. mlx-vlm's default for DeepSeek-V4 (from "
                    "~4K tokens at ratio 4 with the defaults).")
def _hisa(golden, q, keys, wts, visible, k, *, block, keep):
    scores, picks = golden.index_select(q, keys, wts, visible, k)
    n = keys.shape[0]
    if n < block * keep or block * keep < k:
        return scores, picks
    return scores, hisa_picks(golden, q, keys, wts, visible, scores, k, block, keep)


def hisa_picks(nx, q, keys, wts, visible, scores, k: int, block: int, keep: int) -> torch.Tensor:
    """HISA's picks per row ([rows, k], -1 where fewer than k visible candidates): `scores` are
    the rows' exact scores over every key (-inf where not visible)."""
    nb = keys.shape[0] // block
    reps = keys[: nb * block].reshape(nb, block, -1).mean(1)
    coarse = nx.index_scores(q, reps, wts)                                       # [rows, nb]
    starts = torch.arange(nb, device=keys.device) * block
    coarse = coarse.masked_fill(starts.unsqueeze(0) >= visible.unsqueeze(1), float("-inf"))
    kept = nx.index_topk(coarse, min(keep, nb))                                  # [rows, kb], -1: none left
    cand = kept.clamp(min=0).unsqueeze(-1) * block + torch.arange(block, device=keys.device)
    cand = cand.reshape(kept.shape[0], -1)                                       # [rows, kb * block]
    fine = torch.gather(scores, 1, cand).masked_fill((kept < 0).repeat_interleave(block, 1), float("-inf"))
    sel = nx.index_topk(fine, k)
    return torch.where(sel >= 0, torch.gather(cand, 1, sel.clamp(min=0)), torch.full_like(sel, -1))
