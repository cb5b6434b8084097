"""Shared by the kernel tests (test_kernels*.py, test_v41_kernels*.py): the numerics under
test and bf16 helpers written here, independent of the code under test."""
from __future__ import annotations

import pytest
import torch

from reference_model.numerics import Numerics

F64 = torch.float64
EXACT = Numerics("exact", torch.float64)    # no rounding, no quantisation
REF = Numerics("reference")                 # bf16 storage, fp64 compute
REF32 = Numerics("reference", torch.float32)
ALL = [pytest.param(EXACT, id="exact64"), pytest.param(REF, id="reference"),
       pytest.param(REF32, id="reference-fp32")]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def bf(x):
    """bf16-representable values held in fp64 (what a bf16 tensor holds)."""
    return x.to(torch.bfloat16).to(F64)


def bf16_round(v: float) -> float:
    """A Python float rounded to bf16 (round to nearest even)."""
    return torch.tensor(v, dtype=F64).to(torch.bfloat16).item()


def is_bf16(t):
    """Does t hold only bf16-representable values?"""
    return torch.equal(t, t.to(torch.bfloat16).to(t.dtype))


def assert_bf16_close(y, ref):
    """A bf16 result within one bf16 rounding of the fp64 reference (rel 2^-8, abs 1e-6)."""
    assert is_bf16(y.double())
    assert ((y.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6).all()
