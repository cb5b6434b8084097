"""`fidelity plan-memory`: will a lockstep run fit on these devices? Bytes per device for
weights, dequantisation buffers, per-sequence state, residual streams, logits and workspace,
from the config alone (fidelity/weights/plan.py has the formulas). Exit 0 if it fits, 1 if
not (with what would fit), 2 on bad input."""
from __future__ import annotations

import argparse

import json
from pathlib import Path

from fidelity.errors import CommandError
from fidelity.commands.options import retired

# Lazy imports inside the functions: building the parser imports every command module,
# and only the command that runs should pay for its machinery (pandas, plots, readers).

HELP = ("Plan memory per device for a run (weights, dequant buffers, KV/compressor/indexer "
        "state, residual streams, logits) from the config alone; exit 0 fits, 1 does not, 2 bad input")
EXAMPLES = """\
    fidelity plan-memory --preset flash --devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7 --device-memory 96GB --length 65536
    fidelity plan-memory --checkpoint /models/DeepSeek-V4-Flash --devices cuda:0 --device-memory 141GB --length 8192
    fidelity plan-memory --preset v41-flash --devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7 --device-memory 141GB --length 65536
    fidelity plan-memory --checkpoint /models/DeepSeek-V4-Pro --devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7 --device-memory 96GB --nodes 2 --length 65536   # two nodes, one rank per GPU
"""


def add_arguments(p):
    from fidelity.weights.plan import (DEQUANT_MODES, LOGITS_MODES, PROFILES,
                                      WEIGHT_MODES)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR",
                     help="checkpoint directory (only its config.json is read)")
    src.add_argument("--config", metavar="FILE", help="a config.json (HF or inference/ dialect)")
    src.add_argument("--preset", choices=("flash", "tiny", "v41-flash", "tiny-v41"),
                     help="a built-in config (v41-flash: DeepSeek-V4.1-Flash's published config)")
    p.add_argument("--devices", default="cpu",
                   help="comma-separated cpu / cuda / cuda:N; layers are placed contiguously "
                        "over them in this order (default: cpu)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="memory per device, e.g. 96GB (1e9) or 141GiB (2^30); one value for all "
                        "or one per device, comma-separated. Required for cpu; for CUDA devices "
                        "read from torch.cuda when omitted")
    p.add_argument("--length", type=int, required=True,
                   help="tokens per sequence (prompt + decode steps)")
    p.add_argument("--batch", dest="prompts", type=int, default=1, help="prompts per pass (default 1)")
    retired(p, "--prompts", "--batch", "prompts", type=int)
    p.add_argument("--n-arms", type=int, default=1, help="how many arms run in lockstep (default 1)")
    # ab, kld and needle take --arm as arm names; a count under the same name misled users
    p.add_argument("--arm", "--arms", dest="arms", default=None, help=argparse.SUPPRESS)
    retired(p, "--weights", "--weights-mode", "weights", choices=WEIGHT_MODES)
    p.add_argument("--weights-mode", dest="weights", choices=WEIGHT_MODES, default="resident-quantised",
                   help="resident-quantised: checkpoint format on the device, layers dequantised "
                        "on use; resident-bf16: dequantised weights resident; streamed: one layer "
                        "resident at a time (default resident-quantised)")
    p.add_argument("--dequant", choices=DEQUANT_MODES, default="full",
                   help="resident-quantised dequant buffer: the whole layer, or only the routed "
                        "experts a pass can reach (default full)")
    p.add_argument("--profile", choices=PROFILES, default="reference",
                   help="numerics profile: the dtypes the state is kept in (reference: fp64 "
                        "compute; reference-fp32; exact) (default reference)")
    p.add_argument("--logits", choices=LOGITS_MODES, default="all",
                   help="prefill logits for every position (the lockstep's KLD) or the last only")
    p.add_argument("--nodes", type=int, default=1,
                   help="the --devices are one node's, repeated on this many nodes: a torchrun "
                        "pipeline, one rank per device (fidelity ab --distributed; default 1)")
    p.add_argument("--head-on-rank-0", action="store_true",
                   help="with --nodes: the head on the first rank, as `fidelity kld`, `needle` and `serve "
                        "--distributed` run it (the layer split unchanged); default: on the last rank, as "
                        "`fidelity ab --distributed` runs it")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def load_config(args):
    """The config named by --checkpoint / --config / --preset (ConfigError on failure)."""
    from reference_model.config import ConfigError, preset
    from reference_model.v41 import config as v41
    if args.preset:
        return v41.preset(args.preset) if args.preset in v41.PRESETS else preset(args.preset)
    if args.config:                      # either version: V4.1 by model_type / its fields
        return v41.any_config_from_file(args.config)
    root = Path(args.checkpoint)
    if not root.is_dir():
        raise ConfigError(f"checkpoint directory does not exist: {root}")
    for p in (root / "config.json", root / "inference" / "config.json"):
        if p.is_file():
            cfg = v41.any_config_from_file(p)
            return cfg if cfg.name != "inference" else cfg.replace(name=root.name)
    raise ConfigError(f"{root}: no config.json (or inference/config.json)")


def run(args) -> int:
    from fidelity.weights.plan import (PassSpec, PlanDevices, PlanError, PlanNumerics, plan_memory,
                                       render)
    from reference_model.config import ConfigError
    if args.arms is not None:
        raise CommandError(f"plan-memory counts arms: use --n-arms {args.arms} (--arm names arms "
                           "in ab, kld and needle)", 2)
    try:
        cfg = load_config(args)
        mem = args.device_memory.split(",") if args.device_memory else None
        plan = plan_memory(cfg, PlanDevices(args.devices, mem, args.nodes),
                           PassSpec(args.length, args.prompts, args.n_arms, args.weights, args.dequant,
                                    args.logits, head_first=args.head_on_rank_0),
                           PlanNumerics.of(args.profile))
    except (PlanError, ConfigError) as e:
        raise CommandError(str(e)) from None
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan))
    return 0 if plan.fits else 1
