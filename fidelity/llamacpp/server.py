"""llama-server as a subprocess on a GGUF, through the same process handling as `fidelity
engines` (infra/server_process.py: its own session, a log file, ready when
/health answers 200, SIGTERM then SIGKILL to the group). Its launch flags are the settings
the toolkit varies (-c, -np, -b/-ub for chunked prefill, -ctk/-ctv for the KV cache type,
-fa, --swa-full, --cache-reuse); a failed start names why from its log."""
from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from infra.server_process import LaunchError, LaunchPlan, running

from . import paths


class ServerFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(gguf: Path, port: int, ctx: int = 4096, slots: int = 1, threads: int = 1,
            extra: tuple[str, ...] = (), build: paths.Build | None = None) -> list[str]:
    """The llama-server command line of `build` (default the pinned one): one model, `slots`
    parallel slots of `ctx` tokens each (NotBuilt, naming how to build it, when it is missing)."""
    build = build or paths.pinned()
    build.program("llama-server")
    return paths.server_command(gguf, "127.0.0.1", port, build) + [
        "-c", str(ctx * slots), "-np", str(slots), "-t", str(threads), *extra]


@contextlib.contextmanager
def serving(gguf: Path, log: Path, ctx: int = 4096, slots: int = 1, threads: int = 1,
            extra: tuple[str, ...] = (), ready_timeout: float = 900.0, port: int | None = None,
            build: paths.Build | None = None):
    """Yield the root URL of a running llama-server of `build` (default the pinned one) on
    `port`, else a free one; stop it on exit."""
    port = port or free_port()
    plan = LaunchPlan("llama-server", Path(gguf).stem, "llamacpp", f"http://127.0.0.1:{port}",
                      command(gguf, port, ctx, slots, threads, extra, build), ready_path="/health",
                      start_timeout=ready_timeout, stop_grace=15.0)
    with running(plan, log, fail=lambda e: _failed(e, Path(log))) as url:
        yield url


def _failed(e: LaunchError, log: Path) -> ServerFailed:
    """Why a start failed: llama.cpp prints the cause (an assertion, an error line) before a
    long backtrace, so those lines are picked from the log rather than its last ones."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    why = [ln for ln in text.splitlines() if "GGML_ASSERT" in ln or " E " in ln or "error" in ln.lower()]
    if not why:
        return ServerFailed(str(e))
    return ServerFailed(str(e).splitlines()[0] + "\n" + "\n".join(why[:3]) + f" (log: {log})")
