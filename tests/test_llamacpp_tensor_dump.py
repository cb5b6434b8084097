"""The tensor-dump record format (fidelity/llamacpp/tensor_dump.cpp writes it, tensor_dump.py
reads it), on records built here by hand: ggml's ne[0]-fastest order becomes the last numpy
axis, decode steps join on the token axis, and a name repeated within one graph is kept
apart."""
import struct

import numpy as np
import pytest

from fidelity.llamacpp.tensor_dump import DumpError, read


def _record(name: str, step: int, values: np.ndarray, ne: tuple) -> bytes:
    kind = 1 if values.dtype == np.int32 else 0
    head = struct.pack("<I", len(name)) + name.encode() + struct.pack("<II", step, kind) + struct.pack("<4q", *ne)
    return head + values.astype("<i4" if kind else "<f4").tobytes()


def test_orientation_steps_and_repeats(tmp_path):
    q0 = np.arange(6, dtype=np.float32)                 # ne = (3, 2): 2 tokens of 3 values
    q1 = np.arange(6, 9, dtype=np.float32)              # one more token, a decode step
    f = tmp_path / "d.bin"
    f.write_bytes(_record("q-0", 0, q0, (3, 2, 1, 1)) + _record("q-0", 0, -q0, (3, 2, 1, 1))
                  + _record("q-0", 1, q1, (3, 1, 1, 1)) + _record("top-1", 0, np.array([4, 7], np.int32), (2, 1, 1, 1)))
    d = read(f)
    assert d["q-0"].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert d["q-0#2"].tolist() == [[-0.0, -1, -2], [-3, -4, -5]]
    assert d["top-1"].dtype == np.int32 and d["top-1"].tolist() == [[4, 7]]


def test_truncated_record_is_named(tmp_path):
    f = tmp_path / "d.bin"
    f.write_bytes(_record("kv-3", 0, np.zeros(8, np.float32), (8, 1, 1, 1))[:-4])
    with pytest.raises(DumpError, match="kv-3"):
        read(f)
