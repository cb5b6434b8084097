"""What the server serves: one checkpoint and tokenizer, one or more arms over it (each a
Model sharing the converted weights, selected by the request's `model`), and the
scheduler that runs every request's steps. Also turns a chat request into prompt ids and
a finished request's taps into the engines' capture layout."""
from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from reference_model import Model, build_model
from reference_model.generate import Decoder, Sampling, Scoring, score_prompt
from reference_model.state import state_bytes
from reference_model.tokenizer import BOS, EOS

from .errors import ApiError, model_not_found
from .fields import Fields
from .prefix_cache import DEFAULT_BUDGET, DEFAULT_PAGE_SIZE, PrefixCache, page_keys, paged_prefill, restore
from .scheduler import Job, Scheduler

INDEXER_TAP = "layers.*.attn.index.topk"
EXPERTS_TAP = "layers.*.ffn.router.experts"
CONTENT_ROLES = ("system", "developer", "user")


@dataclass
class ServedArm:
    id: str                     # the `model` a request names
    arm: object                 # fidelity.design.arms.NumericsArm
    model: Model


def parse_arm_options(values: list[str]) -> list[tuple[str | None, str]]:
    """`--arm` values: 'NAME=ARM' (served as model NAME) or a bare 'ARM'. A toggle's own
    parameters look like 'splitk_decode(splits=8)', so '=' counts only before any '('."""
    out = []
    for v in values:
        head = v.split("(", 1)[0]
        if "=" in head:
            name, arm = v.split("=", 1)
            if not name.strip():
                raise ValueError(f"--arm {v!r}: empty name before '='")
            out.append((name.strip(), arm))
        else:
            out.append((None, v))
    return out


@dataclass
class ServeOptions:
    """How `fidelity serve` serves its arms (the command's options)."""
    model_name: str | None = None        # the one arm's model name (default: the checkpoint's)
    max_jobs: int = 256                  # requests queued or running before 429
    max_logprobs: int = 20               # cap on every logprobs field (-1: the vocabulary)
    time_slice: float = 1.0              # seconds a request runs before the next one's turn
    generation: str = "0731"             # chat encoding: V4's 0731 / original tiers, or v41 (DeepSeek-V4.1)
    placement: object = None             # fidelity.weights.devices placement (devices, compute dtype)
    default_arm: str | None = None       # answers requests naming no model
    page_size: int = DEFAULT_PAGE_SIZE   # prefix-cache page (tokens per snapshot step)
    prefix_cache_bytes: int | None = DEFAULT_BUDGET   # snapshot budget (None: no prefix cache)
    chunked_prefill: int = 2048          # prefill chunk: tokens per layer pass, chunk_boundary between
    driver: object = None                # fidelity.pipeline.model.Driver: arms run across torchrun ranks
    speculation: object = None           # fidelity.serve.speculative.Speculation (None: plain decoding)


class CachedDecoder(Decoder):
    """A Decoder whose prefill goes through the server's prefix cache: the longest cached
    page-aligned prefix shorter than the prompt is restored through the arm's
    `state_restore`, the rest prefilled page by page (snapshots kept). A request that scores
    prompt positions from `prompt_from` restores at most prompt_from - 1 tokens (the rows it
    needs are computed: SGLang's logprob_start_len rule; prompt_from 0, vLLM's
    prompt_logprobs and OpenAI's echo, is a full bypass, as vLLM skips the cache for
    prompt_logprobs); a request with captures bypasses it (every row forwarded).
    `out.cached_tokens` is the restored prefix's length."""

    def __init__(self, *args, cache: PrefixCache | None = None, arm_id: str = "", **kw):
        super().__init__(*args, **kw)
        self.cache, self.arm_id = cache, arm_id
        self.out.cached_tokens = 0

    def _prefill(self) -> torch.Tensor:
        if self.cache is None or self.taps is not None:
            return super()._prefill()
        sc = self.scoring
        want_all = sc.prompt_top is not None
        ids = self.ids.tolist()
        keys = page_keys(self.arm_id, ids, self.cache.page)
        limit = max(sc.prompt_from - 1, 0) if want_all else len(ids)
        n, stored = self.cache.lookup(keys, len(ids), limit)
        state = restore(self.model, stored) if stored is not None else self.model.new_state()
        logits, self.state = paged_prefill(self.model, self.ids, state, self.cache, keys, want_all)
        self.out.cached_tokens = n
        if want_all:
            self.out.prompt_scores = score_prompt(logits, self.ids[n:], sc.prompt_top,
                                                  sc.prompt_from - n, sc.ids)
            logits = logits[-1:]
        return logits


