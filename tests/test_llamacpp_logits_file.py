"""llama.cpp's logits file (fidelity/llamacpp/logits_file.py) against hand-derived values:
the header bytes, one quantized row worked out by hand, the round trip's error bound, and
each malformed file's error. The file llama.cpp itself reads and writes is tested against
the real llama-perplexity in test_llama_cpp.py."""
import struct

import numpy as np
import pytest

from fidelity.llamacpp import logits_file as F


def test_row_by_hand():
    # logits 0, -1, -2, -20 (vocab 4): top 0, low = max(-20, 0 - 16) = -16,
    # lse = log(1 + e^-1 + e^-2 + e^-20), scale = 16 / 65535, min_log_prob = -16 - lse
    row = F.quantize_row(np.array([0.0, -1.0, -2.0, -20.0]))
    assert row.shape == (8,) and row.dtype == np.uint16          # 4 header uint16 + 4 values
    scale, mlp = struct.unpack("<ff", row[:4].tobytes())
    lse = np.log(1 + np.exp(-1) + np.exp(-2) + np.exp(-20))
    assert scale == pytest.approx(16 / 65535, rel=1e-6)
    assert mlp == pytest.approx(-16 - lse, rel=1e-6)
    # q = round((x + 16) * 65535 / 16): 65535, 61439.06 -> 61439, 57343.125 -> 57343; -20 is below the floor
    assert row[4:].tolist() == [65535, 61439, 57343, 0]


def test_odd_vocabulary_is_padded():
    assert F.row_width(5) == 10 and F.row_width(4) == 8 and F.row_width(129280) == 129284


def test_round_trip_within_half_a_step(tmp_path):
    rng = np.random.default_rng(0)
    n_ctx, vocab, chunks = 16, 33, 2
    tokens = rng.integers(0, vocab, (chunks, n_ctx))
    rows = {c: rng.normal(0, 3, (n_ctx - 1 - n_ctx // 2, vocab)) for c in range(chunks)}
    path = F.write(tmp_path / "x.kld", tokens, vocab, lambda c: iter(rows[c]))
    lf = F.read(path)
    assert (lf.n_ctx, lf.n_vocab, lf.n_chunk) == (n_ctx, vocab, chunks)
    assert (lf.tokens == tokens).all()
    for c in range(chunks):
        for x, got in zip(rows[c], lf.rows(c)):
            want = x - np.log(np.exp(x).sum())                    # log-softmax in fp64
            keep = want > want.max() - 16
            step = 16 / 65535 if want.max() - want.min() > 16 else (want.max() - want.min()) / 65535
            assert np.abs(got[keep] - want[keep]).max() <= step / 2 + 1e-5


def test_file_size_follows_the_format(tmp_path):
    tokens = np.zeros((1, 8), np.int32)
    path = F.write(tmp_path / "x.kld", tokens, 3, lambda c: iter(np.zeros((3, 3))))
    # 20 header bytes + 8 tokens x 4 + 3 rows x (4 + 4) uint16
    assert path.stat().st_size == 20 + 32 + 3 * 8 * 2


def test_malformed_files_are_named(tmp_path):
    bad = tmp_path / "bad.kld"
    bad.write_bytes(b"not a logits file at all")
    with pytest.raises(F.LogitsFileError, match="not a llama.cpp logits file"):
        F.read(bad)
    good = F.write(tmp_path / "g.kld", np.zeros((2, 8), np.int32), 3, lambda c: iter(np.zeros((3, 3))))
    cut = tmp_path / "cut.kld"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(F.LogitsFileError, match="truncated"):
        F.read(cut)


def test_wrong_row_count_is_an_error_and_leaves_no_file(tmp_path):
    with pytest.raises(F.LogitsFileError, match="expected 3"):
        F.write(tmp_path / "x.kld", np.zeros((1, 8), np.int32), 3, lambda c: iter(np.zeros((2, 3))))
    assert not (tmp_path / "x.kld").exists()
