"""`fidelity serve` against the engines' wire formats as the research notes document them
(tests/data/wire_formats.json, written from docs/research/engine-integration.md §1.1, §1.2,
§2.2, §3.4 and docs/research/engine-divergences.md §6): SGLang's /generate meta_info logprobs
and vLLM's prompt_logprobs (checked against SGLang's numbers and against the full
vocabulary). A real server subprocess. The captures, the tokenize endpoints and the ops
routes: tests/test_server_wire_ops.py."""
import math

import httpx
import pytest

from needle_util import ok, served
from wire_util import GEN, K, OPS, START_K, TRIPLE, VLLM, generate, is_type, sentence_ids


@pytest.fixture(scope="module")
def ids(http):
    return sentence_ids(http)


@pytest.fixture(scope="module")
def score_ids(ids):
    """token_ids_logprob: two prompt tokens (so their scores can be checked against the
    prompt's own logprobs) and one id that is not in the prompt."""
    outside = next(i for i in range(1, 500) if i not in ids)
    return [ids[2], ids[5], outside]


@pytest.fixture(scope="module")
def gen0(http, ids, score_ids):
    """/generate with the whole prompt scored, return_text_in_logprobs false and true."""
    return {text: generate(http, ids, return_logprob=True, logprob_start_len=0, top_logprobs_num=K,
                           token_ids_logprob=score_ids, return_text_in_logprobs=text)
            for text in (False, True)}


# ---- interpreting the spec -------------------------------------------------------------------

def check_triple(t, text: bool, null_logprob: bool = False):
    assert isinstance(t, list) and len(t) == TRIPLE["arity"], t
    for slot, v in zip(TRIPLE["slots"], t):
        kind = TRIPLE["types"][slot]
        if slot == "logprob" and null_logprob:
            assert v is None, f"logprob should be null: {t}"
        elif slot == "text" and not text:
            assert v is None, f"text should be null without {TRIPLE['text_null_unless']}: {t}"
        else:
            assert is_type(v, kind), f"{slot} should be {kind}: {t}"
    if t[0] is not None:
        assert t[0] <= 0 and math.isfinite(t[0]), t


def n_entries(kind: str, n_prompt: int, start: int, n_out: int) -> int:
    return {"prompt_positions_from_start": n_prompt - start, "output_tokens": n_out,
            "prompt_positions": n_prompt}[kind]


def check_triples(meta, key, *, n_prompt, start, n_out, text, k=None, req_ids=None):
    """One of meta_info's logprob lists against its spec entry; returns it."""
    spec = GEN[key]
    rows = meta[key]
    assert isinstance(rows, list) and len(rows) == n_entries(spec["entries"], n_prompt, start, n_out), \
        f"{key}: {len(rows)} entries"
    for j, row in enumerate(rows):
        if spec["element"] == "triple":
            check_triple(row, text, null_logprob=j in spec["null_logprob_at"])
            continue
        if j in spec["null_entries"]:
            assert row is None, f"{key}[{j}] should be null"
            continue
        want = {"top_logprobs_num": k, "len(token_ids_logprob)": len(req_ids or ())}[spec["length"]]
        assert isinstance(row, list) and len(row) == want, f"{key}[{j}]: {row}"
        for t in row:
            check_triple(t, text)
        if spec.get("order") == "logprob_descending":
            lps = [t[0] for t in row]
            assert lps == sorted(lps, reverse=True), f"{key}[{j}] not sorted descending: {lps}"
        if spec.get("ids") == "token_ids_logprob_in_request_order":
            assert [t[1] for t in row] == list(req_ids), f"{key}[{j}] ids"
    return rows


def check_finish(meta):
    fr = GEN["meta_info_always"]["finish_reason"]
    v = meta["finish_reason"]
    assert isinstance(v, dict), f"finish_reason should be an object: {v!r}"
    for key in fr["required_keys"]:
        assert key in v, f"finish_reason lacks {key}: {v}"
    assert v["type"] in fr["types"], v


# ---- SGLang /generate ------------------------------------------------------------------------

def test_generate_meta_info_keys(gen0, ids):
    when = GEN["meta_info_when"]
    for meta in gen0.values():
        want = GEN["meta_info_always"]["keys"] + when["return_logprob"] + when["top_logprobs_num"] + \
            when["token_ids_logprob"]
        missing = [k for k in want if k not in meta]
        assert not missing, f"meta_info lacks {missing}"
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == len(meta["output_token_logprobs"]) == \
            len(meta["output_top_logprobs"])
        assert 1 <= meta["completion_tokens"] <= 2
        check_finish(meta)
        if meta["finish_reason"]["type"] == "length":
            assert meta["completion_tokens"] == 2


