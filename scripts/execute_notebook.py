"""Execute notebooks/layer_drift.ipynb in a real kernel and save it with its outputs (tables
and plots), by default on the committed example report into docs/notebook/layer_drift.ipynb,
which GitHub and Jupyter render as a reader sees it. Run after `make example`:
    .venv/bin/python scripts/execute_notebook.py
    .venv/bin/python scripts/execute_notebook.py --set 'ARMS=["engine", "wo_a_fp8"]' --set LAYER=2 --out /tmp/nb.ipynb
`--set NAME=VALUE` (a Python literal) overrides a name of the notebook's parameters cell
the way papermill does: a cell assigning it is inserted right after that cell, so the
notebook itself is never edited to explore."""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "layer_drift.ipynb"
DEFAULTS = {"REPORT": "../reports/example"}       # relative to notebooks/, where the kernel runs


def parameter(text: str) -> tuple[str, object]:
    """'NAME=VALUE' -> (NAME, the Python literal VALUE); argparse's type for --set."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    try:
        return name.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: VALUE must be a Python literal (quote strings)") from None


def inject(nb, params: dict) -> None:
    """Insert a cell assigning `params` right after the cell tagged 'parameters'."""
    at = next((i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if at is None:
        raise ValueError("the notebook has no cell tagged 'parameters'")
    src = "# Injected parameters\n" + "".join(f"{k} = {v!r}\n" for k, v in params.items())
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(src, metadata={"tags": ["injected-parameters"]}))


def execute(params: dict, path: Path = NOTEBOOK, timeout: int = 600):
    """The notebook executed in a python3 kernel (working directory notebooks/) with `params`."""
    nb = nbformat.read(path, as_version=4)
    if params:
        inject(nb, params)
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    return nb


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", dest="params", type=parameter, action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter of the notebook's parameters cell (repeatable)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "notebook" / "layer_drift.ipynb")
    args = p.parse_args(argv)
    nb = execute({**DEFAULTS, **dict(args.params)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, args.out)
    print(f"{args.out}: {images(nb)} plots")
    return 0 if images(nb) else 1


if __name__ == "__main__":
    sys.exit(main())
