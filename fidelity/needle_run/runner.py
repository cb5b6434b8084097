"""In-process needle runner: one arm of the reference model, greedy or sampled, plus the
mechanism behind a hit or a miss. A runner for needle's sweep (needle/sweep.py takes any
object with aopen/arun/aclose/counter/describe, like needle.http.HttpRunner); it lives in
fidelity because it is built from an arm (fidelity.design.arms), and needle imports nothing of
fidelity. It also runs trials in batches (`arun_batch`; the sweep hands it every pending
trial of one length): layer-major through fidelity.needle_run.batch, so each layer's weights
are fetched once per pass for the batch, with rows identical to run()'s.

Mechanism, per indexer layer (V4's CSA; V4.1's index sources, ratio 2 or 1, disjoint entries {t//r}), at the question's last position (the last prompt token): which
compressed entries hold the needle value, whether the indexer picked one of them, its
rank among the visible entries and its margin to the top-k boundary (fidelity.ab.margins). Entry j pools tokens 4j..4j+3 and, in half of its
channels, the previous group 4j-4..4j-1 (overlapping ratio-4 compressor), so the entries
holding the value are {t//4} and {t//4 + 1} over the value's tokens t; with several
expected values (multivalue, multiquery) `values_in_topk` counts the values with an entry
picked, since one value dropping out of top-k is the failure to see. The picks come from
the `layers.{i}.attn.index.topk` tap; the rank needs the scores, which no tap exposes,
so the last prompt token is run through a copy of the arm's Numerics whose
`index_select` kernel records the exact scores the arm's own kernels return (the values the
exact top-k ranks; an approximate selection such as HISA picks from them or not; rank = 1 + #visible entries scoring higher + #lower-index ties, i.e. the
golden top-k's tie rule). The prompt is prefilled as tokens[:-1] and then the last token
(still in prefill phase): chunked prefill, which the golden forward treats identically."""
from __future__ import annotations

import asyncio
import math
import threading
import time

import torch

from fidelity.ab.margins import entry_margin
from fidelity.design.arms import as_arm
from fidelity.errors import CommandError
from fidelity.needle_run.batch import InProcessOptions, InProcessTrial, plan_batches, run_layer_major
from needle.haystack import LocalCounter, Prompt, needle_entries, value_token_positions
from reference_model import Taps, build_model
from reference_model.generate import Generation, Sampling, generate

_COMPUTE = threading.Lock()          # one model computation at a time on this machine


