"""User prompt files (text, chat messages or token ids per line) for `fidelity ab` and
`fidelity kld`: parsed into the ids the tokenizer gives, each malformed line named by
file:line; `fidelity ab --prompts` runs on them."""
import json

import pytest

from fidelity.cli import main
from fidelity.design.prompts import PromptFileError, file_prompts, grid_prompt, grid_prompts
from fidelity.weights.target import load_target

T = load_target(None)


def _write(tmp_path, *lines):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_three_kinds(tmp_path):
    msgs = [{"role": "user", "content": "Where does the river run?"}]
    p = _write(tmp_path, {"id": "c", "messages": msgs}, {"text": "The river."}, "",
               {"token_ids": [5, 6, 7]})
    got = file_prompts(p, T.tokenizer, T.cfg.vocab_size)
    assert [x.id for x in got] == ["c", "p2", "p4"] and [x.group for x in got] == ["messages", "text", "token_ids"]
    assert got[0].tokens.tolist() == T.tokenizer.encode(T.tokenizer.render_chat(msgs).text)
    assert got[1].tokens.tolist() == T.tokenizer.encode("The river.") and got[2].tokens.tolist() == [5, 6, 7]


@pytest.mark.parametrize("line,frag", [
    ("{nope", "p.jsonl:1: not JSON"),
    ({"text": "a", "token_ids": [1, 2]}, "exactly one of"),
    ({"token_ids": [1, 99999]}, "token_ids must be"),
    ({"messages": "hi"}, "p.jsonl:1"),
    ({"token_ids": [4]}, "at least 2"),
])
def test_errors_name_file_and_line(tmp_path, line, frag):
    with pytest.raises(PromptFileError, match=frag):
        file_prompts(_write(tmp_path, line), T.tokenizer, T.cfg.vocab_size)


def test_duplicate_ids_and_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match="duplicate id 'a'"):
        file_prompts(_write(tmp_path, {"id": "a", "text": "x y"}, {"id": "a", "text": "y z"}),
                     T.tokenizer, T.cfg.vocab_size)
    with pytest.raises(PromptFileError, match="not found"):
        file_prompts(tmp_path / "none.jsonl", T.tokenizer, T.cfg.vocab_size)


def test_grid_prompts_have_exact_lengths_and_needles():
    ps = grid_prompts(T.tokenizer, [250, 260], [0.0, 100.0], 1, 3)
    assert [p.length for p in ps] == [250, 250, 260, 260] and all(p.needle_tokens for p in ps)
    assert ps[0].needle_tokens[0] < ps[1].needle_tokens[0]               # depth moves the needle


def test_one_grid_prompt_rebuilt_from_its_id():
    ps = grid_prompts(T.tokenizer, [250, 260], [10.0, 90.0], 2, 3)
    for p in ps:
        q = grid_prompt(T.tokenizer, p.id, 3)
        assert q.id == p.id and q.tokens.tolist() == p.tokens.tolist() and q.needle_tokens == p.needle_tokens
    with pytest.raises(ValueError, match="not a grid prompt id"):
        grid_prompt(T.tokenizer, "L250-d10", 3)


def test_ab_runs_on_a_prompt_file(tmp_path, capsys):
    p = _write(tmp_path, {"messages": [{"role": "user", "content": "Tell me about the stone bridge."}]},
               {"token_ids": list(range(5, 45))})
    rc = main(["ab", "--prompts", str(p), "--arm", "engine", "--shapley-top", "0", "--n-boot", "100",
               "--decode-steps", "2", "--out", str(tmp_path / "r"), "--run-id", "t"])
    assert rc == 0
    m = json.loads((tmp_path / "r" / "t" / "manifest.json").read_text())
    assert [x["group"] for x in m["manifest"]["prompts"]] == ["file", "file"]
    assert m["manifest"]["settings"]["prompts"]["prompts_file"] == str(p)
