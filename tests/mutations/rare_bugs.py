"""Bugs that act on a few prompts only -- the shape of the field's worst V4 bugs (wrong
only at some lengths or positions) -- for the verdict's per-prompt tail
(fidelity.verdict.tail). Load like any plugin: `fidelity ab --plugin
tests/mutations/rare_bugs.py --arm rare_index_page_7`.

On the embedded model with `fidelity ab`'s default 18 prompts, rare_index_page_7 breaks
2 of them (answer KLD 4.16 and 0.0116 against floors of 0.0017 and 0.0001) and leaves the
rest within their floors: its mean effect's bootstrap interval does not clear the floor."""
from __future__ import annotations

import torch

from kernel_toggles import toggle

PAGE = 8             # compressed entries per KV page (32 tokens at the CSA ratio of 4)


@toggle("rare_index_page_7", kernel="index_topk", category="known-bug",
        description="Rare bug: the indexer's picks on page 7 of the compressed KV (entries "
                    "56-63, positions 224-255) read page 6's entries -- a page table off by one "
                    "for one page. Every prompt's picks there move, but only a prompt that needs "
                    "an entry of that page for its answer loses it.")
def _(g, scores, k):
    out = g.index_topk(scores, k)
    return torch.where((out >= 7 * PAGE) & (out < 8 * PAGE), out - PAGE, out)
