"""llama-server's native `/completion` as a scoring dialect. llama-server returns no prompt
logprobs (no `echo`), so a prompt is read teacher-forced: its prefixes ids[:1], ids[:2], ...
are sent as one multi-prompt request per batch, each asking for one greedy token with its
top `n_probs` log-probabilities (pre-sampling, softmax over the whole vocabulary); the
distribution after prefix ids[:j+1] is position j's. With `cache_prompt` and one pinned
slot, each prefix extends the cached one by a single token, so every position is computed
by llama.cpp's decode path (a one-token batch) -- not by its prefill path, which this
reading does not measure. Each answer's `timings.prompt_n` (tokens the server evaluated
for it) is kept, so the report says how many positions really took the one-token path.
The full prompt is then asked for the greedy continuation (the decode ladder)."""
from __future__ import annotations

import numpy as np

from .bounds import Known
from .dialects import PromptScores, ScoringError, known_from_pairs

PREFIXES_PER_REQUEST = 64         # prefixes per multi-prompt /completion request
SLOT = 0                          # one pinned slot: its cache holds the previous prefix

READING = ("teacher-forced /completion prefixes (llama-server has no prompt logprobs): every "
           "position is the distribution after that prefix, computed through the decode path "
           "(one new token on a cached prefix); prefill-path numerics are not measured")


def body(prompts: list[list[int]], k: int, steps: int, model: str | None = None, *,
         temperature: float = 0.0, seed: int | None = None, ignore_eos: bool = True,
         slot: int | None = SLOT) -> dict:
    """One /completion request: `steps` new tokens per prompt (greedy unless `temperature`)
    with the pre-sampling top-k log-probs before each, the prompt cache on; `slot` pins the
    slot (None: the server chooses, as for requests that must run side by side)."""
    b = {"prompt": prompts if len(prompts) > 1 else prompts[0], "n_predict": steps, "n_probs": k,
         "post_sampling_probs": False, "temperature": temperature, "ignore_eos": ignore_eos,
         "cache_prompt": True, "return_tokens": True}
    if slot is not None:
        b["id_slot"] = slot
    if seed is not None:
        b["seed"] = seed
    if model:
        b["model"] = model
    return b


def entry_known(entry: dict) -> tuple[int, Known]:
    """(chosen token, its position's known distribution) from one completion_probabilities
    entry; a `prob` entry means post-sampling probabilities, which are not the model's."""
    try:
        tops = entry["top_logprobs"]
        pairs = [(t["id"], t["logprob"]) for t in tops] + [(entry["id"], entry["logprob"])]
    except (KeyError, TypeError):
        raise ScoringError("completion_probabilities entries lack id/logprob/top_logprobs "
                           "(needs n_probs > 0 and post_sampling_probs false)") from None
    # llama-server writes a NaN or infinite log-prob as null: kept as NaN, so a broken
    # position reads as non-finite, never as an empty (and so KL-0) distribution
    return int(entry["id"]), known_from_pairs(pairs, null_is_nan=True)


def results(data, n: int) -> list[dict]:
    """The n per-prompt results of a multi-prompt answer (a list, ordered by `index`), or
    the one result of a single-prompt answer."""
    got = data if isinstance(data, list) else [data]
    if len(got) != n or not all(isinstance(g, dict) for g in got):
        raise ScoringError(f"/completion answered {len(got)} results for {n} prompts")
    if n > 1:
        try:
            got = sorted(got, key=lambda g: g["index"])
        except (KeyError, TypeError):
            raise ScoringError("a multi-prompt answer's results carry no `index`") from None
    return got


def _checked(res: dict, prompt: list[int], steps: int) -> tuple[list[tuple[int, Known]], int]:
    """A result's per-token distributions and how many prompt tokens it evaluated; the
    server must have read the prompt we sent (its `tokens_evaluated`)."""
    probs = res.get("completion_probabilities")
    if not isinstance(probs, list) or len(probs) != steps:
        raise ScoringError(f"a result has {len(probs) if isinstance(probs, list) else 'no'} "
                           f"completion_probabilities, expected {steps}")
    if res.get("tokens_evaluated") != len(prompt):
        raise ScoringError(f"the server evaluated {res.get('tokens_evaluated')} prompt tokens, "
                           f"sent {len(prompt)}")
    evaluated = (res.get("timings") or {}).get("prompt_n")
    return [entry_known(e) for e in probs], int(evaluated) if evaluated is not None else -1


def parse_prefixes(data, prefixes: list[list[int]]) -> tuple[list[Known], list[int]]:
    """Each prefix's next-token distribution, and the tokens the server evaluated for it."""
    known, evaluated = [], []
    for res, p in zip(results(data, len(prefixes)), prefixes):
        (tok_known,), n_eval = _checked(res, p, 1)
        known.append(tok_known[1])
        evaluated.append(n_eval)
    return known, evaluated


def parse_ladder(data, ids: list[int], steps: int) -> tuple[list[int], list[Known], int]:
    """The full prompt's greedy continuation: tokens, the distribution before each, and
    the prompt tokens evaluated."""
    (res,) = results(data, 1)
    got, n_eval = _checked(res, ids, steps)
    return [t for t, _ in got], [k for _, k in got], n_eval


def assemble(ids: list[int], known: list[Known], tokens: list[int], ladder: list[Known],
             evaluated: list[int]) -> PromptScores:
    """PromptScores from the prefix distributions (positions 0..n-2) and the ladder (its
    first entry is position n-1's) and the tokens evaluated for each position."""
    n = len(ids)
    if len(known) != n - 1:
        raise ScoringError(f"{len(known)} prefix distributions for a {n}-token prompt")
    actual = [known[j].get(ids[j + 1]) for j in range(n - 1)] + [None]
    return PromptScores(list(ids), known + [ladder[0]], actual, [None] * n, tokens, ladder,
                        evaluated=np.asarray(evaluated, np.int64))


def is_llama_server(props) -> bool:
    """A /props answer in llama-server's shape."""
    return isinstance(props, dict) and "default_generation_settings" in props and "total_slots" in props


def props_summary(props: dict) -> dict:
    """What a report keeps of /props: the build, the model file's name (not its path), slots
    and context size."""
    gen = props.get("default_generation_settings") or {}
    path = str(props.get("model_path") or "")
    return {"build_info": props.get("build_info"), "model_file": path.replace("\\", "/").rsplit("/", 1)[-1],
            "total_slots": props.get("total_slots"), "n_ctx": gen.get("n_ctx")}
