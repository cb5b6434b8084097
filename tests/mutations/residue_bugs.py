"""Planted bugs that act only at some prompt lengths, after vllm #55927 (a needle's last
digit wrong whenever the prompt length is 3 mod 4, pointed at the ratio-4 compressor's
partial group). Load as a plugin (`fidelity ab --plugin tests/mutations/residue_bugs.py
--arm mut_ape_shift_len3 --lengths boundaries`); tests/test_lengths_planted.py shows the
boundary grid names them, what the default grid sees, and that the lengths the verdict
suggests tell the config's periods apart (docs/lengths.md).

Each bug: the CSA compressors (ratio 4) of a prefill whose last piece ends at a length
the bug's condition holds for read the position bias `ape` one row off, as a kernel whose
tail path handles a partial group wrongly would. Conditions: a residue mod 4 (len3, len1),
a multiple of another of the config's periods (mult32: the tiny model's window; mult128:
its larger ratio) and one length only (at384, which is 0 mod 4, 32, 64 and 128 at once).
Decode steps (one token) are untouched, so a prompt the condition misses is
bit-identical to golden."""
from __future__ import annotations

from kernel_toggles import toggle

# name -> (period, residue): acts when the prefill's length is `residue` mod `period`
RESIDUES = {"mut_ape_shift_len3": (4, 3), "mut_ape_shift_len1": (4, 1),
            "mut_ape_shift_mult32": (32, 0), "mut_ape_shift_mult128": (128, 0)}
AT = {"mut_ape_shift_at384": 384}            # name -> the one length it acts at


def _planted(name: str, when, what: str):
    @toggle(name, kernel="compress_score_bias", category="known-bug", wraps=True,
            description=f"Planted: ratio-4 compressor's ape one row off when a prefill ends at "
                        f"{what} (vllm #55927 shape)")
    def _(g, score, ape, positions, ratio):
        n = positions.numel()
        if ratio == 4 and n > 1 and when(int(positions[-1]) + 1):
            return g.compress_score_bias(score, ape, positions + 1, ratio)
        return g.compress_score_bias(score, ape, positions, ratio)


for _name, (_p, _r) in RESIDUES.items():
    _planted(_name, lambda n, p=_p, r=_r: n % p == r, f"a length {_r} mod {_p}")
for _name, _n in AT.items():
    _planted(_name, lambda n, at=_n: n == at, f"length {_n} only")
