"""Regenerate the generated sections of README.md (between <!-- BEGIN name --> and
<!-- END name --> markers): the toggle table from the registry, bench tables from
bench/results/*.md. `--check` exits 1 if the README is stale (used by the tests)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sections() -> dict[str, str]:
    from kernel_toggles.table import render_markdown
    out = {"toggles": render_markdown()}
    for p in sorted((ROOT / "bench" / "results").glob("*.md")):
        body = p.read_text().split("\n", 1)[1].strip()          # drop the file's own title
        out[f"bench:{p.stem}"] = body + "\n"
    return out


def render(text: str) -> str:
    for name, body in sections().items():
        pat = re.compile(rf"(<!-- BEGIN {re.escape(name)} -->\n).*?(<!-- END {re.escape(name)} -->)", re.S)
        text = pat.sub(lambda m: m.group(1) + body + m.group(2), text)
    return text


def main() -> int:
    readme = ROOT / "README.md"
    old = readme.read_text()
    new = render(old)
    if "--check" in sys.argv:
        if new != old:
            print("README.md is stale: run python scripts/update_readme.py")
            return 1
        return 0
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
