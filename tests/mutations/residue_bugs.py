"""Planted bugs that act only at some prompt-length residues, after vllm #55927 (a
needle's last digit wrong whenever the prompt length is 3 mod 4, pointed at the ratio-4
compressor's partial group). Load as a plugin (`fidelity ab --plugin
tests/mutations/residue_bugs.py --arm mut_ape_shift_len3 --lengths boundaries`);
tests/test_lengths_planted.py shows the boundary grid names them and what the default
grid sees (docs/lengths.md).

Each bug: the CSA compressors (ratio 4) of a prefill whose last piece ends at a length
of residue r mod 4 read the position bias `ape` one row off, as a kernel whose tail
path handles the partial group wrongly would. Decode steps (one token) are untouched, so
a prompt of any other residue is bit-identical to golden."""
from __future__ import annotations

from kernel_toggles import toggle

RESIDUES = {"mut_ape_shift_len3": 3, "mut_ape_shift_len1": 1}


def _planted(name: str, r: int):
    @toggle(name, kernel="compress_score_bias", category="known-bug", wraps=True,
            description=f"Planted: ratio-4 compressor's ape one row off when a prefill ends at "
                        f"a length {r} mod 4 (vllm #55927 shape)")
    def _(g, score, ape, positions, ratio):
        n = positions.numel()
        if ratio == 4 and n > 1 and (int(positions[-1]) + 1) % 4 == r:
            return g.compress_score_bias(score, ape, positions + 1, ratio)
        return g.compress_score_bias(score, ape, positions, ratio)


for _name, _r in RESIDUES.items():
    _planted(_name, _r)
