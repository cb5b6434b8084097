"""`fidelity serve`: the reference model (one or more arms) as a stand-in engine speaking
OpenAI's, vLLM's and SGLang's HTTP APIs."""
from __future__ import annotations

import errno
import logging
import os
import sys

from fidelity.commands.options import chat_encoding
from fidelity.errors import CommandError

# Lazy imports inside the functions: building the parser imports every command module,
# and only the command that runs should pay for its machinery (the reference model, uvicorn).

HELP = ("Serve the reference model under one or more arms over OpenAI-, vLLM- and "
        "SGLang-compatible HTTP APIs.")
EXAMPLES = """\
    fidelity serve --port 8000                      # the golden as an OpenAI/vLLM/SGLang-compatible server
    fidelity serve --arm golden=golden --arm engine=engine --default-arm golden
    fidelity serve --distributed --checkpoint /models/DeepSeek-V4-Pro --port 8000   # each rank of `torchrun --nproc-per-node 8 -m fidelity serve --distributed ...`; rank 0 serves HTTP (docs/distributed.md)
"""


def add_arguments(p):
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help="require this environment variable's value as a bearer token on every route but "
                        "/health (OpenAI's 401 otherwise), as vLLM's and SGLang's --api-key do; the key is "
                        "never printed")
    p.add_argument("--arm", action="append", default=[], metavar="[NAME=]ARM",
                   help="arm to serve (repeatable; default: $DSV4_FIDELITY_ARM, unset = golden). "
                        "With several, each is a model named NAME (default: its arm spelling) "
                        "chosen by the request's `model`; the weights are loaded once")
    p.add_argument("--default-arm", default=None, metavar="NAME",
                   help="model that answers requests naming none (default: the only arm; with "
                        "several arms and no default such a request gets a 400 naming them)")
    p.add_argument("--checkpoint", default=None,
                   help="DeepSeek-native checkpoint directory (default: the embedded model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: shipped/checkpoint's)")
    p.add_argument("--model-name", default=None,
                   help="model id of a single unnamed arm (default: the checkpoint's name)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests in the server at once (running + waiting); more get 429 "
                        "with Retry-After (default 256)")
    p.add_argument("--time-slice", type=float, default=1.0, metavar="SECONDS",
                   help="compute a request may use before waiting requests get their turn "
                        "(a forward is never split; 0 = one forward per turn; default 1.0)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs / prompt_logprobs / top_logprobs / top_logprobs_num "
                        "(/generate) a request may ask for, -1 = the vocabulary (vLLM's "
                        "--max-logprobs; default 20)")
    p.add_argument("--generation", choices=("0731", "original"), default="0731",
                   help="DeepSeek-V4 checkpoint generation whose reasoning-effort tiers the chat "
                        "encoding uses (docs/research/engine-integration.md §3.2; default 0731)")
    p.add_argument("--chat-version", choices=("auto", "v4", "v41"), default="auto",
                   help="chat encoding and tool-call format: v4 (DeepSeek-V4) or v41 (DeepSeek-V4.1: "
                        "spaced DSML tags, <｜System｜>, numeric reasoning effort); auto (default): "
                        "the checkpoint's version (docs/serve.md)")
    p.add_argument("--page-size", type=int, default=64, metavar="TOKENS",
                   help="prefix-cache page: the sequence state is kept at every multiple of it "
                        "and a cached prefix ends on one (vLLM's --block-size, SGLang's "
                        "--page-size; default 64)")
    p.add_argument("--prefix-cache-bytes", type=int, default=1 << 30, metavar="BYTES",
                   help="byte budget of the prefix cache's state snapshots, least recently used "
                        "evicted first; at least one page's snapshot (default 1 GiB)")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, metavar="TOKENS",
                   help="prefill long prompts in chunks of this many tokens, the serving seam's "
                        "chunk_boundary between them (SGLang's --chunked-prefill-size; default 2048)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="decode speculatively: K draft tokens per step from the checkpoint's MTP "
                        "layer, verified in one batched forward (SGLang's "
                        "--speculative-num-draft-tokens - 1, vLLM's num_speculative_tokens; "
                        "default 0 = off; docs/serve.md)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="serve without a prefix cache (every prompt prefilled in full)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="server log level; warnings include request fields the server ignored "
                        "(once per field and route) (default warning)")
    from fidelity.weights.devices import add_options
    add_options(p)
    from fidelity.commands.options import distributed_options
    distributed_options(p.add_argument_group("distributed (docs/distributed.md; rank 0 serves HTTP)"), "serve")


def _log_to_stderr(level: str) -> None:
    """The server's own warnings (ignored request fields) on stderr, beside uvicorn's."""
    log = logging.getLogger("fidelity.serve")
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(levelname)s:  %(message)s"))
    log.addHandler(h)
    log.setLevel(level.upper())
    log.propagate = False


def _api_key(args) -> str | None:
    """The key --api-key-env names; a named variable that is unset is an error (a server meant
    to require a key must not start open)."""
    if not args.api_key_env:
        return None
    key = os.environ.get(args.api_key_env)
    if not key:
        raise CommandError(f"--api-key-env {args.api_key_env}: that environment variable is not set or empty", 2)
    return key


