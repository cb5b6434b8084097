"""V4.1 weights: the one in-memory form and seeded random weights of reference_model/weights.py
(the config picks the V4.1 tensor table and grids), and the Engram tables kept in checkpoint
form (v41/engram_table.py). Names kept for V4.1 callers."""
from __future__ import annotations

from ..weights import InMemoryWeights, random_weights, to_grid
from .engram_table import ROW_BLOCK, EngramTable, encode_rows

V41Weights = InMemoryWeights

__all__ = ["ROW_BLOCK", "EngramTable", "InMemoryWeights", "V41Weights", "encode_rows", "random_weights",
           "to_grid"]
