"""Streaming detokenization: text is released only once final (UTF-8 sequences split
across byte tokens, stop strings split across tokens), and the streamed pieces add up to
the non-streamed text."""
from fidelity.serve.textstream import TextStream, cut_stop


def _decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def _stream(data: bytes, stop=()):
    s = TextStream(_decode, list(stop))
    parts = [s.push(b) for b in data]
    return parts, parts + [s.finish()], s


def test_split_utf8_is_held_until_complete():
    parts, allp, _ = _stream("aé€".encode())
    assert parts == ["a", "", "é", "", "", "€"]
    assert "".join(allp) == "aé€" and all("\ufffd" not in p for p in allp)


def test_stop_string_across_tokens_never_leaks():
    parts, allp, s = _stream(b"one ST two STOP three", ["STOP"])
    assert "".join(allp) == "one ST two " == cut_stop("one ST two STOP three", ["STOP"])
    assert s.stopped and all("STOP" not in p and "STO" not in "".join(allp) for p in parts)


def test_held_prefix_released_at_the_end():
    _, allp, s = _stream(b"abcST", ["STOP"])
    assert allp[-1] == "ST" and "".join(allp) == "abcST" and not s.stopped