@dataclass(frozen=True)
class GenerationRequest:
    """What one request asks the model to generate, read from any route's fields, so every
    route submits the same way and Engine.submit stays short."""
    max_tokens: int
    sampling: Sampling
    scoring: Scoring | None = None          # logprobs to score (None: none)
    stop: tuple[str, ...] = ()              # stop strings (cut from the text)
    stop_ids: tuple[int, ...] = ()          # stop token ids besides EOS
    ignore_eos: bool = False
    capture: tuple[str, ...] = ()           # tap patterns recorded (SGLang's captures)

    def __post_init__(self):
        for k in ("stop", "stop_ids", "capture"):       # lists from the JSON body, kept immutable
            object.__setattr__(self, k, tuple(getattr(self, k)))


class Engine:
    def __init__(self, target, arms: list[tuple[str | None, object]], options: "ServeOptions | None" = None):
        if not arms:
            raise ValueError("no arm to serve")
        o = options or ServeOptions()
        if o.chunked_prefill < 1:
            raise ValueError(f"--chunked-prefill-size must be at least 1 token (got {o.chunked_prefill})")
        placement, default_arm = o.placement, o.default_arm
        self.target, self.tok = target, target.tokenizer
        self.cfg = target.cfg
        self.vocab = self.cfg.vocab_size
        self.max_model_len = self.cfg.max_seq_len
        self.max_logprobs = self.vocab if o.max_logprobs == -1 else o.max_logprobs
        self.model_name = o.model_name or target.name
        self.generation = o.generation
        self.placement = placement
        self.page_size, self.chunked_prefill = o.page_size, o.chunked_prefill
        cache: dict = {}
        self.arms: dict[str, ServedArm] = {}
        for name, arm in arms:
            sid = name or (self.model_name if len(arms) == 1 else arm.name)
            if sid in self.arms:
                raise ValueError(f"two arms are served as model {sid!r}; name them with NAME=ARM")
            if o.driver is not None:
                from fidelity.pipeline.model import arm_numerics
                kw = {"compute_dtype": placement.compute_dtype} if placement else {}
                from kernel_toggles.arms import version_of
                model = o.driver.model((arm_numerics, arm.name, "reference", kw, version_of(target.cfg)),
                                       chunk_tokens=o.chunked_prefill)
            else:
                nx = arm.numerics(compute_dtype=placement.compute_dtype) if placement else arm.numerics()
                model = build_model(target.weights, nx, weight_cache=cache, chunk_tokens=o.chunked_prefill,
                                    devices=placement.model_devices if placement else None)
            self.arms[sid] = ServedArm(sid, arm, model)
        self.first = next(iter(self.arms.values()))       # internal probes (/health_generate)
        if default_arm is not None and default_arm not in self.arms:
            raise ValueError(f"--default-arm {default_arm!r} is not served (served: "
                             f"{', '.join(self.arms)})")
        self.default_arm = default_arm or (self.first.id if len(self.arms) == 1 else None)
        self.speculation = o.speculation
        if o.speculation is not None:
            if o.driver is not None:
                raise ValueError("--speculative-tokens is not supported with --distributed")
            for s in self.arms.values():
                o.speculation.check(s.model)
        self.scheduler = Scheduler(o.max_jobs, o.time_slice)
        self.prefix_cache = self._prefix_cache(o)
        self.created = int(time.time())
        self.csa_layers = self.cfg.indexer_layers()

    def _prefix_cache(self, o: ServeOptions) -> PrefixCache | None:
        """The prefix cache, or None (--no-prefix-cache). The budget must hold one page's
        snapshot, measured by prefilling a page on the first arm."""
        if o.prefix_cache_bytes is None:
            return None
        self.page_bytes = 0
        cache = PrefixCache(o.page_size, o.prefix_cache_bytes)
        if o.page_size >= self.max_model_len:
            raise ValueError(f"--page-size {o.page_size} must be smaller than the model's context "
                             f"length ({self.max_model_len} tokens)")
        with torch.no_grad():
            _, st = self.first.model.extend(torch.zeros(o.page_size, dtype=torch.long), None, "none")
        self.page_bytes = state_bytes(st)
        if o.prefix_cache_bytes < self.page_bytes:
            raise ValueError(f"--prefix-cache-bytes {o.prefix_cache_bytes} is below one page's "
                             f"snapshot: {self.page_bytes} bytes for --page-size {o.page_size} (a "
                             "snapshot holds every layer's state; raise the budget, lower the page "
                             "size, or use --no-prefix-cache)")
        return cache

    def flush_prefix_cache(self) -> int:
        """Drop every snapshot (requests in flight keep their own state); entries dropped."""
        return 0 if self.prefix_cache is None else self.prefix_cache.clear()

    # ---- requests -----------------------------------------------------------------------
    def resolve(self, name) -> ServedArm:
        """The arm a request's `model` names. Without one: the only arm, or --default-arm;
        on a port with several arms and no default, a 400 naming them (never a silent pick)."""
        if name is None:
            if self.default_arm is None:
                raise ApiError(f"model is required: this server serves {len(self.arms)} models "
                               f"({', '.join(self.arms)}); name one, or start the server with "
                               "--default-arm NAME", "model")
            return self.arms[self.default_arm]
        if not isinstance(name, str) or name not in self.arms:
            raise model_not_found(name)
        return self.arms[name]

    def check_len(self, n_prompt: int, max_tokens: int, field: str = "prompt") -> None:
        if n_prompt == 0:
            raise ApiError(f"{field} is empty", field)
        if n_prompt + max_tokens > self.max_model_len:
            raise ApiError(f"this model's maximum context length is {self.max_model_len} tokens; "
                           f"the request has {n_prompt} prompt tokens and asks for {max_tokens} "
                           "new tokens", "max_tokens")

    def check_logprobs(self, k: int, field: str) -> int:
        """One cap for every route's logprob count (vLLM's --max-logprobs); -1 = vocabulary."""
        k = self.vocab if k == -1 else k
        if k > self.max_logprobs:
            raise ApiError(f"{field} {k} is larger than the server's max_logprobs "
                           f"{self.max_logprobs} (start the server with a larger --max-logprobs)",
                           field)
        return k

    def submit(self, served: ServedArm, ids: list[int], request: GenerationRequest) -> Job:
        """Queue a generation; its Job reports tokens and completion (Busy when full)."""
        r = request
        self.check_len(len(ids), r.max_tokens)
        stop = list(r.stop)

        def should_stop(toks):
            return any(s in self.tok.decode(toks) for s in stop)

        args = (served.model, ids, r.max_tokens, r.sampling,
                set(r.stop_ids) | (set() if r.ignore_eos else {self.tok.eos_id}), r.scoring)
        kw = dict(should_stop=should_stop if stop else None, capture=r.capture,
                  cache=self.prefix_cache, arm_id=served.id)
        sp = self.speculation
        if sp is not None:
            from .speculative import CachedSpecDecoder
            dec = CachedSpecDecoder(served.model, sp.mtp(served.model), sp.k, *args[1:], totals=sp.totals, **kw)
        else:
            dec = CachedDecoder(*args, **kw)
        job = Job(dec, asyncio.get_running_loop())
        self.scheduler.submit(job)
        return job

    def prompt_ids(self, prompt, field: str = "prompt") -> list[int]:
        """One prompt: a string or a list of token ids."""
        if isinstance(prompt, str):
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                       for i in prompt):
            return Fields({field: prompt}).ids(field, self.vocab)
        raise ApiError(f"{field} must be a string or a non-empty list of token ids", field)

    def prompts(self, prompt, field: str = "prompt") -> list[list[int]]:
        """OpenAI's completions prompt: a string, a list of token ids, or a batch (a list of
        strings or of token-id lists), each answered as its own request, in order."""
        if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                    or all(isinstance(p, list) for p in prompt)):
            return [self.prompt_ids(p, f"{field}[{i}]") for i, p in enumerate(prompt)]
        if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(f"{field} mixes kinds: give a string, a list of token ids, a list of "
                           "strings or a list of token-id lists (a batch)", field)
        if prompt is None:
            raise ApiError(f"{field} is required", field)
        return [self.prompt_ids(prompt, field)]

    def chat_prompt(self, body: dict, served: ServedArm | None = None):
        """The chat as the served arm reads and renders it (its request-level toggles;
        golden: DeepSeek's own encoder): a Rendered with the prompt text, whether thinking
        is on, and the DSML dialect the answer's tool calls are read in."""
        nx = (served or self.first).model.nx
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError("messages must be a non-empty list of messages", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ApiError(f"messages[{i}] must be an object", "messages")
            if m.get("role") in CONTENT_ROLES and m.get("content") is None:
                raise ApiError(f"messages[{i}] ({m.get('role')}) has no content", "messages")
            if m.get("role") == "assistant" and m.get("content") is None and not m.get("tool_calls"):
                raise ApiError(f"messages[{i}] (assistant) has neither content nor tool_calls",
                               "messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError("tools must be a list of tool definitions", "tools")
        if body.get("tool_choice") is not None and not isinstance(body["tool_choice"], (str, dict)):
            raise ApiError("tool_choice must be 'none', 'auto', 'required' or an object naming a "
                           "function", "tool_choice")
        add_gen = Fields(body).flag("add_generation_prompt", True)
        try:
            r = nx.chat_render(nx.chat_request(body), self.generation, add_gen)
        except ValueError as e:
            raise ApiError(str(e), "messages") from None
        return r

    # ---- captures -----------------------------------------------------------------------
    def captures(self, taps, indexer: bool, experts: bool, experts_from: int = 0) -> dict:
        """SGLang's meta_info captures from the request's own forward: base64 little-endian
        int32; indexer_topk (rows, CSA layers, index_topk) padded with -1, routed_experts
        (rows, layers, experts per token); one row per forwarded token."""
        out = {}
        if indexer:
            t = torch.stack([taps[f"layers.{i}.attn.index.topk"] for i in self.csa_layers], 1)
            out["indexer_topk"] = _b64_int32(t)
        if experts:
            t = torch.stack([taps[f"layers.{i}.ffn.router.experts"] for i in range(self.cfg.n_layers)], 1)
            out["routed_experts"] = _b64_int32(t[experts_from:])
        return out

    # ---- info ---------------------------------------------------------------------------
    def tokenizer_info(self) -> dict:
        """vLLM's GET /tokenizer_info: the tokenizer's init settings, its class, and the chat
        template where the checkpoint ships one (DeepSeek-V4's chat encoding is code, not a
        Jinja template, so usually none). lm-eval's `remote` tokenizer reads eos/bos/pad."""
        out = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
               "pad_token": EOS, "add_bos_token": False, "add_eos_token": False,
               "model_max_length": self.max_model_len, "clean_up_tokenization_spaces": False}
        cfg = _tokenizer_config(self.tok.name)
        for k in ("bos_token", "eos_token", "pad_token", "add_bos_token", "add_eos_token"):
            v = cfg.get(k)
            if isinstance(v, dict):                 # AddedToken spelt out
                v = v.get("content")
            if v is not None:
                out[k] = v
        if isinstance(cfg.get("chat_template"), str):
            out["chat_template"] = cfg["chat_template"]
        return out

    def model_cards(self) -> list[dict]:
        return [{"id": s.id, "object": "model", "created": self.created, "owned_by": "dsv4-fidelity",
                 "root": self.model_name, "max_model_len": self.max_model_len, "arm": s.arm.name}
                for s in self.arms.values()]

    def model_info(self) -> dict:
        """SGLang's /get_model_info, plus the shape facts a client needs to read captures."""
        c = self.cfg
        return {"model_path": self.target.description, "tokenizer_path": self.tok.name,
                "is_generation": True, "architecture": architecture(c),
                "served_model_names": list(self.arms), "vocab_size": c.vocab_size,
                "num_hidden_layers": c.n_layers, "compress_ratios": list(c.compress_ratios),
                "indexer_layers": self.csa_layers, "index_topk": c.index_topk,
                "n_routed_experts": c.n_routed_experts, "num_experts_per_tok": c.n_activated_experts,
                "max_model_len": self.max_model_len}

    def server_info(self, version: str) -> dict:
        return {"version": version, "engine": "fidelity serve", "model": self.model_name,
                "model_path": self.target.description, "max_model_len": self.max_model_len,
                "max_logprobs": self.max_logprobs, "default_model": self.default_arm,
                # SGLang's server-args names, so a client reads a real engine the same way
                "page_size": self.page_size if self.prefix_cache is not None else None,
                "chunked_prefill_size": self.chunked_prefill,
                "arms": {s.id: {"arm": s.arm.name, "toggles": list(s.arm.toggles),
                                "profile": getattr(s.model.nx, "profile", None),
                                "compute_dtype": str(getattr(s.model.nx, "cd", ""))}
                         for s in self.arms.values()},
                "logprobs": "raw (before temperature, bias and truncation)",
                "chat_encoding": ("deepseek-recipe, DeepSeek-V4.1 encoding" if self.generation == "v41"
                                  else f"deepseek-recipe, DeepSeek-V4 generation {self.generation}"),
                "placement": self.placement.describe() if self.placement else {"devices": ["cpu"]},
                "speculative": (self.speculation.snapshot() if self.speculation is not None
                                else {"enabled": False}),
                "scheduler": self.scheduler.snapshot(),
                "prefix_cache": ({"enabled": True, **self.prefix_cache.snapshot(),
                                  "page_snapshot_bytes": self.page_bytes} if self.prefix_cache is not None
                                 else {"enabled": False})}


def _tokenizer_config(tokenizer_path: str) -> dict:
    """tokenizer_config.json beside the tokenizer, if there is one and it reads."""
    p = Path(str(tokenizer_path)).with_name("tokenizer_config.json")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _b64_int32(t: torch.Tensor) -> str:
    return base64.b64encode(t.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


def architecture(cfg) -> str:
    """The HF architecture name of the served model's version (what a client such as
    chat-check reads to pick the chat encoding)."""
    from reference_model.v41 import is_v41
    from reference_model.v41.markers import V41_ARCHITECTURES
    return V41_ARCHITECTURES[0] if is_v41(cfg) else "DeepseekV4ForCausalLM"
