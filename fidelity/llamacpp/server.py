"""llama-server as a subprocess on a GGUF: started on a loopback port, ready when /health
answers 200, stopped by SIGTERM (then SIGKILL). Its launch flags are the settings the
toolkit varies (-c, -np, -b/-ub for chunked prefill, -ctk/-ctv for the KV cache type,
-fa, --swa-full, --cache-reuse); the log goes to a file so a failed start names why."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import httpx

from . import paths


class ServerFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(gguf: Path, port: int, ctx: int = 4096, slots: int = 1, threads: int = 1,
            extra: tuple[str, ...] = ()) -> list[str]:
    """The llama-server command line: one model (named by its file's stem, not its path),
    `slots` parallel slots of `ctx` tokens each."""
    return [str(paths.program("llama-server")), "-m", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "-c", str(ctx * slots), "-np", str(slots), "-t", str(threads),
            "--alias", Path(gguf).stem, "--no-webui", *extra]


@contextlib.contextmanager
def serving(gguf: Path, log: Path, ctx: int = 4096, slots: int = 1, threads: int = 1,
            extra: tuple[str, ...] = (), ready_timeout: float = 900.0, port: int | None = None):
    """Yield the root URL of a running llama-server (on `port`, else a free one); stop it on exit."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command(gguf, port, ctx, slots, threads, extra),
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc, log, ready_timeout)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until /health answers 200; a server that exits first is an error quoting its log."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            text = Path(log).read_text(errors="replace")
            why = [ln for ln in text.splitlines() if "GGML_ASSERT" in ln or " E " in ln or "error" in ln.lower()]
            raise ServerFailed(f"llama-server exited with {proc.returncode} before it was ready: "
                               + ("\n".join(why[:3]) if why else text[-1500:]) + f" (log: {log})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise ServerFailed(f"llama-server at {url} not ready after {timeout:.0f} s (log: {log})")
