"""`fidelity llamacpp history` end to end on real llama.cpp build folders without compiling
any: the pinned build, a second build folder holding the same programs under another build
number (so the two must serve bit-identical distributions), and a third whose llama-server
cannot load the model (it must be named with its reason, not skipped). Checks the ledger,
the resume (nothing is scored twice), the report, and the tensor replay of two builds
compared tensor by tensor. Marked `llama` (needs `make llama-cpp`)."""
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from fidelity.llamacpp import paths

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    if paths.built() != paths.PINNED:
        pytest.skip(f"llama.cpp {paths.PINNED} is not built in {paths.home()}: `make test-llama` builds it")
    root = tmp_path_factory.mktemp("cache")
    d = root / "dsv4-fidelity"
    d.mkdir()
    (d / paths.BUILD_NAME).symlink_to(paths.home())
    for n, server in ((paths.PINNED_NUMBER + 1, None), (paths.PINNED_NUMBER + 2, "broken")):
        b = d / f"llama.cpp-b{n}"
        (b / "bin").mkdir(parents=True)
        (b / "src").symlink_to(paths.home() / "src")
        for prog in ("llama-server", "llama-fidelity-dump"):
            (b / "bin" / prog).symlink_to(paths.home() / "bin" / prog)
        if server == "broken":
            (b / "bin" / "llama-server").unlink()
            (b / "bin" / "llama-server").write_text(
                "#!/bin/sh\necho 'llama_model_load: error loading model: unknown model architecture'\nexit 1\n")
            (b / "bin" / "llama-server").chmod(0o755)
        (b / "BUILD").write_text(paths.spec(n) + "\n")
    return root


def _history(cache, out, *args):
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    env.pop("LLAMA_CPP_HOME", None)
    return subprocess.run([sys.executable, "-m", "fidelity.cli", "llamacpp", "history", "--needle-length", "0",
                           "--lengths", "256", "--reps", "1", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, cwd=paths.REPO)


def test_history_of_two_identical_builds_and_a_broken_one(cache, tmp_path):
    a, b, c = paths.PINNED_NUMBER, paths.PINNED_NUMBER + 1, paths.PINNED_NUMBER + 2
    r = _history(cache, tmp_path, "--builds", f"{a},{b}", "--no-bisect")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "every adjacent pair serves bit-identical distributions" in r.stdout
    hist = tmp_path / "llamacpp-history"
    lines = [json.loads(x) for x in (hist / "history.jsonl").read_text().splitlines()]
    pair = next(x for x in lines if x["stage"] == "pair")
    assert pair["kind"] == "identical" and pair["same_gguf"] and pair["identical"] == pair["prompts"] == 3
    scored = {x["key"]: x for x in lines if x["stage"] == "scored"}
    assert scored[a]["ok"] and not scored[a]["unexplained"]         # the pinned build matches its twin
    assert scored[b]["server_build"] == scored[a]["server_build"]   # the same program under another number

    r = _history(cache, tmp_path, "--builds", f"{a},{b},{c}", "--no-bisect")     # resumes; adds the broken one
    assert r.returncode == 0, r.stderr[-2000:]
    again = [json.loads(x) for x in (hist / "history.jsonl").read_text().splitlines()]
    assert [x["key"] for x in again if x["stage"] == "scored" and x["ok"]] == [a, b]   # none scored twice
    broken = next(x for x in again if x["stage"] == "scored" and x["key"] == c)
    assert not broken["ok"] and "unknown model architecture" in broken["reason"]
    table = pd.read_csv(hist / "report" / "builds.csv")
    assert list(table.build) == [f"b{a}", f"b{b}", f"b{c}"]
    assert table.status.iloc[2].startswith("failed: serve:") and "unknown model architecture" in table.status.iloc[2]
    html = (hist / "report" / "index.html").read_text()
    assert "could not be used: b%d (serve: llama_model_load: error loading model" % c in html
    assert "<img" in html and (hist / "report" / "timeline.png").is_file()


def test_two_builds_replayed_and_compared_tensor_by_tensor(cache, tmp_path):
    from fidelity.llamacpp import history as H
    from fidelity.weights.source import EMBEDDED
    a, b = paths.PINNED_NUMBER, paths.PINNED_NUMBER + 1
    env = {"XDG_CACHE_HOME": str(cache)}
    old = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "LLAMA_CPP_HOME")}
    os.environ.update(env)
    os.environ.pop("LLAMA_CPP_HOME", None)
    try:
        h = H.History(tmp_path, H.Settings(EMBEDDED, needle_length=0, replay_tokens=48))
        for n in (a, b):
            h.ledger.add("built", n, ok=True, replay=True)
            h._convert(paths.of(n))
        r = h.localise(a, b)
        c = h.cause(a, b)
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert r["ok"], r.get("reason")
    assert r["tensors"]["first"] is None and r["tensors"]["compared"] > 20
    assert not r["tensors"]["only_a"] and not r["tensors"]["only_b"]
    assert set(r["replay"]) == {f"b{a}", f"b{b}"} and r["replay"][f"b{a}"] == r["replay"][f"b{b}"]
    assert c["ok"] and not c["converter"] and not c["engine"] and c["sources"]["files"] == []
    assert c["words"].endswith("sources: the two source trees are identical")
