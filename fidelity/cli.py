"""`fidelity` command line. Each subcommand lives in fidelity/commands/<name>.py and
defines HELP, add_arguments(parser) and run(args) -> exit code."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand name -> module under fidelity.commands
COMMANDS = {
    "ab": "ab",
    "check": "check",
    "toggles": "toggles",
    "inspect": "inspect",
    "needle": "needle",
    "serve": "serve",
    "kld": "kld",
    "engines": "engines",
    "chat-check": "chat_check",
}


def _common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes (added to each through `parents=`)."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                   help="import this toggle plugin (a .py file or a dotted module name) "
                        "before the command runs, so the toggles it registers can be used "
                        "in arms (repeatable). Also loaded: the items of "
                        f"$DSV4_FIDELITY_PLUGINS (separated by ',' or '{os.pathsep}') and every "
                        "entry point in the group 'dsv4_fidelity.toggles'")
    return c


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fidelity", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = _common_options()
    for name, mod_name in COMMANDS.items():
        mod = importlib.import_module(f"fidelity.commands.{mod_name}")
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP, parents=[common])
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def _set_threads() -> None:
    """One torch CPU thread unless OMP_NUM_THREADS says otherwise: the tiny model's ops are
    small, and two spinning OpenMP threads on a busy 2-core machine were measured 20x
    slower than one (bench/results)."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch
        torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _set_threads()
    from kernel_toggles.plugins import PluginError, load_plugins
    try:
        load_plugins(args.plugin)
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
