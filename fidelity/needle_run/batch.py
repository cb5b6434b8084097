"""Needle trials run layer-major: every trial of a batch goes through layer i before any
goes through layer i+1, so each layer's weights are fetched once per pass for the whole
batch (a streamed checkpoint reads a layer from disk per fetch; run one at a time, every
trial re-read every layer at prefill and at every decode step).

Each trial keeps what the one-at-a-time runner (fidelity.needle_run.runner.InProcessRunner.run)
gives it: its own SequenceState, its own Decoder (sampler, seed, stop ids, token budget),
its own taps and index-score recordings, and the same computation in the same order on
its own state: the prompt but its last token through `runner.model`, the last token
through the recording model, then one decode step per pass through `runner.model`. So
rows are identical to the one-at-a-time runner's, bit for bit (tests/test_needle_batch.py).
A finished trial drops out of the next decode pass; a trial whose forward fails gets an
error row, as one at a time, and the others go on.

Memory: every trial of a batch holds its state and, during the prefill pass, its residual
stream ([tokens, hc_mult, dim] in the storage dtype) at once, so batches are bounded by
trial count and by prompt tokens (`plan_batches`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from needle.haystack import Prompt
from reference_model import Taps
from reference_model.generate import Decoder, Sampling

DEFAULT_BATCH_TOKENS = 1 << 16       # prompt tokens per batch (a longer trial runs alone)


def plan_batches(sizes: list[int], max_trials: int | None = None,
                 max_tokens: int | None = DEFAULT_BATCH_TOKENS) -> list[list[int]]:
    """Consecutive groups of trial indices: a group closes before it would exceed
    `max_trials` trials or `max_tokens` prompt tokens (None: no limit). A single trial
    over the token bound still runs, alone."""
    if max_trials is not None and max_trials < 1:
        raise ValueError(f"max trials per batch must be at least 1, got {max_trials}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max prompt tokens per batch must be at least 1, got {max_tokens}")
    out: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i, n in enumerate(sizes):
        full = (max_trials is not None and len(cur) >= max_trials) or (
            max_tokens is not None and cur and tokens + n > max_tokens)
        if full:
            out.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    if cur:
        out.append(cur)
    return out


@dataclass(frozen=True)
class InProcessOptions:
    """How an in-process needle arm runs besides its sampling, one value per runner."""
    profile: str = "reference"            # the arm's numerics profile
    mechanism: bool = True                # record why a trial hit or missed (the indexer's picks)
    placement: object = None              # fidelity.weights.devices placement (None: one device)
    batch: int | None = None              # trials per layer-major batch (None: no bound)
    batch_tokens: int | None = DEFAULT_BATCH_TOKENS   # prompt tokens per batch
    driver: object = None                 # fidelity.pipeline.model.Driver under --distributed


@dataclass
class InProcessTrial:
    """One in-process needle trial: its tokenized prompt, its taps and index scores, and,
    in a batch, its decoder and streams between layers (run() makes one without them)."""
    index: int
    prompt: Prompt
    ids: list[int]
    offsets: list
    taps: Taps
    dec: Decoder | None = None
    state: object = None
    head: torch.Tensor | None = None          # prompt tokens but the last (None: a 1-token prompt)
    last: torch.Tensor | None = None          # the last prompt token, then each decode input
    h_head: torch.Tensor | None = None        # residual streams between layers
    h_last: torch.Tensor | None = None
    scores: list = field(default_factory=list)


def run_layer_major(runner, items: list[tuple[Prompt, int]], on_done) -> None:
    """Run trials (prompt, seed) as one batch; `on_done(index, result)` is called as each
    trial finishes, with the row `runner.run(prompt, seed)` would return (its `latency_s`:
    from the batch's start to the trial's end; `batch_trials`: the batch's size)."""
    t0 = time.perf_counter()
    tok = runner.target.tokenizer
    trials = []
    for k, (prompt, seed) in enumerate(items):
        ids, offsets = tok.encode_with_offsets(prompt.text)
        tr = InProcessTrial(k, prompt, ids, offsets, Taps(["layers.*.attn.index.topk"]))
        try:
            tr.dec = Decoder(runner.model, ids, runner._budget(prompt),
                             Sampling(runner.temperature, runner.top_p, seed=seed % (2**63)),
                             {tok.eos_id})
            _start(runner, tr)
        except (ValueError, RuntimeError) as e:
            on_done(k, _error(tr, e, t0, len(items)))
            continue
        trials.append(tr)

    def finish(tr):
        on_done(tr.index, {**runner._row(tr, tr.dec.out, t0), "batch_trials": len(items)})

    def fail(tr, e):
        trials.remove(tr)
        on_done(tr.index, _error(tr, e, t0, len(items)))

    _layers(runner, trials, fail, _prefill_layer)
    for tr in list(trials):
        try:
            tr.state.pos = tr.dec.ids.numel()
            logits = runner.model_rec.head(tr.h_last[-1:], _taps(runner, tr))
            tr.h_head = tr.h_last = None
            tr.dec.advance(logits, tr.state)
        except (ValueError, RuntimeError) as e:
            fail(tr, e)
    while True:
        for tr in [t for t in trials if t.dec.done]:
            trials.remove(tr)
            finish(tr)
        if not trials:
            return
        for tr in list(trials):
            try:
                tr.last = runner.model.check_tokens(torch.tensor([tr.dec.out.tokens[-1]]), tr.state)
                tr.h_last = runner.model.embed(tr.last)
            except (ValueError, RuntimeError) as e:
                fail(tr, e)
        _layers(runner, trials, fail, _decode_layer)
        for tr in list(trials):
            try:
                logits = runner.model.head(tr.h_last[-1:])
                tr.state.pos += 1
                tr.dec.advance(logits, tr.state)
            except (ValueError, RuntimeError) as e:
                fail(tr, e)


def _taps(runner, tr):
    return tr.taps if runner.mechanism else None


def _start(runner, tr: InProcessTrial) -> None:
    """Check and embed the prompt as the one-at-a-time prefill does: tokens[:-1] from an
    empty state through the model, then the last token at position n-1 through the
    recording model."""
    t = tr.dec.ids
    tr.state = runner.model.new_state()
    n = t.numel() - 1 if t.numel() > 1 else 0
    if n:
        tr.head = runner.model.check_tokens(t[:-1], tr.state)
        tr.h_head = runner.model.embed(tr.head)
    tr.state.pos = n
    tr.last = runner.model_rec.check_tokens(t[-1:], tr.state)
    tr.h_last = runner.model_rec.embed(tr.last, _taps(runner, tr))


def _layers(runner, trials, fail, one) -> None:
    """Layer i for every trial still running, then layer i+1."""
    for i in range(runner.model.cfg.n_layers):
        for tr in list(trials):
            try:
                one(runner, tr, i)
            except (ValueError, RuntimeError) as e:
                fail(tr, e)


def _prefill_layer(runner, tr: InProcessTrial, i: int) -> None:
    """Layer i of the prefill: the head of the prompt at positions 0.., then the last token
    at position n-1 on the state the head left in layer i (Model.layer reads `state.pos`)."""
    n = 0 if tr.head is None else tr.head.numel()
    if n:
        tr.state.pos = 0
        tr.h_head = runner.model.layer(i, tr.h_head, tr.head, tr.state, None, "prefill")
    tr.state.pos = n
    runner.record_into(tr.scores)
    tr.h_last = runner.model_rec.layer(i, tr.h_last, tr.last, tr.state, _taps(runner, tr), "prefill")


def _decode_layer(runner, tr: InProcessTrial, i: int) -> None:
    tr.h_last = runner.model.layer(i, tr.h_last, tr.last, tr.state, None, "decode")


def _error(tr: InProcessTrial, e: Exception, t0: float, size: int) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "attempts": 1, "latency_s": time.perf_counter() - t0,
            "prompt_tokens": len(tr.ids), "batch_trials": size}
