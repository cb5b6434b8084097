"""Speculative decoding with the MTP layer: a Decoder whose decode steps draft K tokens
with the MTP, verify them in one batched forward of the main model, take the tokens the
acceptance rule gives, and roll the state back to them -- each through the seam kernels
of reference_model/spec_kernels.py, so an arm's spec bugs act here and nowhere else.

Positions: the main state holds tokens [0, P); the last emitted token (at P) is fed by the
next verify. The MTP at position i reads the main streams H[i] and the token at i+1, so
its state holds positions [.., P) and its last output predicts the token at P+1 (the
first draft). Further drafts feed the MTP's own output streams back (one MTP layer used
recursively, as engines do for K > 1) on a scratch copy of its state; after the verify the
MTP catches up on the accepted positions with the main model's streams.

With the golden kernels the output equals plain decoding bit for bit, greedy and sampled
(spec_kernels.py says why); the stats record drafts and acceptances per draft position."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .generate import Decoder
from .mtp import MTP
from .spec_kernels import recording_compressor_rows, rows_by_layer, snapshot_layer


class SpecError(ValueError):
    """A speculative-decoding setting the model cannot run."""


@dataclass
class SpecStats:
    """Per request: verify steps, drafted / accepted tokens, acceptances per draft position
    (accepted[j] = verifies whose draft j+1 was accepted, and so every draft before it;
    proposed[j] = verifies that drafted it)."""
    k: int
    verifies: int = 0
    drafted: int = 0
    accepted_total: int = 0
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted = self.accepted or [0] * self.k
        self.proposed = self.proposed or [0] * self.k

    def add(self, k_eff: int, n_accepted: int) -> None:
        self.verifies += 1
        self.drafted += k_eff
        self.accepted_total += n_accepted
        for j in range(k_eff):
            self.proposed[j] += 1
            self.accepted[j] += j < n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_total / self.drafted if self.drafted else 0.0

    @property
    def accept_length(self) -> float:
        """Mean tokens emitted per verify (accepted drafts + 1)."""
        return 1 + self.accepted_total / self.verifies if self.verifies else 0.0

    def to_dict(self) -> dict:
        return {"k": self.k, "verifies": self.verifies, "drafted": self.drafted,
                "accepted": self.accepted_total, "acceptance_rate": self.acceptance_rate,
                "accept_length": self.accept_length,
                "accepted_per_position": list(self.accepted),
                "proposed_per_position": list(self.proposed)}


def check_k(model, k: int) -> int:
    """K draft tokens: at least 1, and the verify (K+1 tokens) must fit the window ring."""
    w = model.cfg.window_size
    if not isinstance(k, int) or k < 1:
        raise SpecError(f"speculative tokens must be an integer >= 1, got {k!r}")
    if k + 1 > w - 1:
        raise SpecError(f"speculative tokens {k}: a verify of {k + 1} tokens must be shorter "
                        f"than the sliding window ({w} tokens) minus one")
    return k


class SpecDecoder(Decoder):
    """A Decoder that decodes speculatively with `mtp`, `k` drafts per verify. Requests
    with captures (taps) decode plainly: their captures are per forwarded token."""

    def __init__(self, model, mtp: MTP, k: int, *args, **kw):
        super().__init__(model, *args, **kw)
        if mtp.model is not model:
            raise SpecError("the MTP layer belongs to another model")
        self.mtp, self.k = mtp, check_k(model, k)
        self.spec = SpecStats(self.k)
        self.out.spec = self.spec
        self.mtp_state = None
        self._draft_row = None          # MTP logits predicting the token after the last one
        self._draft_h = None            # the MTP's output streams at that position

    @property
    def speculating(self) -> bool:
        return self.taps is None

    def next_tokens(self) -> int:
        if self.done or self.state is None or not self.speculating:
            return super().next_tokens()
        return self._k_eff() + 1

    def _k_eff(self) -> int:
        """Drafts this verify: K, fewer near the token budget or the context end."""
        room = self.max_tokens - len(self.out.tokens) - 1
        ctx = self.model.cfg.max_seq_len - self.state.pos - 1
        return max(0, min(self.k, room, ctx))

    # ---- prefill ----------------------------------------------------------------------
    def _prefill_streams(self):
        """(streams of the prompt's last positions, first position they start at): the
        whole prompt from an empty state here; a server's prefix cache overrides it."""
        H, self.state = self.model.extend(self.ids, None, "hidden")
        return H, 0

    def _prefill(self) -> torch.Tensor:
        if not self.speculating:
            return super()._prefill()
        from .generate import score_prompt
        H, start = self._prefill_streams()
        sc = self.scoring
        if sc.prompt_top is not None:
            self.out.prompt_scores = score_prompt(self.model.head(H), self.ids[start:], sc.prompt_top,
                                                  sc.prompt_from - start, sc.ids)
        w = self.model.cfg.window_size
        self._tail = (H[-w:], len(self.ids) - min(w, H.shape[0]))
        return self.model.head(H[-1:])

    def _warm_mtp(self, first: int) -> None:
        """The MTP over the prompt's last window positions (next tokens: the prompt's, then
        the first generated one)."""
        H, p0 = self._tail
        nxt = torch.cat([self.ids[p0 + 1:], torch.tensor([first])])
        self.mtp_state = self.mtp.new_state(p0)
        self._mtp_advance(H, nxt)
        del self._tail

    def _mtp_advance(self, H, next_tokens) -> None:
        lg, out = self.mtp.forward(H, next_tokens, self.mtp_state)
        self._draft_row, self._draft_h = lg[-1], out[-1:]

    # ---- steps ------------------------------------------------------------------------
    def step(self) -> int | None:
        if self.done:
            return None
        if not self.speculating:
            return super().step()
        if self.state is None:
            tok = self.advance(self._prefill())
            if tok is not None and not self.done:
                self._warm_mtp(tok)
            return tok
        return self._spec_step()

    def _draft(self, k: int) -> list[int]:
        """k greedy drafts: the first from the MTP's last output, the rest by feeding its
        own output streams back on a scratch copy of its state."""
        if k == 0:
            return []
        out = [int(torch.argmax(self._draft_row))]
        st = copy.copy(self.mtp_state)
        st.layers = [snapshot_layer(s) for s in st.layers]
        h = self._draft_h
        for _ in range(k - 1):
            lg, h = self.mtp.forward(h, torch.tensor([out[-1]]), st)
            out.append(int(torch.argmax(lg[-1])))
        return out

    def _spec_step(self) -> int | None:
        model, nx = self.model, self.model.nx
        k = self._k_eff()
        draft = self._draft(k)
        pos0 = self.state.pos
        feed = torch.tensor([self.out.tokens[-1]] + draft)
        before = [snapshot_layer(s) for s in self.state.layers]
        with recording_compressor_rows(nx) as rec:
            H = nx.spec_verify(model, feed, self.state)
        rows = model.head(H)
        emitted = [int(t) for t in nx.spec_accept(rows, draft, self.sampling, self.gen)][:k + 1]
        if not emitted:
            raise SpecError("the acceptance rule emitted no token")
        keep = len(emitted)
        by_layer = rows_by_layer(model.cfg, rec)
        self.state.layers = [
            nx.spec_rollback(after, b, {"kv": by_layer.get((i, "kv")), "index": by_layer.get((i, "index"))},
                             k + 1, keep, model.cfg.compress_ratios[i])
            for i, (after, b) in enumerate(zip(self.state.layers, before))]
        self.state.pos = pos0 + keep
        self.steps += 1
        self.spec.add(k, keep - 1)
        last = None
        for i, t in enumerate(emitted):
            last = self._take(t, rows[i], pos0 + i + 1)
            if self.done:
                break
        if not self.done:
            self._mtp_advance(H[:keep], torch.tensor(emitted))
        return last
