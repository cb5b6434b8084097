"""The mlx-vlm harness (harness.py) as a subprocess through the engines' process handling
(infra.server_process.running: its own session, a log, ready when /health answers, stopped
however the run ends); a failed start names the last lines of its log."""
from __future__ import annotations

import contextlib
from pathlib import Path

from fidelity.llamacpp.server import free_port
from infra.server_process import LaunchPlan, running

from . import convert, paths


class ServerFailed(RuntimeError):
    pass


@contextlib.contextmanager
def serving(checkpoint: Path, log: Path, weights: str = "native", route: str = "decode", name: str = "mlx-vlm",
            install: paths.Install | None = None, ready_timeout: float = 900.0, patches=(),
            index_block: int | None = None):
    """Yield the root URL of the harness serving `checkpoint` (as mlx-vlm loads it under
    `weights`) by `route`; stop it on exit."""
    port = free_port()
    model = convert.model_dir(checkpoint, weights)
    plan = LaunchPlan(name, f"mlx-vlm {(install or paths.pinned()).version}", "mlxvlm", f"http://127.0.0.1:{port}",
                      paths.harness_command(model, port, weights, route, name, install=install, patches=patches,
                                            index_block=index_block),
                      ready_path="/health", start_timeout=ready_timeout, stop_grace=10.0)
    with running(plan, log, fail=lambda e: ServerFailed(str(e))) as url:
        yield url
