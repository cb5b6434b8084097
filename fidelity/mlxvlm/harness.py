"""mlx-vlm's DeepSeek-V4 driven as a user's program drives it, run by the mlx-vlm venv's own
Python (it imports mlx, mlx_vlm, numpy and the standard library only, never this project):

  serve  an HTTP server: /health, /v1/models, /props (what it runs: versions, weights, route),
         POST /score (every prompt position's log-probs by one route, then a greedy ladder),
         POST /v1/completions (text or token-id prompts run as mlx-vlm's generate runs a prompt;
         greedy, or sampled at the request's temperature / top_p / seed), POST
         /v1/chat/completions (rendered by mlx-vlm's DeepSeek-V4 chat template),
         POST /tokenize (the checkpoint's tokenizer.json, nothing added)
  taps   one prompt's intermediate tensors by one route, written as .npz under the replay's
         tensor names (fidelity.mlxvlm.replay), captured by wrapping mlx-vlm's module classes
         at run time (harness_capture.py): the installed package is never edited

Weights: `native` loads the checkpoint folder as DeepSeek ships it (FP8 e4m3 blocks, FP4
experts) through mlx-vlm's own loader, whose shared FP8 helper (mlx_vlm/fp8.py) otherwise
claims the whole model as MXFP8 and refuses the FP4 experts: only that claim is lifted, so
mlx-vlm's DeepSeek-V4 quantization (MXFP8 attention, MXFP4 experts, make_quantization_config)
decides, as its code intends. `f32`: a dequantised float32 copy (fidelity.mlxvlm.convert).

Routes (how a prompt's positions are computed; every one but `nocache` with mlx-vlm's cache):
  decode     one token per call: the generation path, every position
  prefill    the whole prompt in one call
  chunked:N  calls of N tokens (mlx-vlm's generate prefills in calls of 2048, then the last
             prompt token alone)
  nocache    one call without a cache (what a scorer or trainer calling the model does)"""
from __future__ import annotations

import argparse
import base64
import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import metadata
from pathlib import Path

import numpy as np

GENERATE_PREFILL = 2048            # mlx_vlm.generate's DEFAULT_PREFILL_STEP_SIZE
PATCHES = ("carry-window",)        # candidate fixes of departures found here (never on by default)


