"""Two llama.cpp builds compared beyond their served distributions (those: fidelity.history.
pairs): the GGUF each build's converter wrote, and -- at a change point -- the tensors each
computes on the same ids, so a change is placed at its first tensor."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_diff(dump_a: dict[str, np.ndarray], dump_b: dict[str, np.ndarray], order: list[str]) -> dict:
    """Two builds' dumped tensors on the same ids, in graph order (`order`: build B's names):
    the first tensor that is not bit-identical (with its relative L2 difference), the tensors
    one build has and the other does not."""
    common = [n for n in order if n in dump_a]
    first = None
    for n in common:
        x, y = dump_a[n].astype(np.float64), dump_b[n].astype(np.float64)
        if x.shape != y.shape:
            first = {"tensor": n, "why": f"shape {x.shape} then, {y.shape} now"}
            break
        if not np.array_equal(x, y, equal_nan=True):
            den = np.linalg.norm(x) or 1.0
            first = {"tensor": n, "rel": float(np.linalg.norm(x - y) / den), "why": "values"}
            break
    return {"compared": len(common), "first": first,
            "only_a": sorted(set(dump_a) - set(dump_b)), "only_b": sorted(set(dump_b) - set(dump_a))}


def gguf_diff(path_a: Path, path_b: Path, gguf_py: Path) -> dict:
    """Two GGUF files compared (with the gguf-py of a build, `gguf_py`): the metadata keys
    added, dropped or changed (the chat template named, not quoted) and the tensors whose
    type, shape or values differ -- where a converter's change is, when the files differ."""
    import sys
    if str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    from gguf import GGUFReader
    a, b = GGUFReader(str(path_a)), GGUFReader(str(path_b))

    def meta(r) -> dict:
        out = {}
        for k, f in r.fields.items():
            if k.startswith("GGUF."):
                continue
            try:
                out[k] = f.contents()
            except Exception:                                   # a type this gguf-py cannot render
                out[k] = bytes(f.parts[-1]).hex() if f.parts else None
        return out
    ma, mb = meta(a), meta(b)
    words = lambda v: (str(v)[:80] + "...") if len(str(v)) > 80 else v  # noqa: E731
    changed = {k: [words(ma.get(k)), words(mb.get(k))] for k in sorted(set(ma) | set(mb)) if ma.get(k) != mb.get(k)}
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    tensors = []
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            tensors.append(f"{n}: {x.tensor_type.name} {list(x.shape)} then, {y.tensor_type.name} {list(y.shape)} now")
        elif not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
            tensors.append(f"{n}: values")
    return {"metadata": changed, "tensors": tensors, "only_a": sorted(set(ta) - set(tb)),
            "only_b": sorted(set(tb) - set(ta))}


NOT_NUMERICS = ("tokenizer.chat_template",)     # shapes chat requests only: kld and the replay send token ids


def numeric_part(d: dict) -> dict:
    """A GGUF difference (gguf_diff) without what cannot move the numbers served for token ids."""
    return {**d, "metadata": {k: v for k, v in d["metadata"].items() if k not in NOT_NUMERICS}}


def differs(d: dict) -> bool:
    return bool(d["metadata"] or d["tensors"] or d["only_a"] or d["only_b"])


def gguf_words(d: dict) -> str:
    """A GGUF difference in one line."""
    added = [k for k, (x, y) in d["metadata"].items() if x is None]
    dropped = [k for k, (x, y) in d["metadata"].items() if y is None]
    changed = [k for k, (x, y) in d["metadata"].items() if x is not None and y is not None]
    parts = [f"metadata added: {', '.join(added)}" if added else "", f"dropped: {', '.join(dropped)}" if dropped else "",
             f"changed: {', '.join(changed)}" if changed else "",
             f"{len(d['tensors'])} tensors differ ({'; '.join(d['tensors'][:3])})" if d["tensors"] else "tensors identical"]
    if d["only_a"] or d["only_b"]:
        parts.append(f"tensors only before: {len(d['only_a'])}, only after: {len(d['only_b'])}")
    return "; ".join(p for p in parts if p)
