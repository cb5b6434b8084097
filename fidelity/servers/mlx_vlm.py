"""mlx-vlm's DeepSeek-V4 (MLX; what Mac users run), served by fidelity's harness
(fidelity/mlxvlm/harness.py in mlx-vlm's own venv: `fidelity mlxvlm serve`). Detected by its
/props (`engine: mlx-vlm`). mlx-vlm's own server returns at most 20 log-probs of generated
tokens only, so the harness drives mlx-vlm's model and cache directly and answers POST /score
with every prompt position's log-probs (the whole vocabulary in exact mode) computed by its
route -- `decode` by default (one token per call on mlx-vlm's cache: the generation path),
or prefill, chunked:N, generate, nocache -- then a greedy ladder on the same cache; its
/v1/completions runs a prompt as mlx-vlm's generate does (chunks of 2048, the last token
alone, then one token per step)."""
from __future__ import annotations

import base64

import numpy as np

from fidelity.scores.bounds import Known
from fidelity.scores.dialects import PromptScores, ScoringError

from .base import Found, Generation, Server, completions_body, completions_reply

def is_harness(props) -> bool:
    return isinstance(props, dict) and props.get("engine") == "mlx-vlm"


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _array(d: dict, key: str, dtype, shape) -> np.ndarray:
    try:
        a = np.frombuffer(base64.b64decode(d[key]), dtype=dtype)
        return a.reshape(shape)
    except (KeyError, TypeError, ValueError):
        raise ScoringError(f"/score's `{key}` is missing or is not {_article(np.dtype(dtype).name)} array of shape {shape}") from None


def parse(d: dict, ids: list[int]) -> PromptScores:
    """PromptScores from a /score answer (top-k ids and log-probs per position, base64)."""
    if not isinstance(d, dict) or d.get("ids") != list(ids):
        raise ScoringError("the /score answer does not echo the prompt's ids")
    n, k, toks = len(ids), d.get("k"), d.get("ladder_tokens")
    if not isinstance(k, int) or not isinstance(toks, list):
        raise ScoringError("the /score answer lacks `k` or `ladder_tokens`")
    ti, tv = _array(d, "top_ids", np.int32, (n, k)), _array(d, "top_logprobs", np.float64, (n, k))
    li, lv = (_array(d, "ladder_ids", np.int32, (len(toks), k)),
              _array(d, "ladder_logprobs", np.float64, (len(toks), k)))
    actual = _array(d, "actual", np.float64, (n - 1,))
    known = [Known(ti[j].astype(np.int64), tv[j]) for j in range(n)]
    return PromptScores(list(ids), known, [float(a) for a in actual] + [None], [None] * n, [int(t) for t in toks],
                        [Known(li[j].astype(np.int64), lv[j]) for j in range(len(toks))])


class MlxVlm(Server):
    name = "mlxvlm"
    hint = "mlx-vlm through fidelity's harness (`fidelity mlxvlm serve`): POST /score"
    takes_ignore_eos = True
    exact = "full_vocab"
    reading = ("every position computed by the harness's route on mlx-vlm's own model and cache (decode: one "
               "token per call, the generation path; the route is in the endpoint's server facts)")
    launch_needs = "model = a checkpoint folder (DeepSeek's own layout), and `make mlx-vlm`"

    def claims(self, found: Found) -> bool:
        return is_harness(found.props)

    def props_summary(self, props) -> dict | None:
        if not is_harness(props):
            return None
        return {"build_info": f"mlx-vlm {props.get('mlx_vlm')} / mlx {props.get('mlx')}",
                "model_file": props.get("model_dir"), "route": props.get("route"),
                "weights": props.get("weights") + "".join(f"+{p}" for p in props.get("patches") or []),
                "loader": props.get("loader"),
                "hisa": {k: props.get(k) for k in ("index_topk", "index_block", "index_keep")}}

    def score(self, ep, ids, r, retry):
        k = 1 << 30 if r.full_vocab or r.score_ids else r.k
        return ep.call("POST", "/score", {"ids": list(ids), "k": k, "steps": r.steps},
                       retry_malformed=retry, parse=lambda d: parse(d, list(ids)))

    def generation(self, ids, g: Generation, ep):
        body = completions_body(ids, g, ep.model, {"ignore_eos": g.ignore_eos})
        return "/v1/completions", body, lambda d: completions_reply(d, None)

    def twin_of_endpoint(self, ep):
        from fidelity.mlxvlm.twin import twin
        props = (ep.info or {}).get("props") or {}
        return twin(props.get("route"), props), (
            f"mlx-vlm's arithmetic without DeepSeek's QAT simulation (the exact profile) with its HISA setting, "
            f"read by its route ({props.get('route') or 'unstated'})")

    def twin_of_arm(self, e, arm):
        flags = [*e.flags, *arm.flags]
        block = flag(flags, "--index-block")
        from fidelity.mlxvlm.convert import hisa_setting
        from fidelity.mlxvlm.twin import twin
        props = {"hisa": hisa_setting(e.model, None if block is None else int(block))}
        return twin(flag(flags, "--route") or "decode", props), \
            "mlx-vlm's arithmetic without DeepSeek's QAT simulation, with its HISA setting, read by its route"

    def check(self, e, where):
        if not e.model:
            return f"{where}: an mlxvlm engine needs {self.launch_needs}"
        return None

    def command(self, e):
        """The harness on the engine's checkpoint, loaded as its `--weights` flag says (the
        engine's flags; an arm's flags follow the command: --route, --index-block, --patch)."""
        from pathlib import Path

        from fidelity.mlxvlm import convert, paths
        weights = flag(e.flags, "--weights") or "native"
        return paths.harness_command(convert.model_dir(Path(e.model), weights), e.port, weights, host=e.host)


def flag(flags: list[str], name: str) -> str | None:
    """The last value of `--name VALUE` / `--name=VALUE` in a flag list (None: not given)."""
    got = None
    for j, f in enumerate(flags):
        if f == name and j + 1 < len(flags):
            got = flags[j + 1]
        elif f.startswith(name + "="):
            got = f.split("=", 1)[1]
    return got
