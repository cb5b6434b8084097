"""`fidelity` command line. Each subcommand lives in fidelity/commands/<name>.py and
defines HELP, add_arguments(parser) and run(args) -> exit code. DESCRIPTION is what
`fidelity --help` says (the docstring is for readers of the code). A command raises
fidelity.errors.CommandError for a usage error; `main` prints "error: <message>" and
exits 2."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from fidelity.errors import CRASHED, CommandError

DESCRIPTION = ("DeepSeek-V4 fidelity toolkit: a golden reference forward beside engine numerics, "
               "with drift, next-token KLD, needle recall and attribution to the toggle that "
               "causes them, in-process or against live SGLang / vLLM servers.")
EPILOG = "Run `fidelity COMMAND --help` for a command's options."

# subcommand name -> module under fidelity.commands
COMMANDS = {
    "ab": "ab",
    "check": "check",
    "toggles": "toggles",
    "inspect": "inspect",
    "needle": "needle",
    "serve": "serve",
    "kld": "kld",
    "consistency": "consistency",
    "engines": "engines",
    "chat-check": "chat_check",
    "plan-memory": "plan_memory",
    "weights-diff": "weights_diff",
    "llamacpp": "llamacpp",
    "mlxvlm": "mlxvlm",
}


def _common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes (added to each through `parents=`)."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (default: OMP_NUM_THREADS, else the cores not busy "
                        "with other work)")
    c.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                   help="import this toggle plugin (a .py file or a dotted module name) "
                        "before the command runs, so the toggles it registers can be used "
                        "in arms (repeatable). Also loaded: the items of "
                        f"$DSV4_FIDELITY_PLUGINS (separated by ',' or '{os.pathsep}') and every "
                        "entry point in the group 'dsv4_fidelity.toggles'")
    return c


def name_value_pairs(values, what: str, value: str = "VALUE") -> list[tuple[str, str]]:
    """Repeatable NAME=VALUE options (--endpoint, --weights, ...), both sides stripped;
    ValueError naming the option for anything else."""
    out = []
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise ValueError(f"{what} {v!r}: expected NAME={value}")
        out.append((name.strip(), rest.strip()))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fidelity", description=DESCRIPTION, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True)
    common = _common_options()
    for name, mod_name in COMMANDS.items():
        mod = importlib.import_module(f"fidelity.commands.{mod_name}")
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP, parents=[common],
                            epilog="examples:\n" + mod.EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def _set_threads(n: int | None) -> None:
    """torch CPU threads: --threads, else OMP_NUM_THREADS, else the cores not already busy
    (fidelity.weights.devices.default_threads): all of an idle machine, one on a shared one, where
    spinning OpenMP threads were measured 20x slower (bench/results)."""
    if n is None and "OMP_NUM_THREADS" in os.environ:
        return
    import torch                          # lazy: start-up cost, not needed for --help
    from fidelity.weights.devices import default_threads
    torch.set_num_threads(n or default_threads())


def _one_console_voice() -> None:
    """The commands show what the `fidelity.*` modules log (retries, through the on_retry
    callbacks they pass, e.g. Progress.log); without a handler of its own, the package's
    logger would fall through to Python's last-resort handler and print each warning a
    second time. A NullHandler there stops that; records still propagate to any handler
    an embedding program (or pytest) installs."""
    log = logging.getLogger("fidelity")
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("MPLBACKEND", "Agg")   # reports are written to files, never shown
    _one_console_voice()
    args = build_parser().parse_args(argv)
    _set_threads(args.threads)
    try:
        _load_plugins(args.plugin)
        return _under_torchrun(int(args._run(args) or 0))
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:                   # a crash must never read as a finding (exit 1)
        import traceback
        traceback.print_exc()
        print(f"internal error (exit {CRASHED}): the traceback above is a bug of fidelity, not a finding",
              file=sys.stderr)
        return CRASHED


def _under_torchrun(code: int) -> int:
    """A rank's exit code: torchrun reports any non-zero one as a crashed rank with a
    traceback, so a flagged finding (fidelity.errors.FLAGGED) exits 0 under it, said on
    stderr; bad input keeps its 2."""
    from fidelity.errors import CLEAN, FLAGGED
    if code == FLAGGED and "TORCHELASTIC_RUN_ID" in os.environ:
        print("flagged (exit code 0 under torchrun, which reads any other as a crash)", file=sys.stderr)
        return CLEAN
    return code


def _load_plugins(specs: list[str]) -> None:
    # lazy: kernel_toggles imports torch, which `fidelity --help` should not wait for
    from kernel_toggles.plugins import PluginError, load_plugins
    try:
        load_plugins(specs)
    except PluginError as e:
        raise CommandError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
