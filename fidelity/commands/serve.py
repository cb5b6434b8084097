"""`fidelity serve`: the reference model (any arm) as an OpenAI-compatible HTTP server."""
from __future__ import annotations

import sys

HELP = "Serve the reference model under an arm ($DSV4_FIDELITY_ARM) over an OpenAI-compatible API."


def add_arguments(p):
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--arm", default=None,
                   help="arm to serve (default: $DSV4_FIDELITY_ARM, unset = golden)")
    p.add_argument("--checkpoint", default=None,
                   help="DeepSeek-native checkpoint directory (default: the embedded model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: shipped/checkpoint's)")
    p.add_argument("--model-name", default=None, help="model id reported by /v1/models")
    p.add_argument("--log-level", default="warning")


def run(args) -> int:
    from fidelity.arms import ArmError, arm_from_env, parse_arm
    from fidelity.server import Engine, create_app
    from fidelity.target import load_target

    try:
        arm = parse_arm(args.arm) if args.arm is not None else arm_from_env()
    except ArmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    target = load_target(args.checkpoint, args.tokenizer)
    engine = Engine(target, arm, args.model_name)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: binding {args.host}: the server has no authentication", file=sys.stderr)
    print(f"fidelity serve: model {engine.name} ({target.description}), arm {arm.name}, "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False)
    return 0
