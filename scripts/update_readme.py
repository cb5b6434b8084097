"""Regenerate the generated sections of README.md and docs/*.md (between
<!-- BEGIN name --> and <!-- END name --> markers): the toggle table from the registry
(docs/ab.md), bench tables from bench/results/*.md (docs/benchmarks.md). `--check` exits 1
if any file is stale (used by the tests)."""
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
    stale = []
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        old = f.read_text()
        new = render(old)
        if new != old:
            stale.append(f.relative_to(ROOT))
            if "--check" not in sys.argv:
                f.write_text(new)
    if stale and "--check" in sys.argv:
        print(f"stale: {', '.join(map(str, stale))}: run python scripts/update_readme.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