def routes(spec: str, n: int) -> list[int] | None:
    """Call sizes covering n tokens by route `spec` (None: one call without a cache)."""
    if spec == "nocache":
        return None
    if spec == "prefill":
        return [n]
    if spec == "decode":
        return [1] * n
    if spec == "generate":                           # mlx-vlm's generate: chunks, then the last token
        head = [GENERATE_PREFILL] * ((n - 1) // GENERATE_PREFILL) + ([(n - 1) % GENERATE_PREFILL] if (n - 1) % GENERATE_PREFILL else [])
        return head + [1]
    if spec.startswith("chunked:") and spec[8:].isdigit() and int(spec[8:]) > 0:
        c = int(spec[8:])
        return [c] * (n // c) + ([n % c] if n % c else [])
    raise SystemExit(f"unknown route {spec!r} (decode, prefill, chunked:N, generate, nocache)")


# ---- loading --------------------------------------------------------------------------------
def carry_window() -> None:
    """Candidate fix (docs/mlx-vlm.md): the pooling cache keeps the last completed window and the
    overlapping compressor puts it before the windows completed in a call, dropping the entry it
    then yields again -- so an entry no longer depends on which call completed its predecessor."""
    import mlx.core as mx
    from mlx_vlm.models.deepseek_v4 import language as L
    shipped = L.Compressor.__call__

    def call(self, x, pool_cache, offset):
        if pool_cache is None or not self.overlap:
            return shipped(self, x, pool_cache, offset)
        r = self.compress_ratio
        ready_kv, ready_gate, base = pool_cache.accumulate_windows(self.wkv(x), self.wgate(x), offset)
        if ready_kv.size == 0:
            return pool_cache.update_and_fetch(mx.zeros((x.shape[0], 0, self.head_dim), dtype=x.dtype))
        prev = getattr(pool_cache, "fid_prev_window", None)
        pool_cache.fid_prev_window = (ready_kv[:, -r:], ready_gate[:, -r:])
        if prev is not None:
            ready_kv, ready_gate = mx.concatenate([prev[0], ready_kv], 1), mx.concatenate([prev[1], ready_gate], 1)
        new = L._overlap_compress_kv(mx.unflatten(ready_kv, 1, (-1, r)), mx.unflatten(ready_gate, 1, (-1, r)),
                                     self.ape, self.head_dim)
        new = self.norm(new[:, 1:] if prev is not None else new)
        return pool_cache.update_and_fetch(self.rope(new[:, None], offset=base).squeeze(1))
    L.Compressor.__call__ = call


def load(model_dir: Path, weights: str, patches=(), index_block: int | None = None):
    """mlx-vlm's Model on `model_dir`, and what the load did (for /props)."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_vlm.utils import load_model
    how = "mlx-vlm's loader as installed"
    if weights == "native":
        try:
            import mlx_vlm.fp8 as fp8
            fp8.make_quantization_config = lambda config: None
            how = ("mlx-vlm's loader with its shared FP8 helper's uniform-MXFP8 claim lifted, so its "
                   "DeepSeek-V4 quantization decides (MXFP8 attention, MXFP4 experts)")
        except ImportError:                          # releases before the shared helper
            pass
    for p in patches:
        {"carry-window": carry_window}[p]()
        how += f"; patched: {p} (not mlx-vlm as shipped)"
    model = load_model(model_dir)
    if index_block is not None:                      # mlx-vlm's own HISA switch (its config's index_block; 0: off)
        model.config.index_block = index_block
        for lay in model.language_model.model.layers:
            if hasattr(lay.attn, "indexer"):
                lay.attn.indexer.index_block = index_block
        how += f"; index_block {index_block} (config override)"
    if weights == "f32":                             # every float parameter float32 (CPU GatherMM needs it)
        model.update(tree_map(lambda a: a.astype(mx.float32)
                              if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating) else a,
                              model.parameters()))
    return model, how


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ---- running a prompt ------------------------------------------------------------------------
class Runner:
    def __init__(self, model, route: str):
        self.model, self.lm, self.route = model, model.language_model, route

    def logprobs(self, logits) -> np.ndarray:
        import mlx.core as mx
        x = np.array(logits.astype(mx.float32), dtype=np.float64)
        m = x.max(-1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))

    def prompt(self, ids: list[int]):
        """(log-probs at every position [n, V], the cache or None, call sizes)."""
        import mlx.core as mx
        calls = routes(self.route, len(ids))
        if calls is None:
            out = self.lm(mx.array(ids)[None]).logits[0]
            return self.logprobs(out), None, [len(ids)]
        cache, parts, a = self.lm.make_cache(), [], 0
        for c in calls:
            out = self.lm(mx.array(ids[a:a + c])[None], cache=cache).logits[0]
            mx.eval(out)
            parts.append(self.logprobs(out))
            a += c
        return np.concatenate(parts), cache, calls

    def ladder(self, ids: list[int], first: np.ndarray, cache, steps: int, pick=None):
        """The continuation after the prompt (greedy unless `pick(log-probs) -> token`): tokens
        and the log-probs before each."""
        import mlx.core as mx
        toks, dists, cur, seq = [], [first], first, list(ids)
        for s in range(steps):
            t = int(np.argmax(cur)) if pick is None else pick(cur)
            toks.append(t)
            seq.append(t)
            if s == steps - 1:
                break
            if cache is None:
                cur = self.logprobs(self.lm(mx.array(seq)[None]).logits[0, -1])
            else:
                cur = self.logprobs(self.lm(mx.array([t])[None], cache=cache).logits[0, -1])
            dists.append(cur)
        return toks, np.stack(dists)


def sampler(temperature: float, top_p: float, seed: int):
    """None (greedy) at temperature 0, else a seeded draw from softmax(log-probs / T) kept to
    the top_p nucleus (as mlx-vlm's own sampler defines them)."""
    if temperature <= 0:
        return None
    rng = np.random.default_rng(seed)

    def pick(lp: np.ndarray) -> int:
        p = np.exp((lp - lp.max()) / temperature)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
        return int(rng.choice(keep, p=p[keep] / p[keep].sum()))
    return pick


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def top(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids (descending) and their log-probs per row; k >= vocabulary: every id."""
    k = min(k, lp.shape[-1])
    idx = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return idx.astype(np.int32), np.take_along_axis(lp, idx, -1)


# ---- serve -----------------------------------------------------------------------------------
class Service:
    def __init__(self, args):
        self.args = args
        self.model, self.loader = load(Path(args.model), args.weights, args.patch, args.index_block)
        self.cfg = json.loads((Path(args.model) / "config.json").read_text())
        self.runner = Runner(self.model, args.route)
        tok = Path(args.model) / "tokenizer.json"
        self.tok = None
        if tok.is_file():                            # the checkpoint's own tokenizer, nothing added
            from tokenizers import Tokenizer
            self.tok = Tokenizer.from_file(str(tok))

    def encode(self, text: str) -> list[int]:
        if self.tok is None:
            raise ValueError("a text prompt needs the checkpoint's tokenizer.json; send token ids")
        return self.tok.encode(text, add_special_tokens=False).ids

    def render(self, messages) -> str:
        """A chat as mlx-vlm's DeepSeek-V4 processor renders it: the model folder's
        chat_template.jinja, else its DEFAULT_CHAT_TEMPLATE, with the generation prompt."""
        import jinja2
        from mlx_vlm.models.deepseek_v4 import processing_deepseek_v4 as proc
        own = Path(self.args.model) / "chat_template.jinja"
        template = own.read_text() if own.is_file() else proc.DEFAULT_CHAT_TEMPLATE
        if not isinstance(messages, list) or not messages:
            raise ValueError("`messages` must be a non-empty list")
        msgs = [{**m, "content": proc.DeepseekV4Processor._content_to_text(m.get("content", ""))} for m in messages]
        return jinja2.Environment().from_string(template).render(messages=msgs, add_generation_prompt=True)

    def chat(self, body: dict) -> dict:
        got = self.complete({**body, "prompt": self.encode(self.render(body.get("messages")))})
        ch = got["choices"][0]
        msg = {"role": "assistant", "content": ch["text"]}
        return {**got, "object": "chat.completion",
                "choices": [{"index": 0, "message": msg, "finish_reason": ch["finish_reason"]}]}

    def tokenize(self, body: dict) -> dict:
        text = body.get("prompt", body.get("content"))
        if not isinstance(text, str):
            raise ValueError("`prompt` must be a string")
        ids = self.encode(text)
        return {"tokens": ids, "count": len(ids)}

    def props(self) -> dict:
        c = self.model.config
        return {"engine": "mlx-vlm", "mlx_vlm": version("mlx-vlm"), "mlx": version("mlx"),
                "name": self.args.name, "weights": self.args.weights, "route": self.args.route,
                "patches": list(self.args.patch),
                "model_dir": Path(self.args.model).name, "loader": self.loader, "n_vocab": int(c.vocab_size),
                "index_topk": int(c.index_topk), "index_block": int(getattr(c, "index_block", 0)),
                "index_keep": int(getattr(c, "index_keep", 0))}

    def score(self, body: dict) -> dict:
        ids = [int(i) for i in body["ids"]]
        if not ids:
            raise ValueError("`ids` is empty")
        k, steps = int(body.get("k", 20)), max(1, int(body.get("steps", 1)))
        lp, cache, calls = self.runner.prompt(ids)
        toks, ladder = self.runner.ladder(ids, lp[-1], cache, steps)
        ti, tv = top(lp, k)
        li, lv = top(ladder, k)
        actual = lp[np.arange(len(ids) - 1), ids[1:]]
        return {"ids": ids, "k": int(ti.shape[1]), "route": self.args.route, "calls": calls,
                "top_ids": b64(ti), "top_logprobs": b64(tv), "actual": b64(actual),
                "ladder_tokens": toks, "ladder_ids": b64(li), "ladder_logprobs": b64(lv)}

    def complete(self, body: dict) -> dict:
        """Generation after a prompt run as mlx-vlm's generate runs it: greedy, or sampled at the
        request's temperature / top_p with its seed."""
        ids = body.get("prompt")
        if isinstance(ids, str):
            ids = self.encode(ids)
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
            raise ValueError("`prompt` must be a text or a non-empty list of token ids")
        n, k = int(body.get("max_tokens", 16)), int(body.get("logprobs") or 0)
        run = Runner(self.model, "generate")
        lp, cache, _ = run.prompt(ids)
        pick = sampler(float(body.get("temperature") or 0.0), float(body.get("top_p") or 1.0), int(body.get("seed") or 0))
        toks, dists = run.ladder(ids, lp[-1], cache, n, pick)
        eos = self.cfg.get("eos_token_id")
        stop = [j for j, t in enumerate(toks) if t == eos and not body.get("ignore_eos")]
        if stop:
            toks, dists = toks[:stop[0] + 1], dists[:stop[0] + 1]
        text = self.tok.decode(toks, skip_special_tokens=True) if self.tok is not None else ""
        choice = {"index": 0, "text": text, "token_ids": toks, "finish_reason": "stop" if stop else "length"}
        if k:
            ti, tv = top(dists, k)
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in toks],
                                  "token_logprobs": [float(d[t]) for d, t in zip(dists, toks)],
                                  "top_logprobs": [{f"token_id:{int(i)}": float(v) for i, v in zip(a, b)}
                                                   for a, b in zip(ti, tv)]}
        return {"object": "text_completion", "model": self.args.name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(toks)}}


def handler(svc: Service):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def send(self, code: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self.send(200, {"ok": True})
            if self.path == "/v1/models":
                return self.send(200, {"object": "list", "data": [{"id": svc.args.name, "object": "model",
                                       "owned_by": "mlx-vlm", "meta": {"n_vocab": svc.props()["n_vocab"]}}]})
            if self.path == "/props":
                return self.send(200, svc.props())
            self.send(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError:
                return self.send(400, {"error": "the body is not JSON"})
            route = {"/score": svc.score, "/v1/completions": svc.complete, "/v1/chat/completions": svc.chat,
                     "/tokenize": svc.tokenize}.get(self.path)
            if route is None:
                return self.send(404, {"error": f"no route {self.path}"})
            try:
                return self.send(200, route(body))
            except (KeyError, TypeError, ValueError) as e:
                return self.send(400, {"error": f"bad request: {e}"})
    return H


def taps(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))   # harness_capture beside this file (run as a script)
    from harness_capture import capture
    model, _ = load(Path(args.model), args.weights, args.patch, args.index_block)
    rec = capture(model)
    ids = [int(i) for i in np.load(args.ids)]
    lp, _, calls = Runner(model, args.route).prompt(ids)
    out = {k: np.concatenate(v, axis=0) for k, v in rec.items() if v}
    out["logprobs"] = lp
    out["calls"] = np.asarray(calls, np.int64)
    np.savez(args.out, **out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("serve", "taps"))
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors)")
    p.add_argument("--weights", choices=("native", "f32"), default="native")
    p.add_argument("--route", default="decode")
    p.add_argument("--name", default="mlx-vlm", help="serve: the model id it answers to")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--patch", action="append", default=[], choices=PATCHES,
                   help="a candidate fix applied at run time (repeatable; never by default)")
    p.add_argument("--index-block", type=int, default=None,
                   help="mlx-vlm's HISA block size instead of the config's (0: HISA off, the exact top-k)")
    p.add_argument("--ids", help="taps: .npy of token ids")
    p.add_argument("--out", help="taps: .npz written")
    args = p.parse_args(argv)
    routes(args.route, 2)                            # a bad route fails before the model loads
    if args.mode == "taps":
        return taps(args)
    svc = Service(args)
    srv = HTTPServer((args.host, args.port), handler(svc))
    print(f"mlx-vlm {version('mlx-vlm')} ({args.weights}, route {args.route}) on http://{args.host}:{args.port}",
          flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