def run(args) -> int:
    _api_key(args)                                # checked before any weight is read
    if args.distributed is None:
        return _run(args)
    from fidelity.pipeline.model import run_ranks
    return run_ranks(args, lambda driver: _run(args, driver), lambda cfg: _need(args, cfg))


def _need(args, cfg):
    """What a distributed server holds at least: one call of a --chunked-prefill-size chunk
    with its logits, the prefix cache's budget of snapshots, and the states of the other
    --max-queue requests, each counted at one chunk (how far a request grows is not known
    before it arrives)."""
    from fidelity.pipeline.model import Need
    from fidelity.weights.plan import sequence_state_bytes, state_dtypes
    length = min(args.chunked_prefill_size, cfg.max_seq_len)
    dt = state_dtypes("reference")
    one = sum(sequence_state_bytes(cfg, i, length, dt) for i in range(cfg.n_layers))
    cached = 0 if args.no_prefix_cache else args.prefix_cache_bytes
    return Need(length, 1, "all", cached + (args.max_queue - 1) * one)


def _run(args, driver=None) -> int:
    """Serve from one process, or from rank 0 with `driver`'s pipeline models."""
    from fidelity.design.arms import ArmError, arm_from_env, parse_arm
    from reference_model.schedule import ONESHOT
    from fidelity.serve import parse_arm_options
    from fidelity.weights.devices import DeviceError, from_args
    if args.chat_version != "auto":
        chat_encoding(args.chat_version, args.generation)     # a bad combination fails before loading
    from fidelity.weights.source import checkpoint_config
    from kernel_toggles.arms import version_of
    try:
        place = from_args(args)
        version = version_of(checkpoint_config(args.checkpoint))
        if args.arm:
            arms = [(name, parse_arm(spec, version)) for name, spec in parse_arm_options(args.arm)]
        else:
            arms = [(None, arm_from_env(model=version))]
    except (ArmError, DeviceError, ValueError) as e:
        raise CommandError(str(e)) from None
    scheduled = [arm.name for _, arm in arms if arm.schedule != ONESHOT]
    if scheduled:
        raise CommandError(f"fidelity serve feeds prompts as requests arrive; it does not take a "
                           f"schedule on an arm ({', '.join(scheduled)}): drop the @SCHEDULE")
    if args.max_queue < 1 or args.max_logprobs < -1 or args.time_slice < 0:
        raise CommandError("--max-queue must be >= 1, --max-logprobs >= -1, --time-slice >= 0")
    if args.speculative_tokens < 0:
        raise CommandError(f"--speculative-tokens must be >= 0 (got {args.speculative_tokens})")
    if args.page_size < 1:
        raise CommandError(f"--page-size must be at least 1 token (got {args.page_size})")
    if not args.no_prefix_cache and args.prefix_cache_bytes < 1:
        raise CommandError(f"--prefix-cache-bytes must be at least 1 (got {args.prefix_cache_bytes}); "
                           "use --no-prefix-cache to serve without a prefix cache")
    sock = _listen(args.host, args.port)          # a busy port fails before the model loads
    try:
        return _serve(args, place, arms, version, driver, sock)
    finally:
        sock.close()


def _listen(host: str, port: int):
    """A bound socket for the server, or a CommandError naming the address: checked before
    anything is loaded or announced (uvicorn would report it only after both, exit 3)."""
    import socket
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise CommandError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        busy = " (another process is using the port; choose another with --port)" \
            if e.errno == errno.EADDRINUSE else ""
        raise CommandError(f"cannot listen on {host}:{port}: {e.strerror or e}{busy}") from None
    return sock


def _serve(args, place, arms, version, driver, sock) -> int:
    """Load the arms' model, announce, and serve on the bound socket until stopped."""
    import uvicorn

    from fidelity.pipeline.model import command_target
    from fidelity.serve import Engine, ServeOptions, create_app
    target = command_target(args, place, driver)
    generation = chat_encoding(version if args.chat_version == "auto" else args.chat_version, args.generation)
    speculation = None
    try:
        if args.speculative_tokens:
            from fidelity.serve.speculative import Speculation, load_mtp_source
            speculation = Speculation(args.speculative_tokens, load_mtp_source(args.checkpoint))
        engine = Engine(target, arms, ServeOptions(args.model_name, args.max_queue, args.max_logprobs,
                                                   args.time_slice, generation, place, args.default_arm,
                                                   args.page_size,
                                                   None if args.no_prefix_cache else args.prefix_cache_bytes,
                                                   args.chunked_prefill_size, driver, speculation))
    except ValueError as e:
        raise CommandError(str(e)) from None
    key = _api_key(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not key:
        print(f"warning: binding {args.host}: the server has no authentication (--api-key-env)", file=sys.stderr)
    served = ", ".join(f"{s.id} = arm {s.arm.name}" for s in engine.arms.values())
    default = engine.default_arm or "none (requests must name a model)"
    port = sock.getsockname()[1]                  # --port 0: the port the system chose
    print(f"fidelity serve: {target.description}; models: {served}; default model: {default}; "
          f"http://{args.host}:{port}", file=sys.stderr, flush=True)
    _log_to_stderr(args.log_level)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, key), host=args.host, port=port,
                                           log_level=args.log_level, access_log=False))
    server.run(sockets=[sock])
    return 0 if server.started else 3
