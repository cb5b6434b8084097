"""The layer-drift notebook explored through its parameters cell, executed in a real kernel
(scripts/execute_notebook.py, as the docs copy is made): an arm the report does not have is
named in a printed warning and drawn nowhere, the arms it does have are still plotted, and
with no second report beside the first the A-vs-B comparison is skipped (never A against
itself, which draws a diagonal)."""
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLES = ("drift.csv.gz", "kld.csv.gz", "signal_summary.csv", "signal_attribution.csv", "needle.csv",
          "manifest.json")
pytest.importorskip("nbclient")


def _script():
    spec = importlib.util.spec_from_file_location("execute_notebook", ROOT / "scripts" / "execute_notebook.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def _report(dst: Path) -> Path:
    """The committed example report's tables alone in a folder of its own (no report beside it)."""
    dst.mkdir(parents=True)
    for t in TABLES:
        shutil.copy(ROOT / "reports" / "example" / t, dst / t)
    return dst


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    report = _report(tmp_path_factory.mktemp("reports") / "run1")
    return _script().execute({"REPORT": str(report), "ARMS": ["engine", "no_such_arm"], "LAYER": 2}, timeout=300)


def test_unknown_arm_is_warned_about_and_drawn_nowhere(executed):
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", []) and "injected-parameters" in code[1].metadata["tags"]
    loading = _text(code[2])
    assert "WARNING: arm 'no_such_arm' is not in" in loading and "left out of every plot" in loading
    assert "Arms drawn: engine;" in loading and "layer drilled into: 2" in loading
    later = "".join(_text(c) + str([o.get("data", {}).get("text/plain", "") for o in c.outputs]) for c in code[3:])
    assert "no_such_arm" not in later                    # in no table or printout after the warning


def test_plotting_cells_still_draw(executed):
    drift = next(c for c in executed.cells if c.cell_type == "code" and 'drift.tap == "out"' in c.source)
    assert any("image/png" in o.get("data", {}) for o in drift.outputs)
    assert _script().images(executed) >= 4


def test_report_b_is_skipped_when_there_is_no_other_report(executed):
    b = executed.cells[-1]
    assert "REPORT_B" in b.source and "No report B" in _text(b)
    assert not any("image/png" in o.get("data", {}) for o in b.outputs)


def test_set_rejects_a_value_that_is_not_a_literal():
    import argparse
    mod = _script()
    assert mod.parameter('ARMS=["a", "b"]') == ("ARMS", ["a", "b"])
    with pytest.raises(argparse.ArgumentTypeError, match="Python literal"):
        mod.parameter("REPORT=../reports/x")


def test_report_b_defaults_to_the_other_report_beside_a(tmp_path):
    a, b = _report(tmp_path / "run1"), _report(tmp_path / "run2")
    nb = _script().execute({"REPORT": str(a)}, timeout=300)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert f"Report B: {b}" in _text(code[2]) and "WARNING" not in _text(code[2])
    assert any("image/png" in o.get("data", {}) for o in code[-1].outputs)
    nb = _script().execute({"REPORT": str(a), "REPORT_B": str(a)}, timeout=300)
    assert "REPORT_B is REPORT" in _text(nb.cells[3]) and "No report B" in _text(nb.cells[-1])