def test_generate_without_logprob_has_no_logprob_lists(http, ids):
    meta = generate(http, ids)
    when = GEN["meta_info_when"]
    assert not [k for k in when["return_logprob"] + when["top_logprobs_num"] if k in meta]
    for key in GEN["meta_info_always"]["keys"]:
        assert key in meta, key
    check_finish(meta)


@pytest.mark.parametrize("text", [False, True])
def test_generate_input_token_logprobs(gen0, ids, text):
    meta = gen0[text]
    rows = check_triples(meta, "input_token_logprobs", n_prompt=len(ids), start=0,
                         n_out=meta["completion_tokens"], text=text)
    assert [r[1] for r in rows] == ids                  # "the prompt ids from logprob_start_len on"
    assert rows[0][0] is None and all(r[0] is not None for r in rows[1:])


@pytest.mark.parametrize("text", [False, True])
def test_generate_input_top_logprobs(gen0, ids, text):
    meta = gen0[text]
    tops = check_triples(meta, "input_top_logprobs", n_prompt=len(ids), start=0,
                         n_out=meta["completion_tokens"], text=text, k=K)
    toks = meta["input_token_logprobs"]
    inside = 0
    for i in range(1, len(ids)):                         # entry i predicts prompt token i
        top = {t[1]: t[0] for t in tops[i]}
        if ids[i] in top:
            inside += 1
            assert top[ids[i]] == pytest.approx(toks[i][0], abs=1e-12)
        else:
            assert toks[i][0] <= tops[i][-1][0]
    assert 0 < inside < len(ids) - 1, "the prompt should have tokens both inside and outside the top k"


def tops_min(row) -> float:
    return min(t[0] for t in row)


@pytest.mark.parametrize("text", [False, True])
def test_generate_input_token_ids_logprobs(gen0, ids, score_ids, text):
    meta = gen0[text]
    rows = check_triples(meta, "input_token_ids_logprobs", n_prompt=len(ids), start=0,
                         n_out=meta["completion_tokens"], text=text, req_ids=score_ids)
    hits = 0
    for i in range(1, len(ids)):
        top = {t[1]: t[0] for t in meta["input_top_logprobs"][i]}
        for lp, tid, _ in rows[i]:
            if tid == ids[i]:
                hits += 1
                assert lp == pytest.approx(meta["input_token_logprobs"][i][0], abs=1e-12)
            if tid in top:
                assert lp == pytest.approx(top[tid], abs=1e-12)
            assert lp <= tops_min(meta["input_top_logprobs"][i]) or tid in top
    assert hits >= 2                                    # score_ids holds ids[2] and ids[5]


@pytest.mark.parametrize("text", [False, True])
def test_generate_output_logprobs(gen0, ids, text):
    meta = gen0[text]
    n = meta["completion_tokens"]
    out = check_triples(meta, "output_token_logprobs", n_prompt=len(ids), start=0, n_out=n, text=text)
    tops = check_triples(meta, "output_top_logprobs", n_prompt=len(ids), start=0, n_out=n, text=text, k=K)
    for tok, top in zip(out, tops):                      # temperature 0: the greedy token, raw logprob
        assert tok[1] == top[0][1] and tok[0] == pytest.approx(top[0][0], abs=1e-12)


def test_generate_text_in_logprobs(gen0, http, ids):
    plain, text = gen0[False], gen0[True]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [r[:2] for r in plain[key]] == [r[:2] for r in text[key]], key
    for key in ("input_top_logprobs", "input_token_ids_logprobs", "output_top_logprobs"):
        strip = [None if r is None else [t[:2] for t in r] for r in text[key]]
        assert strip == [None if r is None else [t[:2] for t in r] for r in plain[key]], key
    whole = ok(http.post(OPS["detokenize"]["route"], json={"tokens": ids}))[OPS["detokenize"]["response_key"]]
    assert "".join(r[2] for r in text["input_token_logprobs"]) == whole


