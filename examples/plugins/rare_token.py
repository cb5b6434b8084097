"""A planted rare per-token bug, as a toggle plugin (`--plugin examples/plugins/rare_token.py`):
the class of vllm#41985, where an FP4 rounding-boundary bug hit 0.03% of tokens but most
requests. On about one position in `period` -- picked by the hidden state's own bits, so the
same position of the same prompt is hit on every run -- the head's two highest logits trade
places (that token is wrong), or with `shift` the second's rises by that many nats (a milder
wrong turn, as a rounding bug's), or with `bos` token 0 (BOS) takes the row, as an argmax over
a NaN row emitted it in vllm#41834 (a NaN itself would not survive a JSON answer); every other
position is the golden's. What `fidelity kld`'s per-token
tail (fidelity/verdict/spikes.py) names when means over positions and per-prompt tails stay
inside the floors."""
import torch

from kernel_toggles import Param, Provenance, toggle


def hit_rows(x: torch.Tensor, period: int) -> torch.Tensor:
    """Rows of the head's input that the bug hits: a hash of each row's bits, 1 in `period`."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    h = (bits * torch.arange(1, x.shape[-1] + 1, dtype=torch.int64)).sum(-1)
    return (h % period) == 0


@toggle("rare_token_swap", kernel="lm_head", category="known-bug",
        params=(Param("period", int, 2000, "about one position in this many is hit"),
                Param("shift", float, 0.0, "0: swap the two highest logits; else raise the second by this"),
                Param("bos", bool, False, "token 0 (BOS) takes the hit rows instead")),
        provenance=Provenance(("planted",), ("examples/plugins/rare_token.py",), ("vllm#41985",)),
        description="On about one position in `period` the two highest logits trade places "
                    "(or the second rises by `shift` nats).")
def rare_token_swap(golden, x, w, period=2000, shift=0.0, bos=False):
    logits = golden.lm_head(x, w)
    hit = hit_rows(x, period)
    if bos:
        logits[hit, 0] = logits[hit].amax(-1) + 20.0
    elif hit.any():
        rows = logits[hit]
        top = rows.topk(2, dim=-1).indices
        a, b = rows.gather(-1, top[:, :1]), rows.gather(-1, top[:, 1:])
        if shift:
            rows.scatter_(-1, top[:, 1:], b + shift)
        else:
            rows.scatter_(-1, top[:, :1], b).scatter_(-1, top[:, 1:], a)
        logits[hit] = rows
    return logits
