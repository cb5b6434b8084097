"""Resume: a sweep killed with SIGKILL mid-way and rerun ends with exactly the table of an
uninterrupted run -- no duplicated or lost rows (real `fidelity needle` subprocesses
against a local deterministic server)."""
import csv
import json
import os
import signal
import subprocess
import time

from needle.results import read_rows
from needle.stub import StubServer
from reference_model.tokenizer import load_tokenizer

from needle_util import ROOT, fidelity_cmd

ARGS = ["--lengths", "300,333,401", "--depths", "0,50,90,100", "--concurrency", "1", "--quiet"]


def _sweep(url, out, *extra):
    return subprocess.Popen(fidelity_cmd("needle", "--endpoint", f"stub={url}", "--out", str(out),
                                         *ARGS, *extra), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _lines(path):
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _key_rows(rows):
    return sorted((r["arm"], r["trial_id"], r["outcome"], r["response"], r["n_tokens"],
                   r["prompt_sha256"]) for r in rows)


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    with StubServer(delay=0.25, tokenizer=load_tokenizer(), wrong_every=3) as s:
        killed = tmp_path / "killed"
        res = killed / "needle" / "results.jsonl"
        p = _sweep(s.url, killed)
        t0 = time.monotonic()
        while _lines(res) < 5 and p.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close(), p.stderr.close()
        n_before = _lines(res) - 1
        assert 4 <= n_before < 12, n_before                    # really killed mid-way
        sent = s.requests
        p = _sweep(s.url, killed)                              # resume (the default)
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-2000:]
        assert s.requests - sent == 12 - n_before              # only the missing trials ran
        clean = tmp_path / "clean"
        p = _sweep(s.url, clean, "--fresh")
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-2000:]
    h1, rows1 = read_rows(res)
    h2, rows2 = read_rows(clean / "needle" / "results.jsonl")
    assert h1["trials"] == h2["trials"]
    keys = [(r["arm"], r["trial_id"]) for r in rows1]
    assert len(keys) == len(set(keys)) == 12                    # no duplicates, none lost
    assert _key_rows(rows1) == _key_rows(rows2)

    def table(d):
        with open(d / "needle" / "latest" / "cells.csv") as f:
            return list(csv.DictReader(f))
    assert table(killed) == table(clean)
    s1 = json.loads((killed / "needle" / "latest" / "summary.json").read_text())
    assert s1["tables"]["arms"][0]["n"] == 12
