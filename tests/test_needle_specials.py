"""BOS in a reply is a finding of its own (vllm#41834: NaN logits rows whose argmax emitted
token 0 in about 1 of 120 long generations; scanning `content` alone missed most). Two real
stub servers over HTTP, one whose replies carry BOS in a known few trials -- in content or in
reasoning_content only -- through `fidelity needle`: every planted reply counted, in both
fields, named in the verdict's first line and the exit code 1, while recall is identical."""
import json

from fidelity.cli import main
from needle.scoring import BOS_TEXT, leaked_specials
from needle.stub import StubServer
from reference_model.tokenizer import load_tokenizer

ARGS = ["--lengths", "300,400", "--depths", "0,100", "--reps", "2", "--api", "chat", "--temperature", "0",
        "--concurrency", "1", "--quiet", "--no-plots"]


def test_the_special_tokens_are_the_tokenizers_own():
    from needle.scoring import SPECIAL_TEXTS
    from reference_model import tokenizer as T
    assert SPECIAL_TEXTS == (T.BOS, T.EOS, T.USER, T.ASSISTANT) and BOS_TEXT == T.BOS


def test_specials_are_found_in_content_and_reasoning_in_order():
    res = {"response": f"The answer{BOS_TEXT} is 12.<｜User｜>", "reasoning_content": f"{BOS_TEXT}x{BOS_TEXT}"}
    assert leaked_specials(res) == {"response": [BOS_TEXT, "<｜User｜>"], "reasoning_content": [BOS_TEXT, BOS_TEXT]}
    assert leaked_specials({"response": "The answer is 12.", "reasoning_content": None}) == {}


def test_bos_replies_are_counted_named_and_flagged(tmp_path, capsys):
    tok = load_tokenizer()
    faults = ["ok", "bos", "ok", "ok", "bos:reasoning", "ok", "ok", "ok"]       # 8 trials, one request each
    with StubServer(tokenizer=tok, wrong_every=0) as clean, \
            StubServer(faults=faults, tokenizer=tok, wrong_every=0) as nan:
        rc = main(["needle", "--endpoint", f"clean={clean.url}", "--endpoint", f"nan={nan.url}", *ARGS,
                   "--out", str(tmp_path), "--run-id", "r"])
    out = capsys.readouterr().out
    assert rc == 1, out
    rows = [json.loads(line) for line in (tmp_path / "needle" / "results.jsonl").read_text().splitlines()]
    trials = [r for r in rows if r.get("type") == "trial" or "trial_id" in r]
    planted = [r for r in trials if r["arm"] == "nan" and r.get("specials")]
    assert sorted(list(r["specials"]) for r in planted) == [["reasoning_content"], ["response"]]
    summary = json.loads((tmp_path / "needle" / "r" / "summary.json").read_text())
    arms = {a["arm"]: a for a in summary["tables"]["arms"]}
    assert (arms["nan"]["bos_replies"], arms["nan"]["bos_reasoning_only"]) == (2, 1)
    assert arms["clean"]["bos_replies"] == 0 and arms["nan"]["recall"] == arms["clean"]["recall"] == 1.0
    page = (tmp_path / "needle" / "r" / "summary.md").read_text()
    assert "**Verdict.** `nan`: BOS (token 0, what argmax over a NaN logits row emits) in 2 of 8 replies " \
           "(1 of them only in reasoning_content" in page
    assert "nan: BOS in 2 of 8 replies (1 only in reasoning_content)" in out


def test_the_engines_page_flags_an_arm_whose_needle_replies_carry_bos(tmp_path):
    from fidelity.engines.page import _needle_words
    (tmp_path / "summary.json").write_text(json.dumps({"tables": {"pairs": [], "arms": [
        {"arm": "clean", "n": 8, "bos_replies": 0}, {"arm": "nan", "n": 8, "bos_replies": 2}]}}))
    _, flags = _needle_words({"needle": str(tmp_path), "recall": []})
    assert flags == {"nan": "BOS in 2 of 8 needle replies (token 0: a NaN logits row's argmax)"}
