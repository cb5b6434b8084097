"""llama.cpp's llama-server. Detected by /props; launched from the pinned build (or a
history build), its toggles as llama-server flags and env (fidelity.llamacpp.flags), its
twin llama.cpp's exact profile read position by position.

Its native `/completion` as a scoring dialect. llama-server returns no prompt
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

from dataclasses import replace

import numpy as np

from needle.http import llama_tokenize_body

from fidelity.scores.bounds import Known
from fidelity.scores.dialects import PromptScores, ScoringError, known_from_pairs

from .base import Found, Generation, Reply, Server

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


def reply(d: dict) -> Reply:
    """Tokens, top-k, cached tokens (`timings.cache_n`: prompt tokens taken from its cache)
    and the stop reason of a /completion answer."""
    probs = d.get("completion_probabilities") if isinstance(d, dict) else None
    if not isinstance(probs, list):
        raise ScoringError("the /completion answer has no completion_probabilities (send n_probs k)")
    got = [entry_known(e) for e in probs]
    finish = {"limit": "length", "eos": "stop", "word": "stop"}.get(str(d.get("stop_type")), str(d.get("stop_type") or ""))
    return Reply([t for t, _ in got], [k for _, k in got], (d.get("timings") or {}).get("cache_n"), finish)


class LlamaCpp(Server):
    name = "llamacpp"
    hint = "llama.cpp: llama-server's native /completion with n_probs (read teacher-forced, prefix by prefix)"
    takes_ignore_eos = True
    reading = READING
    launch_needs = "model = a .gguf file (`fidelity llamacpp prepare` writes one for a checkpoint)"

    def claims(self, found: Found) -> bool:
        return found.llama_server

    def props_summary(self, props):
        return props_summary(props) if is_llama_server(props) else None

    def score(self, ep, ids, r, retry):
        """Teacher-forced: the prefixes in batches, in order on one slot, then the full
        prompt's greedy ladder. Only one batch of prefixes is ever built (all of them at once
        would be quadratic in the prompt's length)."""
        r = replace(r, model=ep.model)
        known, evaluated = [], []
        for a in range(0, len(ids) - 1, PREFIXES_PER_REQUEST):
            batch = [list(ids[:j + 1]) for j in range(a, min(a + PREFIXES_PER_REQUEST, len(ids) - 1))]
            k, ev = ep.call("POST", "/completion", body(batch, r.k, 1, r.model), retry_malformed=retry,
                            parse=lambda d, b=batch: parse_prefixes(d, b))
            known += k
            evaluated += ev
        tokens, ladder, ev = ep.call("POST", "/completion", body([list(ids)], r.k, r.steps, r.model),
                                     retry_malformed=retry, parse=lambda d: parse_ladder(d, list(ids), r.steps))
        return assemble(list(ids), known, tokens, ladder, evaluated + [ev])

    def tokenize_body(self, text, model):
        return llama_tokenize_body(text)

    def generation(self, ids, g: Generation, ep):
        # no pinned slot: batch probes run side by side
        b = body([list(ids)], g.k, g.max_tokens, ep.model, temperature=g.temperature, seed=g.seed,
                 ignore_eos=g.ignore_eos, slot=None)
        return "/completion", b, reply

    def twin_of_endpoint(self, ep):
        from fidelity.llamacpp.flags import scored_twin
        return scored_twin([]), ("llama-server's default flags (-ctk f16; /props does not state the cache type), "
                                 "scored position by position as its scores are read")

    def twin_of_arm(self, e, arm):
        from fidelity.llamacpp import flags as LF
        if arm.toggles is not None:             # scored position by position, as llama-server is read
            return (f"{LF.PROFILE}:{arm.toggles}@{LF.SCORED_ON}",
                    "the arm's toggles (on llama.cpp's exact profile, position by position)")
        try:
            return LF.scored_twin([*e.flags, *arm.flags], {**e.env, **arm.env}), "llama-server's flags and env"
        except LF.FlagError:
            return None                   # the launch plan already refuses what cannot be modelled

    def flag_factors(self, flags, env):
        """What attribution credits for `-ctk q8_0` (FlagError when a flag cannot be modelled)."""
        from fidelity.llamacpp import flags as LF
        return set(LF.read(flags, env).factors()), not LF.only_numerics(flags, env)

    def check(self, e, where):
        if not (e.model or "").endswith(".gguf"):
            return f"{where}: a llamacpp engine needs {self.launch_needs}"
        return None

    def command(self, e):
        from fidelity.llamacpp import paths
        return paths.server_command(e.model, e.host, e.port)

    def numerics(self, arm, e, env, flags, notes):
        from fidelity.llamacpp import flags as LF
        from fidelity.llamacpp import paths

        from .profiled import LaunchRefused
        if arm.toggles is not None:             # its in-process twin's spelling -> flags and env
            try:
                more_flags, more_env = LF.launch_of(arm.toggles)
            except LF.FlagError as ex:
                raise LaunchRefused(f"arm {arm.name}: {ex}") from None
            flags += more_flags
            env.update(more_env)
            notes.append(f"numerics: the {LF.PROFILE} profile with {arm.toggles}")
        if paths.built() != paths.PINNED:
            notes.append("llama.cpp is not built here: `make llama-cpp` builds the pinned llama-server")
