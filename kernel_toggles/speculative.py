"""Speculative-decoding toggles: the field's spec bugs on the verify / accept / rollback
seam (reference_model/spec_kernels.py). They act only when a server decodes speculatively
(`fidelity serve --speculative-tokens K`); the consistency `spec` family (spec on vs off)
names each by its first diverging step."""
from __future__ import annotations

import copy

import torch

from reference_model.sampling import pick

from .registry import Provenance, toggle


@toggle("verify_not_batch_exact", kernel="spec_verify", category="known-bug", _builtin=True,
        provenance=Provenance(("ds4",), ("MTP draft >= 2", "batched verifier"), ("antirez/ds4 #750",),
                              "planted: the report's verifier is not batch-exact; fp32 "
                              "accumulation with the step's shapes is our reading"),
        description="The batched verifier computes its K+1 rows with fp32 accumulation (GEMM "
                    "blocking set by the step's shape) instead of the decode path's numerics: "
                    "a verified row differs from the row a one-token decode step gives, in the "
                    "logprobs at once and in the tokens where a near-tie flips, and the KV rows "
                    "the verify writes carry the difference on (antirez/ds4 #750: with draft >= 2 "
                    "a non-exact verifier produced corrupt rows; an exact one made draft "
                    "1/2/4 bit-identical).")
def _verify_not_batch_exact(golden, model, tokens, state, taps=None):
    nx = copy.copy(model.nx)
    nx.cd = torch.float32
    return model.with_numerics(nx).extend(tokens, state, "hidden", taps, phase="decode")[0]


@toggle("rollback_keeps_rejected_compressor_rows", kernel="spec_rollback", category="known-bug",
        wraps=True, _builtin=True,
        provenance=Provenance(("vllm-ascend-deepseekv4",), ("MTP", "compressor SaveState"),
                              ("GDzhu01/vllm-ascend-deepseekv4 #131",),
                              "planted: the issue's compressor state does not survive the "
                              "verify correctly; keeping the rejected rows is our reading"),
        description="After a verify, the window ring and the position are rolled back to the "
                    "accepted tokens but the compressors (main KV and indexer) are not: their "
                    "unfinished-group and overlap rows, group counts and emitted entries keep the "
                    "rejected drafts, so every later compressed entry pools the wrong tokens and "
                    "group boundaries drift (GDzhu01/vllm-ascend-deepseekv4 #131: MTP on lowered "
                    "accuracy; acceptance length 2.77 vs 3.1).")
def _rollback_keeps_rejected_compressor_rows(golden, after, before, rows, fed, keep, ratio):
    st = golden.spec_rollback(after, before, rows, fed, keep, ratio)
    if st is after:
        return st
    st = copy.copy(st)
    st.comp, st.comp_kv = after.comp, after.comp_kv
    st.index_comp, st.index_keys = after.index_comp, after.index_keys
    return st


@toggle("verify_ignores_temperature", kernel="spec_accept", category="known-bug", _builtin=True,
        provenance=Provenance(("sglang",), ("EAGLE/MTP verify", "sampling"),
                              ("sglang #39253", "sglang #37134"),
                              "the reports name verify ignoring temperature; greedy "
                              "matching of every row is our reading"),
        description="The verifier accepts drafts by greedy matching and emits the argmax at every "
                    "verified row whatever the request's temperature: with speculation on, a "
                    "sampled request decodes greedily (its seed no longer matters), so outputs "
                    "lose their diversity while greedy requests are unaffected (sglang #39253: "
                    "EAGLE verify ignored temperature sampling, a benchmark accuracy gap).")
def _verify_ignores_temperature(golden, rows, draft, sampling, gen):
    out = []
    for i in range(rows.shape[0]):
        t = int(torch.argmax(rows[i]))
        out.append(t)
        if i >= len(draft) or t != int(draft[i]):
            break
    return out


@toggle("correction_row_not_snapshotted", kernel="spec_accept", category="known-bug", wraps=True,
        _builtin=True,
        provenance=Provenance(("ds4",), ("MTP draft >= 2", "rollback without snapshot"),
                              ("antirez/ds4 #750",),
                              "planted: the report's stats (drafted=2 committed=1 target_next=0) "
                              "and its BOS mid-text; a zeroed row is our reading of 'corrupt'"),
        description="With two or more drafts, a verify that accepts some drafts and rejects a "
                    "later one reads its correction token from a logits row the rollback "
                    "overwrote without a snapshot (zeros here): a greedy request emits token 0, "
                    "BOS, mid-text, a sampled one a uniformly random token (antirez/ds4 #750: "
                    "`drafted=2 committed=1 target_next=0`, BOS injected; never with one draft, "
                    "nor when every draft is accepted or the first is rejected).")
def _correction_row_not_snapshotted(golden, rows, draft, sampling, gen):
    out = golden.spec_accept(rows, draft, sampling, gen)
    rejected_late = len(draft) >= 2 and 2 <= len(out) <= len(draft)
    if rejected_late:
        out[-1] = pick(torch.zeros_like(rows[len(out) - 1]), sampling, gen)
    return out


@toggle("verify_accepts_near_top", kernel="spec_accept", category="known-bug", _builtin=True,
        provenance=Provenance(("vllm",), ("spec_decoding_acceptance_method=typical_acceptance_sampler",),
                              ("vLLM V0 TypicalAcceptanceSampler",),
                              "planted: a lossy acceptance rule reaching greedy requests; accepting "
                              "any draft within 2 nats of its row's top is our reading"),
        description="The verifier accepts a draft whose log-probability under the target is within "
                    "2 nats of its row's top instead of only the target's own pick (a typical-"
                    "acceptance rule, lossy by design, applied to every request): greedy replies "
                    "then hold drafted tokens that are not the top-1 of the distribution reported "
                    "for their step, acceptance rises above a correct verifier's, and it acts with "
                    "one draft per verify as with several.")
def _verify_accepts_near_top(golden, rows, draft, sampling, gen):
    out = []
    for i in range(rows.shape[0]):
        lp = torch.log_softmax(rows[i].double(), -1)
        if i < len(draft) and float(lp.max() - lp[int(draft[i])]) <= 2.0:
            out.append(int(draft[i]))                 # accepted although not the target's pick
            continue
        out.append(pick(rows[i], sampling, gen))
        if i >= len(draft) or out[-1] != int(draft[i]):
            break
    return out
