"""What changed in llama.cpp's source between two fetched builds, sorted by whether it can
move the numbers measured here: the model's graph and caches (src/), the CPU backend and
ggml's core (what a CPU run executes), the converter (the GGUF it writes), other backends
(compiled elsewhere, not run here) and the rest (tests, docs, tools). At a change point this
is the short list of places a reader opens first; deepseek4.cpp's hunks are named by the
function they sit in."""
from __future__ import annotations

import difflib
import re
from pathlib import Path

# (kind, test on the path relative to the source root), first match wins
KINDS = (
    ("model", lambda p: p.startswith("src/")),
    ("ggml-cpu", lambda p: p.startswith(("ggml/src/ggml-cpu/", "ggml/include/"))
        or (p.startswith("ggml/src/") and p.count("/") == 2)),
    ("converter", lambda p: p.startswith(("conversion/", "gguf-py/")) or p == "convert_hf_to_gguf.py"),
    ("other backends", lambda p: p.startswith("ggml/src/")),
)
RUNS_HERE = ("model", "ggml-cpu", "converter")
SKIP_DIRS = {".git", "build", "__pycache__"}
_TOP = re.compile(r"^[A-Za-z_][\w:<>,\s\*&]*\(")     # a definition's first line (not indented)


def kind_of(rel: str) -> str:
    return next((k for k, test in KINDS if test(rel)), "other")


def _files(root: Path) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts):
            out[p.relative_to(root).as_posix()] = p
    return out


def _lines(p: Path | None) -> list[str]:
    if p is None:
        return []
    try:
        return p.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _hunk_functions(a: list[str], b: list[str]) -> list[str]:
    """The definition each changed block of `b` sits in (the nearest unindented signature above)."""
    names = []
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, _, _, j1, _ in sm.get_opcodes():
        if tag == "equal":
            continue
        above = next((ln for ln in reversed(b[:j1 + 1]) if _TOP.match(ln)), None)
        name = above.split("(")[0].split()[-1] if above else "(file scope)"
        if name not in names:
            names.append(name)
    return names


def source_diff(root_a: Path, root_b: Path, focus: str = "src/models/deepseek4.cpp") -> dict:
    """Changed files with lines added/removed, per kind; `focus`'s hunks by function."""
    fa, fb = _files(Path(root_a)), _files(Path(root_b))
    files = []
    for rel in sorted(set(fa) | set(fb)):
        pa, pb = fa.get(rel), fb.get(rel)
        if pa and pb and pa.stat().st_size == pb.stat().st_size and pa.read_bytes() == pb.read_bytes():
            continue
        la, lb = _lines(pa), _lines(pb)
        added = removed = 0
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, la, lb, autojunk=False).get_opcodes():
            if tag != "equal":
                removed += i2 - i1
                added += j2 - j1
        files.append({"path": rel, "kind": kind_of(rel), "added": added, "removed": removed,
                      "status": "added" if pa is None else "removed" if pb is None else "changed"})
    out = {"files": files, "focus": focus, "focus_functions": []}
    if focus in fa and focus in fb and any(f["path"] == focus for f in files):
        out["focus_functions"] = _hunk_functions(_lines(fa[focus]), _lines(fb[focus]))
    return out


def words(d: dict, top: int = 4) -> str:
    """One sentence: what runs here first (largest changes), then counts of the rest."""
    files = d["files"]
    if not files:
        return "the two source trees are identical"
    here = sorted((f for f in files if f["kind"] in RUNS_HERE), key=lambda f: -(f["added"] + f["removed"]))
    parts = []
    for kind in RUNS_HERE:
        of = [f for f in here if f["kind"] == kind]
        if of:
            shown = ", ".join(f"{f['path']} +{f['added']}/-{f['removed']}" for f in of[:top])
            more = f" and {len(of) - top} more" if len(of) > top else ""
            parts.append(f"{kind}: {shown}{more}")
    if not here:
        parts.append("nothing that runs here (model graph, CPU backend, converter) changed")
    rest = {k: sum(1 for f in files if f["kind"] == k) for k in ("other backends", "other")}
    parts.append(", ".join(f"{n} {k} file{'s' if n != 1 else ''}" for k, n in rest.items() if n) or "nothing else")
    s = "; ".join(parts)
    if d.get("focus_functions"):
        s += f" ({Path(d['focus']).name} changes in {', '.join(d['focus_functions'][:6])})"
    return s
