"""The README's generated tables match the registry and the recorded benchmark results."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_generated_sections_are_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_readme.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_readme_shows_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    cmds = [ln.split("#")[0].strip() for ln in block.strip().splitlines()]
    assert cmds == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_make_demo_writes_only_ignored_paths():
    """`make demo` on a fresh clone leaves `git status` clean: every folder and file its
    recipe writes (each run's folder, the `latest` link beside it, the needle results) is
    git-ignored and untracked; `make example` is what writes the committed reports."""
    import re
    make = (ROOT / "Makefile").read_text()
    recipe = make.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    written = []
    for line in recipe.splitlines()[1:]:
        out, run = re.search(r"--out (\S+)", line).group(1), re.search(r"--run-id (\S+)", line).group(1)
        sub = "needle/" if " needle " in line else ""
        written += [f"{out}/{sub}{run}/summary.json", f"{out}/{sub}latest"]
        if "--results" in line:
            written.append(re.search(r"--results (\S+)", line).group(1))
    assert len(written) >= 5 and not any("example" in w for w in written), written
    for path in written:
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert r.returncode == 0, f"make demo writes {path}, which git does not ignore"
    assert "\nexample:" in make and "--run-id example" in make.split("\nexample:", 1)[1]