class InProcessRunner:
    kind = "inprocess"
    concurrency = 1

    def __init__(self, name: str, target, arm, sampling: Sampling | None = None,
                 max_tokens: int | None = None, options: InProcessOptions = InProcessOptions()):
        """`sampling`: its temperature and top_p (greedy by default; the seed is each
        trial's). `options.driver` (fidelity.pipeline.model.Driver, rank 0 under
        --distributed): the arm runs across the pipeline, one trial at a time (no
        layer-major batches)."""
        sampling = sampling or Sampling()
        temperature, top_p = sampling.temperature, sampling.top_p
        profile, mechanism, placement = options.profile, options.mechanism, options.placement
        batch, batch_tokens, driver = options.batch, options.batch_tokens, options.driver
        from kernel_toggles.arms import version_of
        version = version_of(target.cfg)
        self.name, self.target, self.arm = name, target, as_arm(arm, version)
        plan_batches([], batch, batch_tokens)             # ValueError for bad bounds, now
        self.batch, self.batch_tokens = batch, batch_tokens   # per layer-major batch (run_batch)
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_tokens
        self.mechanism = mechanism
        kw = {"compute_dtype": placement.compute_dtype} if placement else {}
        sched = self.arm.schedule            # feeds the prompt up to its last token (prefill)
        self._scores: list[torch.Tensor] = []
        if driver is not None:
            from fidelity.pipeline.model import arm_numerics
            recipe = (arm_numerics, self.arm.name, profile, kw, version)
            self.batch = 1
            self.model = driver.model(recipe, sched)
            self.model_rec = driver.model(recipe, sched, record=lambda s: self._scores.append(s))
            return
        devices = placement.model_devices if placement else None
        cache: dict = {}                     # resident weights converted once, for both models
        self.model = build_model(target.weights, self.arm.numerics(profile, **kw), devices=devices,
                                 schedule=sched, weight_cache=cache)
        rec = self.model.nx.recording_index_scores(lambda s: self._scores.append(s))   # the current sink
        self.model_rec = build_model(target.weights, rec, devices=devices, schedule=sched, weight_cache=cache)

    def counter(self):
        return LocalCounter(self.target.tokenizer)

    @property
    def detail(self) -> str:
        return self.arm.name

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "arm": self.arm.name,
                "model": self.target.name, "temperature": self.temperature, "top_p": self.top_p}

    async def aopen(self):
        return None

    async def aclose(self):
        return None

    async def arun(self, prompt: Prompt, seed: int) -> dict:
        return await asyncio.to_thread(self._locked_run, prompt, seed)

    def _locked_run(self, prompt, seed):
        with _COMPUTE:
            return self.run(prompt, seed)

    def _budget(self, prompt: Prompt) -> int:
        if self.max_tokens is not None:
            return self.max_tokens
        tok = self.target.tokenizer
        answer = sum(tok.count(" " + v) + 2 for v in prompt.expected) + 4
        return answer + (256 if prompt.fmt.thinking else 0)

    def run(self, prompt: Prompt, seed: int) -> dict:
        tok = self.target.tokenizer
        ids, offsets = tok.encode_with_offsets(prompt.text)
        taps = Taps(["layers.*.attn.index.topk"])
        self.record_into([])

        def prefill(model, t, all_logits):
            st = None
            if len(t) > 1:
                _, st = self.model.extend(t[:-1], None, "none")
            return self.model_rec.extend(t[-1:], st, "last", taps if self.mechanism else None,
                                         phase="prefill")

        t0 = time.perf_counter()
        try:
            gen = generate(self.model, ids, self._budget(prompt),
                           Sampling(self.temperature, self.top_p, seed=seed % (2**63)),
                           stop_ids={tok.eos_id}, prefill=prefill)
        except (ValueError, RuntimeError) as e:
            if isinstance(e, CommandError):        # a pipeline rank lost (--distributed): the run ends
                raise
            return {"error": f"{type(e).__name__}: {e}", "attempts": 1,
                    "latency_s": time.perf_counter() - t0, "prompt_tokens": len(ids)}
        return self._row(InProcessTrial(0, prompt, ids, offsets, taps, scores=self._scores), gen, t0)

    def _row(self, trial: InProcessTrial, gen: Generation, t0: float) -> dict:
        """A finished trial's result (also fidelity.needle_run.batch's, so the two agree)."""
        prompt, ids, offsets, scores, taps = trial.prompt, trial.ids, trial.offsets, trial.scores, trial.taps
        tok, cfg = self.target.tokenizer, self.target.cfg
        value_tok = value_token_positions(offsets, prompt.value_spans)
        reasoning, content = tok.split_reasoning(gen.tokens, prompt.fmt.thinking)
        row = {"response": content, "reasoning_content": reasoning,
               "finish_reason": gen.finish_reason, "completion_tokens": len(gen.tokens),
               "prompt_tokens": len(ids), "latency_s": time.perf_counter() - t0,
               "attempts": 1, "error": None, "value_token_positions": value_tok}
        if self.mechanism:
            per_value = [value_token_positions(offsets, [s]) for s in prompt.value_spans]
            row["mechanism"] = mechanism(cfg, taps, scores, value_tok, len(ids) - 1, per_value)
        return row

    # ---- batches (needle/sweep.py hands every pending trial of one length at once) -------
    def record_into(self, sink: list) -> None:
        """Where the index-score recorder appends from now on (one list per trial)."""
        self._scores = sink

    def run_batch(self, items: list[tuple[Prompt, int]], on_done) -> None:
        """Trials (prompt, seed), split by the batch bounds; each batch layer-major
        (fidelity.needle_run.batch), or one at a time with `batch=1`. `on_done(index, result)`
        as each trial finishes; results equal run()'s but for latency_s."""
        if self.batch == 1:
            for k, (p, seed) in enumerate(items):
                on_done(k, self._locked_run(p, seed))
            return
        sizes = [p.n_tokens for p, _ in items]
        for group in plan_batches(sizes, self.batch, self.batch_tokens):
            with _COMPUTE:
                run_layer_major(self, [items[k] for k in group],
                                lambda j, res, group=group: on_done(group[j], res))

    async def arun_batch(self, items: list[tuple[Prompt, int]]):
        """Async iterator of (index, result) as each trial of run_batch finishes."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(asyncio.to_thread(
            self.run_batch, items, lambda k, res: loop.call_soon_threadsafe(q.put_nowait, (k, res))))
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(q.put_nowait, None))
        while (got := await q.get()) is not None:
            yield got
        await task                                   # re-raises the batch's exception


def mechanism(cfg, taps: Taps, scores: list[torch.Tensor], value_tok: list[int], pos: int,
              per_value: list[list[int]] | None = None) -> list[dict]:
    """Per indexer layer (V4's CSA, V4.1's index sources, each at its own ratio): entries
    holding a value, picked or not, best rank, and how many of the values (token positions
    per value: `per_value`) had an entry picked (module doc)."""
    layers = [i for i in cfg.indexer_layers() if f"layers.{i}.attn.index.topk" in taps]
    if len(layers) != len(scores):
        raise RuntimeError(f"recorded {len(scores)} index_select calls for {len(layers)} indexer layers")
    in_window = any(t > pos - cfg.window_size for t in value_tok)
    out = []
    for i, s in zip(layers, scores):
        ratio = cfg.compress_ratios[i]
        visible = (pos + 1) // ratio
        held = needle_entries(value_tok, pos, ratio)
        held_per = [needle_entries(v, pos, ratio) for v in (per_value or [value_tok])]
        s = s[-1, :visible].double()
        picks = {int(j) for j in taps[f"layers.{i}.attn.index.topk"][-1] if j >= 0}
        ranks = {j: 1 + int((s > s[j]).sum()) + int((s[:j] == s[j]).sum()) for j in held}
        best = min(ranks.values()) if ranks else None
        margin = entry_margin(s, held, cfg.index_topk)["margin"] if held else math.nan
        out.append({"layer": i, "entries": held, "n_visible": visible, "topk": cfg.index_topk,
                    "in_topk": any(j in picks for j in held) if held else None,
                    "best_rank": best, "in_window": in_window, "picks": sorted(picks),
                    "margin": None if math.isnan(margin) else margin,
                    "n_values": len(held_per),
                    "values_in_topk": sum(any(j in picks for j in h) for h in held_per)})
    return out
