"""Where mlx-vlm lives: one venv per release in the per-user cache (mlx-vlm pins its own
transformers and numpy, so it never shares this project's venv), made by
scripts/install_mlx_vlm.sh (`make mlx-vlm`). A missing venv is one clear error naming how to
make it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fidelity.llamacpp.paths import cache_root

PINNED = "0.7.10"                      # mlx-vlm release (its models/deepseek_v4)
MLX = "0.32.4"                         # mlx (mlx-cpu on Linux) it runs on
HARNESS = Path(__file__).resolve().with_name("harness.py")


class NotInstalled(RuntimeError):
    pass


@dataclass(frozen=True)
class Install:
    """One mlx-vlm release's venv: `bin/python`, and `INSTALLED` (the release, written last)."""
    version: str
    home: Path

    def installed(self) -> bool:
        stamp = self.home / "INSTALLED"
        return stamp.is_file() and stamp.read_text().strip() == f"mlx-vlm=={self.version}"

    def python(self) -> Path:
        if not self.installed():
            how = ("run `make mlx-vlm` (a venv from PyPI, about a minute) or set MLX_VLM_HOME"
                   if self.version == PINNED else f"`scripts/install_mlx_vlm.sh {self.home} {self.version}`")
            raise NotInstalled(f"mlx-vlm=={self.version} is not installed in {self.home}; {how}")
        return self.home / "bin" / "python"


def pinned() -> Install:
    return Install(PINNED, Path(os.environ.get("MLX_VLM_HOME") or cache_root() / f"mlx-vlm-{PINNED}"))


def of(version: str) -> Install:
    """Release `version`'s venv (the pinned one where it lives)."""
    return pinned() if version == PINNED else Install(version, cache_root() / f"mlx-vlm-{version}")


def harness_command(model: Path, port: int, weights: str = "native", route: str = "decode", name: str = "mlx-vlm",
                    host: str = "127.0.0.1", install: Install | None = None, patches=(),
                    index_block: int | None = None) -> list[str]:
    """The harness's serve command on `install`'s Python (NotInstalled, naming how, when missing);
    `index_block` overrides the config's HISA block (0: HISA off)."""
    py = (install or pinned()).python()
    return [str(py), str(HARNESS), "serve", "--model", str(model), "--weights", weights,
            "--route", route, "--name", name, "--host", host, "--port", str(port),
            *[a for p in patches for a in ("--patch", p)],
            *(["--index-block", str(index_block)] if index_block is not None else [])]
