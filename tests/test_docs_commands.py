"""The documented command lines, replayed as far as a test can without the hours they run:
every `fidelity ...` line in a shell block of README.md and docs/*.md parses with today's
parser and uses no retired spelling; every `make TARGET` names a target of the Makefile and
every `python bench/X.py` / `bash scripts/X.sh` names a file that exists. A line with a
placeholder (<...>, ...) is a template, not a command, and is counted apart."""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shell_lines(text: str) -> list[str]:
    """Lines of ```bash / ```sh / ``` blocks, continuation lines joined, comments dropped."""
    out, fence, buf = [], None, ""
    for ln in text.splitlines():
        if ln.strip().startswith("```"):
            fence = ln.strip()[3:] if fence is None else None        # opening (its language) / closing
            buf = ""
            continue
        if fence not in ("", "bash", "sh", "shell"):
            continue
        s = ln.strip()
        if s.startswith("$ "):
            s = s[2:]
        if s.startswith("#"):
            continue
        s = re.split(r"\s+#", s, maxsplit=1)[0].rstrip()
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        out.append((buf + s).strip().rstrip("&").strip())
        buf = ""
    return [x for x in out if x]


def inline_spans(text: str) -> list[str]:
    """`code spans` in prose and tables (outside fences): where most pages name a command."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [m.strip() for m in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)]


def commands(prefix: str):
    """(page, line, fenced): fenced lines are commands to run; inline spans may also name a
    command or an option in passing (`fidelity kld --arm`)."""
    for page in PAGES:
        text = page.read_text()
        for lines, fenced in ((shell_lines(text), True), (inline_spans(text), False)):
            for ln in lines:
                for part in re.split(r"\s*(?:&&|;|\|\|)\s*", ln):
                    part = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", part.strip())     # env assignments
                    if part.startswith(prefix):
                        yield page.name, part, fenced


def test_every_documented_fidelity_line_parses(capsys):
    from fidelity.cli import build_parser
    parser = build_parser()
    parsed, templates, bad = 0, 0, []
    for page, line, fenced in commands("fidelity "):
        if re.search(r"<[^>]*>|\.\.\.|\b[A-Z]{1,4}\b|\[|\||…", line):      # URL, N, P, DIR, [opt]
            templates += 1
            continue
        try:
            parser.parse_args(shlex.split(line)[1:])
        except SystemExit:
            err = capsys.readouterr().err.strip().splitlines()[-1]
            # named in passing (`fidelity kld --arm`, `fidelity engines`): values left out
            if not fenced and re.search(r"expected one argument|arguments are required", err):
                templates += 1
                continue
            bad.append(f"{page}: {line} ({err})")
            continue
        err = capsys.readouterr().err
        if "note:" in err:
            bad.append(f"{page}: {line} uses a retired spelling: {err.strip()}")
        parsed += 1
    assert not bad, "\n".join(bad)
    assert parsed >= 100, (parsed, templates)          # the pages hold that many real commands


@pytest.mark.parametrize("prefix,check", [
    ("make ", lambda w, mk: all(re.search(rf"^{re.escape(t)}:", mk, re.M) for t in w[1:] if "=" not in t)),
    ("python bench/", lambda w, mk: (ROOT / w[1]).is_file()),
    ("bash scripts/", lambda w, mk: (ROOT / w[1]).is_file()),
])
def test_documented_targets_and_scripts_exist(prefix, check):
    mk = (ROOT / "Makefile").read_text()
    missing = [f"{page}: {line}" for page, line, _ in commands(prefix)
               if "<" not in line and not check(shlex.split(line), mk)]
    assert not missing, "\n".join(missing)
