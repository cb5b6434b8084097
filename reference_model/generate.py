"""Token generation on the golden model: prefill, then one-token decode steps, greedy or
sampled (temperature / top-p / top-k with a per-request seed, optional logit bias), with
optional logprobs of the prompt and of the output. `Decoder` runs one forward per `step()`
so a server can interleave requests and drop a cancelled one between steps; `generate()`
runs a Decoder to the end. Shared by `fidelity serve` and the in-process needle runner so
both decode the same way."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .model import Model, SequenceState
from .sampling import pick
from .taps import Taps


@dataclass
class TokenScore:
    """One position's scores, from the raw distribution (before temperature, bias and
    truncation: engines' `raw_logprobs`). rank = 1 + number of ids with a higher logprob."""
    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]            # the k most likely ids, descending
    ids: list[tuple[int, float]]            # requested ids, in the order asked


@dataclass
class Generation:
    """A finished generation. `tokens` is the text-bearing output (no stop id); the sampled
    stop id (EOS or a stop token id) is `stop_token`, and `output_ids` = tokens + stop id is
    what engines return as token ids, score and count (`scores` has one entry per output id),
    so `logprobs` / `top_logprobs` cover the stop token too: an eval that sums a
    continuation's logprobs sees every sampled token."""
    tokens: list[int]                       # generated ids (stop id not included)
    finish_reason: str                      # "stop" (eos / stop id / stop string) or "length"
    scores: list[TokenScore] = field(default_factory=list)        # per output id (stop id too)
    prompt_scores: list[TokenScore | None] | None = None          # from Scoring.prompt_from on
    stop_token: int | None = None
    taps: Taps | None = None                # captures of every forward (prompt, then tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens + ([] if self.stop_token is None else [self.stop_token])

    @property
    def logprobs(self) -> list[float]:
        return [s.logprob for s in self.scores]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]]:
        return [s.top for s in self.scores]

    @property
    def prompt_logprobs(self) -> list[float | None] | None:
        return None if self.prompt_scores is None else [
            None if s is None else s.logprob for s in self.prompt_scores]

    @property
    def prompt_top_logprobs(self):
        return None if self.prompt_scores is None else [
            None if s is None else s.top for s in self.prompt_scores]


@dataclass
class Sampling:
    temperature: float = 0.0                # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1                         # -1 or 0 = off
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)   # added before sampling


@dataclass
class Scoring:
    """What to score. `top` = None: no output logprobs; k >= 0: each token's logprob and
    the top k. `prompt_top` = None: no prompt scores; k >= 0: every prompt position from
    `prompt_from` (>= 1: position 0 has nothing predicting it) with the top k. `ids` are
    scored at every scored position."""
    top: int | None = None
    prompt_top: int | None = None
    prompt_from: int = 1
    ids: tuple[int, ...] = ()

    @classmethod
    def of_logprobs(cls, k: int | None, echo: bool = False) -> Scoring:
        """OpenAI's `logprobs=k` (each token's raw logprob and the top k) and `echo` (the
        prompt's too, from position 0)."""
        return cls(top=k, prompt_top=(k or 0) if echo else None, prompt_from=0)


Prefill = Callable[[Model, torch.Tensor, bool], tuple[torch.Tensor, SequenceState]]
ROWS_PER_CHUNK = 256                        # prompt rows turned into log-probs at a time


def default_prefill(model: Model, ids: torch.Tensor, all_logits: bool, taps: Taps | None = None):
    """Run the prompt; logits of the last position ([1, V]) or of every position."""
    return model.extend(ids, None, "all" if all_logits else "last", taps)


def _score_row(lp: torch.Tensor, token: int, k: int, ids) -> TokenScore:
    v = float(lp[token])
    top = []
    if k:
        tv, ti = torch.topk(lp, min(k, lp.numel()))
        top = [(int(a), float(b)) for a, b in zip(ti, tv)]
    return TokenScore(token, v, 1 + int((lp > v).sum()), top, [(int(i), float(lp[i])) for i in ids])


def score_prompt(logits: torch.Tensor, ids: torch.Tensor, k: int, start: int = 1,
                 score_ids=()) -> list[TokenScore | None]:
    """Scores of prompt tokens start..n-1 (row j-1 of `logits` predicts token j), None for
    position 0 when start is 0. Log-softmax in float64, a chunk of rows at a time, so a long
    prompt never holds [n, V] doubles."""
    n = len(ids)
    out: list[TokenScore | None] = [None] if start == 0 else []
    first = max(start, 1)
    for a in range(first, n, ROWS_PER_CHUNK):
        b = min(a + ROWS_PER_CHUNK, n)
        lp = torch.log_softmax(logits[a - 1:b - 1].double(), -1)
        out += [_score_row(lp[j - a], int(ids[j]), k, score_ids) for j in range(a, b)]
    return out


