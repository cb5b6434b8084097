"""Haystacks: exact token lengths in the target tokenizer, needle at a sentence boundary
at the requested depth, RULER kinds, determinism; and the scoring taxonomy."""
import re

import pytest

from needle.haystack import (HaystackError, HaystackSpec, LocalCounter, PromptFormat,
                             build_prompt, trial_seed)
from needle.scoring import score
from needle.sweep import residue_lengths
from reference_model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def counter():
    return LocalCounter(load_tokenizer())


def test_residue_lengths_cover_mod4_and_mod128():
    ls = residue_lengths([512, 1024])
    assert {L % 4 for L in ls} == {0, 1, 2, 3}
    assert {L % 128 for L in ls} == {127, 0, 1, 2}


@pytest.mark.parametrize("mode", ["chat", "completion"])
@pytest.mark.parametrize("kind,vtype,filler,distractors", [("single", "number", "essay", "random"),
                                                            ("multikey", "uuid", "noise", "random"),
                                                            ("multivalue", "word", "essay", "random"),
                                                            ("multiquery", "word", "essay", "random"),
                                                            ("multikey", "number", "noise", "near")])
def test_exact_lengths_in_process(counter, mode, kind, vtype, filler, distractors):
    tok = counter.tok
    spec = HaystackSpec(kind, vtype, filler, distractors=distractors)
    for L in (511, 512, 513, 514, 767, 1023, 1024, 2049):       # every residue mod 4, around 128s
        for d in (0, 50, 100):
            p = build_prompt(spec, PromptFormat(mode), counter, L, d,
                             trial_seed(kind, L, d))
            assert len(tok.encode(p.text)) == L == p.n_tokens and p.exact
            assert sorted(p.text[a:b] for a, b in p.value_spans) == sorted(p.expected)


def _needle_sentences(p):
    return [m for m in re.finditer(r"One of the special magic \w+ for [a-z]+-[a-z]+ is: [0-9a-z-]+\.", p.text)]


def test_needle_at_sentence_boundary_and_depth(counter):
    spec = HaystackSpec()
    for d in (0, 25, 50, 75, 100):
        p = build_prompt(spec, PromptFormat(), counter, 1500, d, 11)
        (m,) = _needle_sentences(p)
        before, after = p.text[:m.start()], p.text[m.end():]
        assert before.endswith(("afterwards.\n", ". ")), before[-30:]
        assert after.startswith((" ", "\nWhat is")), after[:30]
        assert after.startswith("\nWhat is") or after[1].isupper()
        assert abs(p.depth_chars - d / 100) < 0.06, (d, p.depth_chars)
    p0 = build_prompt(spec, PromptFormat(), counter, 1500, 0, 11)
    p100 = build_prompt(spec, PromptFormat(), counter, 1500, 100, 11)
    assert "afterwards.\nOne of the special magic" in p0.text
    assert re.search(r"is: \d{7}\.\nWhat is the special magic number", p100.text)


def test_kinds(counter):
    p = build_prompt(HaystackSpec("multikey", "number"), PromptFormat(), counter, 900, 50, 5)
    assert len(_needle_sentences(p)) == 4 and len(p.distractors) == 3 and len(p.expected) == 1
    assert p.key in p.text.split("\n")[-1] or p.key in p.user.split("\n")[-1]
    for v in p.distractors:
        assert v in p.text and v not in p.expected
    p = build_prompt(HaystackSpec("multivalue", "uuid"), PromptFormat(), counter, 1200, 30, 5)
    assert len(p.expected) == 4 and not p.distractors
    assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", v)
               for v in p.expected)
    assert "What are all the special magic uuids" in p.text


def test_deterministic_and_seeded(counter):
    a = build_prompt(HaystackSpec(), PromptFormat(), counter, 700, 40, 123)
    b = build_prompt(HaystackSpec(), PromptFormat(), counter, 700, 40, 123)
    c = build_prompt(HaystackSpec(), PromptFormat(), counter, 700, 40, 124)
    assert a.text == b.text and a.sha256 == b.sha256 and a.text != c.text


def test_completion_mode_has_answer_prefix_and_bos(counter):
    p = build_prompt(HaystackSpec(), PromptFormat("completion"), counter, 600, 50, 1)
    assert p.text.startswith("<｜begin▁of▁sentence｜>Some special magic")
    assert p.text.endswith("mentioned in the provided text is")


def test_too_short_is_a_clear_error(counter):
    with pytest.raises(HaystackError, match="minimum"):
        build_prompt(HaystackSpec(), PromptFormat(), counter, 50, 50, 1)


@pytest.mark.parametrize("content,finish,outcome,found", [
    ("The number is 1234567.", "stop", "correct", 1),
    ("THE NUMBER IS 1234567", "length", "correct", 1),        # found beats truncation
    ("It is 12345678.", "stop", "wrong", 0),                  # not the whole value
    ("It is 7654321.", "stop", "wrong", 0),
    ("It is 7654321 and then I kept", "length", "wrong", 0),  # committed before the cut
    ("Let me think about the", "length", "truncated", 0),
    ("", "length", "truncated", 0),
    ("", "stop", "empty", 0),
    (None, "stop", "empty", 0),
    ("Sorry, the text does not mention it.", "stop", "refused", 0),
    ("bananas", "stop", "other", 0),
])
def test_scoring_taxonomy(content, finish, outcome, found):
    s = score(["1234567"], content, finish, None, ["7654321"], "number", "red-fox")
    assert (s.outcome, s.found) == (outcome, found)


def test_scoring_partial_errors_and_keys():
    s = score(["a-b", "c-d", "e-f", "g-h"], "a-b and e-f", "stop", value_type="word")
    assert s.outcome == "partial" and s.recall == 0.5
    s = score(["1234567"], None, None, "HTTP 500: boom")
    assert s.outcome == "server_error" and s.recall is None
    # echoing the key (same shape as a word value) is not a wrong value
    s = score(["calm-otter"], "The word for red-fox is unknown to me", "stop", value_type="word", key="red-fox")
    assert s.outcome == "other"


def test_a_counter_that_counts_nothing_is_an_error_not_an_endless_search():
    """A tokenize route that ignores its body (llama-server sent `prompt` instead of
    `content` answers an empty list) must stop the search, not grow the haystack forever."""
    import pytest
    from needle.haystack import HaystackError, largest_fit
    with pytest.raises(HaystackError, match="not counting"):
        largest_fit(lambda w: 0, 500, {})
