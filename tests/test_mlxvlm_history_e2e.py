"""`fidelity mlxvlm history` end to end on two real adjacent releases from PyPI (the pinned one
and the one before it, installed into the per-user cache on first use): each release installed,
asked whether its own loader loads DeepSeek's checkpoint, served by the harness on its own
Python, scored by kld against the golden and the twin; the two compared, the page written. A
rerun resumes from the ledger and scores nothing twice."""
import json
import subprocess

import pandas as pd
import pytest

from fidelity.llamacpp.paths import REPO
from fidelity.mlxvlm import paths
from needle_util import fidelity_cmd

pytestmark = pytest.mark.mlx
BEFORE = "0.7.9"          # the release before the pinned one: only mlx_vlm/utils.py differs (not the model)


def _history(out, *args):
    return subprocess.run(fidelity_cmd("mlxvlm", "history", "--releases", f"{BEFORE},{paths.PINNED}", "--lengths",
                                       "256", "--reps", "1", "--out", str(out), *args),
                          capture_output=True, text=True, cwd=REPO)


def test_two_adjacent_releases_scored_compared_and_resumed(tmp_path):
    if not paths.pinned().installed():
        pytest.skip(f"mlx-vlm {paths.PINNED} is not installed: `make test-mlx` installs it")
    r = _history(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    hist = tmp_path / "mlxvlm-history"
    lines = [json.loads(x) for x in (hist / "history.jsonl").read_text().splitlines()]
    scored = {x["key"]: x for x in lines if x["stage"] == "scored"}
    assert set(scored) == {BEFORE, paths.PINNED} and all(x["ok"] for x in scored.values())
    for x in scored.values():                          # the decode route's compressor bug: unexplained vs the twin
        assert x["golden"]["mean"] > x["golden"]["floor_hi"] and x["unexplained"]
    loads = {x["key"]: x for x in lines if x["stage"] == "native load"}
    assert not loads[paths.PINNED]["ok"] and "Expected shape" in loads[paths.PINNED]["reason"]   # 0.7.1's regression
    pair = next(x for x in lines if x["stage"] == "pair")
    assert pair["key"] == [BEFORE, paths.PINNED] and pair["prompts"] == 3
    assert pair["kind"] == "identical", pair["sentence"]          # no model source differs between the two
    table = pd.read_csv(hist / "report" / "builds.csv")
    assert list(table.release) == [f"mlx-vlm-{BEFORE}", f"mlx-vlm-{paths.PINNED}"]
    assert table["loads DeepSeek's checkpoint"].str.startswith("no: ValueError: Expected shape").all()
    assert "every adjacent pair serves bit-identical distributions" in r.stdout
    html = (hist / "report" / "index.html").read_text()
    assert "<img" in html and (hist / "report" / "timeline.png").is_file()

    again = _history(tmp_path)                         # resumes: nothing scored or installed twice
    assert again.returncode == 0, again.stderr[-2000:]
    lines2 = [json.loads(x) for x in (hist / "history.jsonl").read_text().splitlines()]
    assert [x for x in lines2 if x["stage"] in ("scored", "installed", "native load")] == \
        [x for x in lines if x["stage"] in ("scored", "installed", "native load")]