_pick = pick                                # the name tests and older callers use (sampling.py)


class Decoder:
    """One request's generation, one forward per step(): the first step runs the prompt,
    each later step one new token. `done` is set when a stop id, a stop condition, the
    token budget or the model's context length ends it."""

    def __init__(self, model: Model, prompt_ids, max_tokens: int, sampling: Sampling | None = None,
                 stop_ids=(), scoring: Scoring | None = None, prefill: Prefill = default_prefill,
                 should_stop: Callable[[list[int]], bool] | None = None, capture=None):
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.model, self.max_tokens = model, max_tokens
        self.ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        self.sampling = sampling or Sampling()
        self.scoring = scoring or Scoring()
        self.stop_ids, self.prefill, self.should_stop = set(stop_ids), prefill, should_stop
        s = self.sampling
        self.gen = torch.Generator().manual_seed(int(s.seed)) if s.seed is not None else None
        if self.gen is None and s.temperature > 0:
            self.gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))
        self.taps = Taps(list(capture)) if capture else None
        self.out = Generation([], "length", taps=self.taps)
        self.state: SequenceState | None = None
        self.steps = 0
        self.done = False

    def next_tokens(self) -> int:
        """Tokens the next step() feeds the model: the prompt, then one; 0 when done."""
        if self.done:
            return 0
        return len(self.ids) if self.state is None else 1

    def step(self) -> int | None:
        """Run one forward and pick the next token; returns it (None when none was added)."""
        if self.done:
            return None
        if self.state is None:
            logits = self._prefill()
        else:
            logits, self.state = self.model.extend(torch.tensor([self.out.tokens[-1]]), self.state,
                                                   "last", self.taps)
        return self.advance(logits)

    def advance(self, logits: torch.Tensor, state: SequenceState | None = None) -> int | None:
        """The rest of a step once its forward has run: count it, pick the next token, check
        the stop conditions. step() calls it; a runner that runs the forward itself (layer-
        major across requests, fidelity.needle_run.batch) passes the logits of the last position
        and the state it advanced. Prompt scoring is step()'s prefill's, not done here."""
        if state is not None:
            self.state = state
        self.steps += 1
        if len(self.out.tokens) >= self.max_tokens:           # max_tokens 0: prompt only
            self.done = True
            return None
        return self._choose(logits[-1])

    def _prefill(self) -> torch.Tensor:
        sc = self.scoring
        want_all = sc.prompt_top is not None
        if self.taps is not None:
            logits, self.state = self.prefill(self.model, self.ids, want_all, self.taps)
        else:
            logits, self.state = self.prefill(self.model, self.ids, want_all)
        if want_all:
            self.out.prompt_scores = score_prompt(logits, self.ids, sc.prompt_top,
                                                  sc.prompt_from, sc.ids)
            logits = logits[-1:]
        return logits

    def _choose(self, step: torch.Tensor) -> int | None:
        return self._take(pick(step, self.sampling, self.gen), step, self.state.pos)

    def _take(self, tok: int, step: torch.Tensor, fed: int) -> int | None:
        """Record a picked token (scores from its row `step`) and check the stop conditions;
        `fed` = tokens in the state once the row was computed (a speculative decoder takes
        several tokens per forward)."""
        out, sc = self.out, self.scoring
        if sc.top is not None:
            out.scores.append(_score_row(torch.log_softmax(step.double(), -1), tok, sc.top, sc.ids))
        if tok in self.stop_ids:
            out.finish_reason, out.stop_token, self.done = "stop", tok, True
            return None
        out.tokens.append(tok)
        if self.should_stop is not None and self.should_stop(out.tokens):
            out.finish_reason, self.done = "stop", True
        elif len(out.tokens) >= self.max_tokens or fed + 1 > self.model.cfg.max_seq_len:
            self.done = True
        return tok

    def run(self) -> Generation:
        while not self.done:
            self.step()
        return self.out


def generate(model: Model, prompt_ids, max_tokens: int, sampling: Sampling | None = None,
             scoring: Scoring | None = None, **decoder) -> Generation:
    """Generate up to `max_tokens` tokens after `prompt_ids`: a Decoder run to its end.
    `scoring=Scoring.of_logprobs(k, echo)` returns each token's logprob (raw, before
    temperature) and the top-k, and with `echo` scores the prompt too. `decoder`: the
    Decoder's other keywords (stop_ids, prefill, should_stop(tokens) to end early, capture)."""
    return Decoder(model, prompt_ids, max_tokens, sampling, scoring=scoring, **decoder).run()
