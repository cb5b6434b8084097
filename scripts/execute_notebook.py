"""Execute notebooks/layer_drift.ipynb in a real kernel on the committed example report
and save it with its outputs (tables and plots) to docs/notebook/layer_drift.ipynb, which
GitHub and Jupyter render as a reader sees it. Run after `make demo`:
    .venv/bin/python scripts/execute_notebook.py"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    nb = nbformat.read(ROOT / "notebooks" / "layer_drift.ipynb", as_version=4)
    os.environ["DSV4_REPORT"] = "../reports/example"
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    out = ROOT / "docs" / "notebook" / "layer_drift.ipynb"
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    print(f"{out.relative_to(ROOT)}: {images} plots")
    return 0 if images else 1


if __name__ == "__main__":
    sys.exit(main())
