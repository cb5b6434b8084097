"""BOS and other special tokens in an engine's own replies are a consistency finding (issue 61;
fidelity/consistency/specials.py): counted from the replies' token ids, by hand on stored
rows, and through a real `fidelity serve` whose head gives a few rows to BOS, as an argmax over
a NaN row does (examples/plugins/rare_token.py with bos): named and flagged."""
from pathlib import Path

import pandas as pd
import pytest

from fidelity.cli import main
from fidelity.consistency.specials import special_counts, special_lines
from reference_model.tokenizer import load_tokenizer

from needle_util import served

PLUGIN = str(Path(__file__).resolve().parents[1] / "examples" / "plugins" / "rare_token.py")


def test_replies_are_counted_by_their_token_ids_before_eos():
    tok = load_tokenizer()
    nan = float("nan")
    rows = pd.DataFrame([
        {"arm": "a", "tokens": [7, 8, 9]},
        {"arm": "a", "tokens": [7, 0, 9], "dists": [[[7, 8], [-0.1, -2.0]]]},
        {"arm": "a", "tokens": [3, 4, 5], "dists": [[[3], [nan]]]},
        {"arm": "a", "tokens": []},                                          # no reply: not counted
        {"arm": "b", "tokens": [4, 10, 1, 0, 2]},        # BOS after EOS: a probe generating past it
    ])
    t = special_counts(rows, tok.bos_id, tok.eos_id).set_index("arm")
    assert t.loc["a"].to_dict() == {"replies": 3, "bos_replies": 1, "nonfinite_replies": 1}
    assert t.loc["b"].to_dict() == {"replies": 1, "bos_replies": 0, "nonfinite_replies": 0}
    assert special_lines(t.reset_index()) == [
        "`a`: BOS (token 0, what argmax over a NaN logits row emits) in 1 of 3 replies; non-finite "
        "logprobs in 1 of 3 replies (never produced by a healthy engine)"]


@pytest.mark.slow          # ~30 s on 2 cores: make test-slow (CI runs it)
def test_a_server_that_emits_bos_is_flagged(tmp_path, capsys):
    args = ["--families", "prefix", "--probes", "1", "--quiet"]
    with served("rare_token_swap(period=7,bos=true)", extra=("--plugin", PLUGIN)) as (url,):
        rc = main(["consistency", "--endpoint", f"nan={url}", *args, "--out", str(tmp_path), "--run-id", "r"])
    got = capsys.readouterr()
    out = got.out
    assert rc == 1, got.err
    assert out.splitlines()[0].startswith("`nan`: BOS (token 0, what argmax over a NaN logits row emits) in "), out