def test_generate_logprob_start_len_k(http, gen0, ids, score_ids):
    meta = generate(http, ids, return_logprob=True, logprob_start_len=START_K, top_logprobs_num=K,
                    token_ids_logprob=score_ids)
    n_out = meta["completion_tokens"]
    rows = check_triples(meta, "input_token_logprobs", n_prompt=len(ids), start=START_K, n_out=n_out,
                         text=False)
    assert [r[1] for r in rows] == ids[START_K:]
    check_triples(meta, "input_top_logprobs", n_prompt=len(ids), start=START_K, n_out=n_out,
                  text=False, k=K)
    check_triples(meta, "input_token_ids_logprobs", n_prompt=len(ids), start=START_K, n_out=n_out,
                  text=False, req_ids=score_ids)
    full = gen0[False]
    for j in range(1, len(rows)):                        # the same forward, scored from START_K on
        assert rows[j][0] == pytest.approx(full["input_token_logprobs"][START_K + j][0], abs=1e-9)
        assert [t[1] for t in meta["input_top_logprobs"][j]] == \
            [t[1] for t in full["input_top_logprobs"][START_K + j]]


@pytest.mark.parametrize("explicit", [False, True])
def test_generate_logprob_start_len_default(http, ids, explicit):
    assert GEN["logprob_start_len"]["meanings"][str(GEN["logprob_start_len"]["default"])] == \
        "no_prompt_position_scored"
    extra = {"logprob_start_len": GEN["logprob_start_len"]["default"]} if explicit else {}
    meta = generate(http, ids, return_logprob=True, top_logprobs_num=K, **extra)
    n = meta["completion_tokens"]
    # "output tokens only": no prompt position carries a logprob or a top list
    assert all(r[0] is None for r in meta.get("input_token_logprobs", [])), meta["input_token_logprobs"]
    assert all(r is None for r in meta.get("input_top_logprobs", [])), meta["input_top_logprobs"]
    assert all(r[1] in ids for r in meta.get("input_token_logprobs", []))
    check_triples(meta, "output_token_logprobs", n_prompt=len(ids), start=0, n_out=n, text=False)
    check_triples(meta, "output_top_logprobs", n_prompt=len(ids), start=0, n_out=n, text=False, k=K)


def test_generate_prefill_only(http, gen0, ids):
    spec = GEN["prefill_only"]
    meta = ok(http.post(GEN["route"], json={
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": K,
        "sampling_params": {"max_new_tokens": spec["max_new_tokens"], "temperature": 0}}))["meta_info"]
    assert meta["completion_tokens"] == spec["output_entries"]
    assert meta.get("output_token_logprobs", []) == []
    rows = check_triples(meta, "input_token_logprobs", n_prompt=len(ids), start=0, n_out=0, text=False)
    assert [r[0] for r in rows[1:]] == pytest.approx([r[0] for r in gen0[False]["input_token_logprobs"][1:]],
                                                     abs=1e-9)


# ---- vLLM prompt_logprobs, and against SGLang ------------------------------------------------

def prompt_logprobs(http, ids, k) -> list:
    out = ok(http.post(VLLM["route"], json={"prompt": ids, "prompt_logprobs": k, "max_tokens": 1,
                                            "temperature": 0}))
    node = out
    for step in VLLM["response"]["path"]:
        node = node[step]
    return node


def check_vllm_shape(plp, ids, k) -> list[tuple[int, dict]]:
    """Every prompt_logprobs entry against §1.2; returns (actual rank, entry) per position."""
    spec = VLLM["response"]
    assert isinstance(plp, list) and len(plp) == len(ids)
    out = []
    for j, entry in enumerate(plp):
        if j in spec["null_entries"]:
            assert entry is None, f"prompt_logprobs[{j}] should be null"
            continue
        assert isinstance(entry, dict) and entry
        for key, v in entry.items():
            assert isinstance(key, str) and key == str(int(key)), f"key {key!r} is not a string token id"
            assert sorted(v) == sorted(spec["value_keys"]), v
            for name, kind in spec["value_types"].items():
                assert is_type(v[name], kind), f"{name} should be {kind}: {v}"
        keys = list(entry)
        assert keys[0] == str(ids[j]), f"position {j}: the actual token {ids[j]} should come first, got {keys}"
        actual = entry[keys[0]]
        assert actual["rank"] >= spec["actual_rank_min"]
        top = sorted((v["rank"], int(key), v["logprob"]) for key, v in entry.items() if v["rank"] <= k)
        assert [r for r, _, _ in top] == list(range(1, k + 1)), f"position {j}: top ranks {top}"
        lps = [lp for _, _, lp in top]
        assert lps == sorted(lps, reverse=True), f"position {j}: rank order is not logprob order"
        rest = [entry[key]["rank"] for key in keys[1:]]
        assert rest == sorted(rest), f"position {j}: top-k after the actual token should be in rank order"
        if actual["rank"] <= k:                         # inside the top k: k entries
            assert len(entry) == k
            assert actual["rank"] == 1 + sum(lp > actual["logprob"] for _, _, lp in top)
        else:                                           # outside: k + 1 entries
            assert len(entry) == k + 1
            assert actual["logprob"] <= min(lps)
        out.append((actual["rank"], entry))
    return out


