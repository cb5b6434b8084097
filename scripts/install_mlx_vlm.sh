#!/usr/bin/env bash
# mlx-vlm (MLX's DeepSeek-V4, what Mac users run) into a venv of its own, from PyPI only, once:
# mlx-cpu on Linux, mlx on macOS. Nothing is compiled. Usage:
#   scripts/install_mlx_vlm.sh DEST_DIR [VERSION]      default VERSION: the pinned release
# DEST_DIR/INSTALLED holds "mlx-vlm==VERSION", written last: its presence means "installed".
set -euo pipefail
PINNED_VERSION="0.7.10"
MLX_VERSION="0.32.4"
dest="${1:?usage: install_mlx_vlm.sh DEST_DIR [VERSION]}"
version="${2:-$PINNED_VERSION}"
if [ -f "$dest/INSTALLED" ] && [ "$(cat "$dest/INSTALLED")" = "mlx-vlm==$version" ]; then
    echo "mlx-vlm already installed: $(cat "$dest/INSTALLED") in $dest"
    exit 0
fi
rm -rf "$dest"
"${PYTHON:-python3}" -m venv "$dest"
"$dest/bin/pip" install -q --upgrade pip
if [ "$(uname -s)" = "Darwin" ]; then mlx="mlx==$MLX_VERSION"; else mlx="mlx-cpu==$MLX_VERSION"; fi
# an older mlx-vlm may predate this mlx: let pip choose its mlx when the pinned one does not fit
"$dest/bin/pip" install -q "$mlx" "mlx-vlm==$version" || "$dest/bin/pip" install -q "mlx-vlm==$version"
echo "mlx-vlm==$version" > "$dest/INSTALLED"
echo "mlx-vlm $version installed in $dest ($("$dest/bin/python" -c 'import mlx.core as mx; print("mlx", mx.__version__)'))"
