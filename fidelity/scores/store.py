"""Each arm's scores of each prompt, one compressed .npz per (arm, prompt, request), written
once and never rewritten: a rerun scores only what is missing (resume), and an engine arm
scored in an earlier launch is compared later without relaunching it. A position keeps at
most `keep` ids (the most likely, plus the token that follows), so an in-process arm's
full vocabulary does not fill the disk; KL bounds stay valid on what is kept. Scores
whose captures were expected but missing go to their own file (`-nocaptures`): a resumed
run asks for that prompt again, and a complete answer is stored beside it, not over it."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .bounds import Known
from .dialects import PromptScores


def request_key(k: int, steps: int, exact: bool, captures: bool, ids: list[int]) -> str:
    """What a stored score depends on: the settings of the request and the prompt ids."""
    d = {"k": k, "steps": steps, "exact": exact, "captures": captures,
         "ids": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _trim(k: Known, keep: int, must: int | None) -> Known:
    if len(k.ids) <= keep:
        return k
    sel = np.argpartition(-k.logp, keep - 1)[:keep]
    if must is not None and must not in set(k.ids[sel].tolist()):
        sel = np.append(sel, np.nonzero(k.ids == must)[0][:1])
    return Known(k.ids[sel], k.logp[sel])


def _pack(ks: list[Known]) -> dict:
    off = np.cumsum([0] + [len(k.ids) for k in ks])
    return {"ids": np.concatenate([k.ids for k in ks]).astype(np.int32) if ks else np.zeros(0, np.int32),
            "logp": np.concatenate([k.logp for k in ks]) if ks else np.zeros(0),
            "off": off.astype(np.int64)}


def _unpack(ids, logp, off) -> list[Known]:
    return [Known(ids[a:b].astype(np.int64), logp[a:b]) for a, b in zip(off[:-1], off[1:])]


class ScoreStore:
    def __init__(self, root: Path, keep: int = 1024):
        self.root, self.keep = Path(root), keep

    def path(self, arm: str, prompt: str, key: str, partial: bool = False) -> Path:
        return self.root / arm / f"{prompt}-{key}{'-nocaptures' * partial}.npz"

    def get(self, arm: str, prompt: str, key: str) -> PromptScores | None:
        """The stored scores, complete ones first (None when the prompt was not scored)."""
        p = self.path(arm, prompt, key)
        if not p.exists():
            p = self.path(arm, prompt, key, partial=True)
            if not p.exists():
                return None
        z = np.load(p)
        opt = {n: z[n] for n in ("indexer", "experts", "index_scores", "evaluated") if n in z}
        return PromptScores(z["prompt"].tolist(), _unpack(z["k_ids"], z["k_logp"], z["k_off"]),
                         [None if np.isnan(v) else float(v) for v in z["actual"]],
                         [None if v < 0 else int(v) for v in z["ranks"]],
                         z["ladder_tokens"].tolist(), _unpack(z["l_ids"], z["l_logp"], z["l_off"]),
                         opt.get("indexer"), opt.get("experts"),
                         str(z["captures_missing"]) if "captures_missing" in z else None,
                         opt.get("index_scores"), opt.get("evaluated"))

    def put(self, arm: str, prompt: str, key: str, s: PromptScores) -> None:
        ids = s.ids
        known = [_trim(k, self.keep, ids[j + 1] if j + 1 < len(ids) else None)
                 for j, k in enumerate(s.known)]
        ladder = [_trim(k, self.keep, s.ladder_tokens[t] if t < len(s.ladder_tokens) else None)
                  for t, k in enumerate(s.ladder)]
        arrays = {"prompt": np.asarray(ids, np.int64),
                  "actual": np.array([np.nan if v is None else v for v in s.actual], np.float64),
                  "ranks": np.array([-1 if v is None else v for v in s.ranks], np.int64),
                  "ladder_tokens": np.asarray(s.ladder_tokens, np.int64)}
        arrays.update({f"k_{n}": v for n, v in _pack(known).items()})
        arrays.update({f"l_{n}": v for n, v in _pack(ladder).items()})
        if s.indexer is not None:
            arrays["indexer"], arrays["experts"] = s.indexer, s.experts
        if s.index_scores is not None:
            arrays["index_scores"] = s.index_scores
        if s.evaluated is not None:
            arrays["evaluated"] = np.asarray(s.evaluated, np.int64)
        if s.captures_missing:
            arrays["captures_missing"] = np.array(s.captures_missing)
        p = self.path(arm, prompt, key, partial=bool(s.captures_missing))
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, p)