def test_vllm_prompt_logprobs_match_sglang(http, gen0, ids):
    plp = prompt_logprobs(http, ids, K)
    ranks = check_vllm_shape(plp, ids, K)
    assert any(r <= K for r, _ in ranks) and any(r > K for r, _ in ranks), \
        "the prompt should exercise both the k and the k+1 case"
    sg = gen0[False]
    for j in range(1, len(ids)):
        mine = plp[j][str(ids[j])]["logprob"]
        assert mine == pytest.approx(sg["input_token_logprobs"][j][0], abs=1e-9), f"position {j}"
        vtop = sorted(((v["rank"], int(key), v["logprob"]) for key, v in plp[j].items() if v["rank"] <= K))
        assert [i for _, i, _ in vtop] == [t[1] for t in sg["input_top_logprobs"][j]], f"position {j}"
        assert [lp for _, _, lp in vtop] == pytest.approx([t[0] for t in sg["input_top_logprobs"][j]], abs=1e-9)


def test_vllm_full_vocabulary_ranks(ids):
    """A second server with --max-logprobs -1: prompt_logprobs -1 is the whole vocabulary;
    ranks from the top-k request agree with the rank counted over the full list."""
    full_k = VLLM["request"]["full_vocabulary"]
    with served("golden", extra=("--max-logprobs", "-1")) as (u,), httpx.Client(base_url=u, timeout=120) as c:
        vocab = ok(c.get(OPS["model_info"]["route"]))["vocab_size"]
        full = prompt_logprobs(c, ids, full_k)
        topk = prompt_logprobs(c, ids, K)
    check_vllm_shape(full, ids, vocab)
    outside = 0
    for j in range(1, len(ids)):
        lps = {int(key): v["logprob"] for key, v in full[j].items()}
        assert len(lps) == vocab and set(lps) == set(range(vocab))
        assert math.fsum(math.exp(v) for v in lps.values()) == pytest.approx(1.0, abs=1e-6)
        for key, v in list(full[j].items())[:5] + [(str(ids[j]), full[j][str(ids[j])])]:
            assert v["rank"] == 1 + sum(x > v["logprob"] for x in lps.values()), f"position {j}, token {key}"
        true_rank = 1 + sum(x > lps[ids[j]] for x in lps.values())
        assert topk[j][str(ids[j])]["rank"] == true_rank, f"position {j}"
        assert topk[j][str(ids[j])]["logprob"] == pytest.approx(lps[ids[j]], abs=1e-9)
        outside += true_rank > K
    assert outside, "some prompt token should lie outside the top k"


def error_message(r: httpx.Response) -> str:
    body = r.json()
    err = body.get("error", body) if isinstance(body, dict) else body
    return err.get("message", "") if isinstance(err, dict) else str(err)


def test_vllm_prompt_logprobs_refused(http, ids):
    cap = VLLM["cap"]
    base = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    bad = [{"prompt_logprobs": cap["default_max_logprobs"] + 1},
           {"prompt_logprobs": VLLM["request"]["full_vocabulary"]}]       # -1 = vocab > 20
    bad += [{"prompt_logprobs": v} for v in VLLM["request"]["rejected_values"]]
    bad += [{"prompt_logprobs": 2, **VLLM["request"]["rejected_with"]}]
    for extra in bad:
        r = http.post(VLLM["route"], json={**base, **extra})
        assert r.status_code == cap["over_cap_status"], (extra, r.status_code, r.text)
        assert cap["error_names_field"] in error_message(r), (extra, r.text)
    assert ok(http.post(VLLM["route"], json={**base, "prompt_logprobs": cap["default_max_logprobs"]}))
