"""Options several subcommands share, declared once so their names, defaults and help
cannot drift apart: the vocabulary (one spelling per concept across commands, the old
spellings accepted for one release with a note), where results go (--out, --run-id, --fresh, --quiet) and how requests
to a server are retried (--timeout, --retries; infra.http.RetryPolicy's defaults unless a
command's requests need longer attempts) and authenticated (--api-key-env); which endpoint URLs are accepted (endpoint_url,
endpoint_pair); which chat encoding --chat-version and --generation name."""
from __future__ import annotations

import argparse

from infra.http import RetryPolicy


def output_options(p: argparse.ArgumentParser, what: str, run_id_default: str, *,
                   fresh: str | None = None, quiet: bool = True, out_default: str | None = "reports",
                   out_help: str | None = None):
    """The "output" group: <out>/<what>/<run-id>/ (<out>/<run-id>/ when `what` is empty);
    returns it for a command's own extras."""
    where = f"<out>/{what}/" if what else "<out>/"
    g = p.add_argument_group("output")
    g.add_argument("--out", default=out_default, metavar="DIR",
                   help=out_help or f"writes {where}<run-id>/ (default: %(default)s)")
    g.add_argument("--run-id", default=None, help=f"folder name under {where} (default: {run_id_default})")
    if fresh:
        g.add_argument("--fresh", action="store_true", help=fresh)
    if quiet:
        g.add_argument("--quiet", action="store_true", help="no progress lines")
    return g


# One spelling per concept: every long option two or more commands take is declared here with
# what it means (tests/test_options_vocabulary.py fails on an undeclared shared option and on
# a retired spelling coming back).
VOCABULARY = {
    "--arm": "an arm computed here, in-process: a toggle spelling, NAME=ARM where arms are named (repeatable)",
    "--endpoint": "a running server as an arm (NAME=URL; chat-check: its one URL)",
    "--checkpoint": "the DeepSeek-native checkpoint in-process arms run (default: the embedded model)",
    "--tokenizer": "the tokenizer.json prompts are built with",
    "--model": "the served model an endpoint arm talks to",
    "--dialect": "an endpoint's API dialect, forced",
    "--lengths": "prompt lengths in tokens (a list, or boundaries)",
    "--length": "one prompt length in tokens",
    "--depths": "needle depths in percent",
    "--reps": "prompts per cell of the prompt grid (per length, or per length and depth): different needles",
    "--decode-steps": "greedy decode steps scored after each prompt",
    "--max-tokens": "tokens a server generates per reply (OpenAI's max_tokens)",
    "--prompts": "your own prompts, a JSONL file",
    "--seed": "seed of the built-in prompts (and of the bootstrap where there is one)",
    "--top-k": "log-probabilities asked for per position",
    "--n-boot": "bootstrap resamples for confidence intervals",
    "--concurrency": "requests in flight at once",
    "--page-size": "an engine's prefix-cache page in tokens",
    "--generation": "the DeepSeek-V4 checkpoint generation (reasoning-effort tiers)",
    "--chat-version": "the chat encoding's model version (v4, v41)",
    "--weights-mode": "how a checkpoint's weights are held on the device",
    "--devices": "where the golden runs",
    "--device": "where the golden runs (same as --devices)",
    "--device-memory": "memory per device",
    "--accumulate": "the golden's accumulation precision on the device",
    "--distributed": "the golden as a pipeline over torchrun ranks",
    "--dist-timeout": "seconds to wait for another rank",
    "--timeout": "seconds per request attempt", "--retries": "retries per request",
    "--api-key-env": "the environment variable holding the API key",
    "--out": "the output folder", "--run-id": "the run's folder name under it",
    "--fresh": "discard stored results instead of resuming", "--quiet": "no progress lines",
    "--batch": "prompts of one length run together in one pass",
    "--host": "the interface a server started here listens on", "--port": "the port it listens on",
    "--tokens": "a replay's prompt length in tokens",
    "--prompt": "one prompt of `fidelity kld`'s grid by its id (L<length>-d<depth>-r<rep>)",
    "--bisect": "a history's two releases A..B: the first after A whose numbers change as B's do",
    "--no-bisect": "a history's releases compared, their changes not bisected",
    "--needle-length": "a history's needle recall length per release (0: none)",
    "--json": "print one JSON object", "--threads": "CPU threads", "--plugin": "a toggle plugin module",
}
# spellings retired for the vocabulary's: accepted for one release, with a note
RETIRED = {"--inprocess": "--arm", "--arms": "--arm", "--prompts-per-length": "--reps", "--steps": "--decode-steps"}


