"""`fidelity mlxvlm history`'s parts without mlx-vlm: PyPI's version list read (releases
before DeepSeek-V4 dropped, in release order, not string order), release selections and their
errors, the source difference between two installed releases sorted by whose part it is, a
traceback's exception kept as the reason, and bisection over release strings (0.6.10 after
0.6.9) on the common frame. The run against installed releases is in test_mlxvlm.py (marked mlx)."""
import pytest

from fidelity.commands import mlxvlm as C
from fidelity.errors import CommandError
from fidelity.history import pairs as P
from fidelity.history.ledger import Ledger
from fidelity.mlxvlm import history as H

PIP = """mlx-vlm (0.7.10)
Available versions: 0.7.10, 0.7.9, 0.6.10, 0.6.9, 0.6.0, 0.5.0, 0.4.4
  INSTALLED: 0.7.10"""


def test_pypi_versions_in_release_order_from_the_first_with_deepseek_v4():
    assert H.parse_versions(PIP) == ["0.6.0", "0.6.9", "0.6.10", "0.7.9", "0.7.10"]
    with pytest.raises(H.ReleasesError, match="listed no versions"):
        H.parse_versions("ERROR: No matching distribution found for mlx-vlm")


def test_release_selections_and_their_errors():
    assert C._release("v0.7.10") == "0.7.10"
    with pytest.raises(ValueError, match="predates DeepSeek-V4"):
        C._release("0.5.0")
    with pytest.raises(ValueError, match="not one"):
        C._release("latest")
    from fidelity.commands import engine_history as E
    pool = H.parse_versions(PIP)
    assert E.parse_keys("spread:3", lambda: pool, C._release, "--releases", "release") == ["0.6.0", "0.6.10", "0.7.10"]
    with pytest.raises(CommandError, match="predates"):
        E.parse_keys("0.4.4,0.7.10", lambda: pool, C._release, "--releases", "release")
    later = lambda a, b: H.version_key(a) < H.version_key(b)  # noqa: E731
    assert E.parse_bisect("0.6.9..0.6.10", C._release, later, "", "release") == ("0.6.9", "0.6.10")
    with pytest.raises(CommandError, match="earlier release"):
        E.parse_bisect("0.6.10..0.6.9", C._release, later, "", "release")


def _tree(root, files):
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_source_diff_names_the_files_that_run_for_deepseek_v4_by_part(tmp_path):
    base = {"mlx_vlm/models/deepseek_v4/language.py": "a\nb\nc\n", "mlx_vlm/models/cache.py": "x\n",
            "mlx_vlm/utils.py": "u\n", "mlx_vlm/models/qwen3/language.py": "q\n"}
    a = _tree(tmp_path / "a", base)
    b = _tree(tmp_path / "b", {**base, "mlx_vlm/models/deepseek_v4/language.py": "a\nB\nc\nd\n",
                               "mlx_vlm/fp8.py": "f\ng\n", "mlx_vlm/models/qwen3/language.py": "changed\n"})
    got = {f["path"]: f for f in H.source_diff(a, b)}
    assert set(got) == {"mlx_vlm/models/deepseek_v4/language.py", "mlx_vlm/fp8.py"}   # qwen3 does not run for V4
    assert (got["mlx_vlm/models/deepseek_v4/language.py"]["added"],
            got["mlx_vlm/models/deepseek_v4/language.py"]["removed"]) == (2, 1)
    assert got["mlx_vlm/fp8.py"] == {"path": "mlx_vlm/fp8.py", "part": "loader", "added": 2, "removed": 0}
    assert H.source_diff(a, a) == []


def test_a_load_failure_keeps_the_exception_line():
    err = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: Expected shape (8, 128, 64)\n"
    assert H._last_error(err) == "ValueError: Expected shape (8, 128, 64)"


class FakeReleases(H.History):
    """Numbers change beyond the floors from CHANGE on; nothing installs in FAIL."""
    CHANGE, FAIL = "0.6.10", set()

    def __init__(self, out):
        self.out, self.say, self.runs = out, lambda m: None, []
        self.ledger = Ledger(out / "history.jsonl")

    def run_build(self, v, needle=True):
        if self.ledger.get("installed", v) is None:
            self.runs.append(v)
            self.ledger.add("installed", v, ok=v not in self.FAIL, reason="no wheel")
            if v not in self.FAIL:
                self.ledger.add("scored", v, ok=True)
        return {}

    def compare(self, a, b):
        moved = (H.version_key(a) >= H.version_key(self.CHANGE)) != (H.version_key(b) >= H.version_key(self.CHANGE))
        kind = P.BEYOND if moved else P.IDENTICAL
        return {"kind": kind, "sentence": f"{b} vs {a}: {kind}"}


def test_bisect_walks_releases_in_release_order_and_steps_over_failures(tmp_path):
    pool = H.parse_versions("Available versions: " + ", ".join(f"0.6.{i}" for i in range(18)))
    h = FakeReleases(tmp_path)
    r = h.bisect(pool, "0.6.0", "0.6.17")
    assert r["change"] == ["0.6.9", "0.6.10"] and r["adjacent"]
    assert "the first release that changes after mlx-vlm-0.6.0 is mlx-vlm-0.6.10" in r["sentence"]
    assert r["tested"] == sorted(r["tested"], key=H.version_key)
    h2 = FakeReleases(tmp_path / "2")
    (tmp_path / "2").mkdir()
    h2.FAIL = {"0.6.9"}
    r2 = h2.bisect(pool, "0.6.0", "0.6.17")
    assert r2["change"] == ["0.6.8", "0.6.10"] and not r2["adjacent"] and r2["skipped"] == ["0.6.9"]


def test_lengths_where_hisa_would_engage_are_refused_with_the_reason(tmp_path, capsys):
    """One twin judges every release only while HISA cannot engage (it ships from 0.6.4 on):
    past 4096 tokens the command refuses and says where long contexts are measured."""
    from fidelity.cli import main
    assert main(["mlxvlm", "history", "--lengths", "256,8192", "--releases", "0.7.10", "--out", str(tmp_path)]) == 2
    assert "HISA engages from 0.6.4 on" in capsys.readouterr().err
    assert main(["mlxvlm", "history", "--lengths", "boundaries", "--releases", "0.7.10", "--out", str(tmp_path)]) == 2
    assert "the history takes token counts" in capsys.readouterr().err
