"""`fidelity` command line. Each subcommand lives in fidelity/commands/<name>.py and
defines HELP, add_arguments(parser) and run(args) -> exit code."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module under fidelity.commands
COMMANDS = {
    "ab": "ab",
    "check": "check",
    "toggles": "toggles",
    "inspect": "inspect",
    "needle": "needle",
    "serve": "serve",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fidelity", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, mod_name in COMMANDS.items():
        mod = importlib.import_module(f"fidelity.commands.{mod_name}")
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def _set_threads() -> None:
    """One torch CPU thread unless OMP_NUM_THREADS says otherwise: the tiny model's ops are
    small, and two spinning OpenMP threads on a busy 2-core machine were measured 20x
    slower than one (bench/results)."""
    import os
    if "OMP_NUM_THREADS" not in os.environ:
        import torch
        torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _set_threads()
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