class Retired(argparse.Action):
    """An old spelling of an option: prints a note naming the new one, then does what the new
    option does (append or store into the same dest)."""

    def __init__(self, option_strings, dest, new: str = "", append: bool = False, **kw):
        super().__init__(option_strings, dest, **kw)
        self.new, self.append = new, append

    def __call__(self, parser, namespace, values, option_string=None):
        import sys
        print(f"note: {option_string} is now {self.new} (the old spelling is accepted for one release)",
              file=sys.stderr)
        if self.append:
            got = list(getattr(namespace, self.dest, None) or [])
            setattr(namespace, self.dest, got + [values])
        else:
            setattr(namespace, self.dest, values)


def retired(g, old: str, new: str, dest: str, append: bool = False, **kw) -> None:
    """Accept `old` (hidden from --help) as `new` for one release; the default stays the new
    option's (SUPPRESS: this one sets none, wherever it is declared)."""
    g.add_argument(old, dest=dest, action=Retired, new=new, append=append, help=argparse.SUPPRESS,
                   default=argparse.SUPPRESS, **kw)


API_KEY_ENV = "OPENAI_API_KEY"


def http_options(g, timeout: float = RetryPolicy.timeout) -> None:
    """--timeout, --retries and --api-key-env on a group of a command that talks to servers."""
    g.add_argument("--timeout", type=float, default=timeout,
                   help="seconds per request attempt (default: %(default)s)")
    g.add_argument("--retries", type=int, default=RetryPolicy.retries,
                   help="retries per request on connection errors, timeouts, 5xx, 429 and malformed "
                        "answers (default: %(default)s)")
    g.add_argument("--api-key-env", default=API_KEY_ENV, metavar="VAR",
                   help="environment variable holding the servers' API key, sent as a bearer token when "
                        "set (a server started with --api-key); never printed or written (default: %(default)s)")


def api_key(args) -> str | None:
    """The API key named by --api-key-env, or None when that variable is unset or empty.
    A variable named explicitly (not the default) that is unset or empty is a usage error
    naming it: the user meant a key to be sent, and a 401 later would not say why."""
    import os
    from fidelity.errors import CommandError
    key = os.environ.get(args.api_key_env) or None
    if key is None and args.api_key_env != API_KEY_ENV:
        raise CommandError(f"--api-key-env {args.api_key_env}: that environment variable is not set "
                           "(or is empty), so no API key would be sent")
    return key


def endpoint_url(text: str) -> str:
    """argparse type of an endpoint URL option: infra.http.check_url, so a URL no retry
    could reach (ftp://, no scheme, no host) is refused when parsed, exit 2."""
    from infra.http import URLError, check_url
    try:
        return check_url(text.strip())
    except URLError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def endpoint_pair(text: str) -> str:
    """argparse type of a NAME=URL endpoint option (kept as given; the URL checked as in
    endpoint_url)."""
    name, sep, url = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=URL")
    endpoint_url(url)
    return text


def chat_encoding(version: str, generation: str) -> str:
    """The chat encoding (reference_model.chat_encoding's `generation`) for --chat-version
    and --generation, or a CommandError naming the bad combination."""
    from reference_model.chat_encoding import ChatEncodingError, encoding_for
    from fidelity.errors import CommandError
    try:
        return encoding_for(version, generation)
    except ChatEncodingError as e:
        raise CommandError(f"--chat-version {version}: {e}") from None


def distributed_options(p, command: str) -> None:
    """--distributed, --dist-timeout and --device-memory of the per-prompt commands (kld,
    needle, serve; fidelity.pipeline.model runs them), as `fidelity ab` has them."""
    p.add_argument("--distributed", nargs="?", const=0, type=int, default=None, metavar="RANKS",
                   help=f"run the in-process golden as a pipeline over torchrun ranks (torchrun ... -m fidelity "
                        f"{command} --distributed): each rank runs its contiguous layers, rank 0 runs the command, "
                        "the embedding and the head; RANKS, if given, must equal torchrun's world size "
                        "(docs/distributed.md)")
    p.add_argument("--dist-timeout", type=float, default=600, metavar="S",
                   help="with --distributed: seconds to wait for another rank within a call before failing "
                        "(default 600)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="with --distributed: each rank's memory budget (e.g. 96GB) for the stage memory check "
                        "before the run (the head counts on rank 0); default: each GPU's total memory, no check "
                        "on CPU")
