"""`fidelity serve --speculative-tokens K`: every served arm decodes speculatively with the
checkpoint's MTP layer (reference_model/speculative.py), through the server's prefix
cache, and reports acceptance like the engines do: SGLang's `spec_verify_ct` and
`spec_accept_length` in a request's meta_info (plus acceptances per draft position), and
server totals in /get_server_info under `speculative`. The golden arm's answers are those
of a server without speculation, bit for bit; an arm with a spec toggle
(kernel_toggles/speculative.py) is what the consistency `spec` family is for."""
from __future__ import annotations

from pathlib import Path

from reference_model.mtp import MTP, MTPError, load_mtp_weights
from reference_model.speculative import SpecDecoder, SpecStats, check_k

from .prefix_cache import page_keys, paged_prefill, restore


def load_mtp_source(checkpoint) -> dict:
    """MTP layer 0 of the served checkpoint (None: the embedded default), as a dict of
    tensors; ValueError naming the checkpoint when it has none."""
    from fidelity.weights.source import EMBEDDED, resolve_checkpoint
    root = Path(resolve_checkpoint(checkpoint)) if checkpoint else EMBEDDED
    try:
        return load_mtp_weights(root)
    except MTPError as e:
        raise ValueError(f"--speculative-tokens: {e} (speculative decoding drafts with the "
                         "checkpoint's MTP layer)") from None


class Speculation:
    """The server's speculative setting: K, the MTP weights, one MTP per served model,
    and the totals over every request."""

    def __init__(self, k: int, weights: dict):
        self.k, self.weights = k, weights
        self.totals = SpecStats(k)
        self._mtps: dict[int, MTP] = {}

    def check(self, model) -> None:
        """K fits the model's window and the MTP layer can run beside it (ValueError)."""
        check_k(model, self.k)
        self.mtp(model)

    def mtp(self, model) -> MTP:
        key = id(model)
        if key not in self._mtps:
            self._mtps[key] = MTP(model, self.weights)
        return self._mtps[key]

    def snapshot(self) -> dict:
        return {"enabled": True, "algorithm": "MTP", "num_speculative_tokens": self.k,
                **self.totals.to_dict()}


class CachedSpecDecoder(SpecDecoder):
    """A SpecDecoder whose prefill goes through the prefix cache: at most len - window
    tokens are restored, so the prefilled rest holds the streams the MTP reads over the
    last window positions (and, for prompt logprobs, the rows they need)."""

    def __init__(self, *args, cache=None, arm_id: str = "", totals: SpecStats | None = None, **kw):
        super().__init__(*args, **kw)
        self.cache, self.arm_id, self.totals = cache, arm_id, totals
        self.out.cached_tokens = 0

    def _prefill_streams(self):
        if self.cache is None:
            return super()._prefill_streams()
        sc = self.scoring
        ids = self.ids.tolist()
        keys = page_keys(self.arm_id, ids, self.cache.page)
        limit = max(len(ids) - self.model.cfg.window_size, 0)
        if sc.prompt_top is not None:
            limit = min(limit, max(sc.prompt_from - 1, 0))
        n, stored = self.cache.lookup(keys, len(ids), limit)
        state = restore(self.model, stored) if stored is not None else self.model.new_state()
        H, self.state = paged_prefill(self.model, self.ids, state, self.cache, keys, "hidden")
        self.out.cached_tokens = n
        return H, n

    def _spec_step(self):
        d0, a0 = self.spec.drafted, self.spec.accepted_total
        tok = super()._spec_step()
        if self.totals is not None:
            self.totals.add(self.spec.drafted - d0, self.spec.accepted_total - a0)
        return tok


def meta_info(g) -> dict:
    """SGLang's speculative fields of a finished request (none without speculation)."""
    s = getattr(g, "spec", None)
    if s is None:
        return {}
    return {"spec_verify_ct": s.verifies, "spec_accept_length": s.accept_length,
            "spec_draft_token_num": s.drafted, "spec_accept_token_num": s.accepted_total,
            "spec_accepted_per_position": list(s.accepted)}
