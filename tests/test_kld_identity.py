"""`fidelity kld` asks first whether a server serves this checkpoint's model (fidelity.kld.
identity): a real `fidelity serve` process serving another model under the same architecture
and tokenizer (the embedded checkpoint with its output head's rows shifted by one: every
prediction moves to a neighbouring token) is refused with exit 2 and the numbers, before any
arm is scored; the golden served over HTTP passes the probe. The bars themselves are checked
on hand-built distributions; their calibration on every toggle is bench/bench_identity.py."""
import shutil

import numpy as np
import pytest
import torch

from fidelity.cli import main
from fidelity.kld import identity as I
from fidelity.scores.bounds import Known
from fidelity.scores.dialects import PromptScores
from fidelity.weights.source import EMBEDDED

from checkpoint_util import rewrite_shards
from needle_util import served

ARGS = ["--lengths", "200", "--depths", "50", "--reps", "1", "--decode-steps", "1", "--no-floors", "--quiet"]


def _another_model(root):
    ck = root / "another"
    shutil.copytree(EMBEDDED, ck)
    rewrite_shards(ck, lambda n, t: {n: torch.roll(t, 1, 0) if n == "head.weight" else t})
    return ck


def test_a_server_of_another_model_is_refused_before_any_numerics_verdict(tmp_path, capsys):
    ck = _another_model(tmp_path)
    with served("golden", extra=("--checkpoint", str(ck))) as (other,), served("golden") as (same,):
        rc = main(["kld", "--arm", "golden=golden", "--endpoint", f"e={other}", *ARGS, "--out", str(tmp_path / "a")])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert "e does not serve the embedded checkpoint's model" in err and "no numerics verdict is made" in err
        assert not (tmp_path / "a" / "kld" / "scores" / "e").exists()          # nothing scored
        rc = main(["kld", "--arm", "golden=golden", "--endpoint", f"e={same}", *ARGS, "--out", str(tmp_path / "b")])
        assert rc == 0, capsys.readouterr().err


class _Fixed:
    """A scorer answering every position with one distribution over 4 ids."""
    kind = "endpoint"

    def __init__(self, logp):
        self.logp = np.log(np.asarray(logp, float))

    def score(self, ids, req):
        return PromptScores(list(ids), [Known(np.arange(4), self.logp) for _ in ids], [None] * len(ids), [None] * len(ids))


def test_the_bars_need_both_a_lost_top1_and_a_large_kl():
    base = _Fixed([0.7, 0.1, 0.1, 0.1])
    close = I.probe(base, _Fixed([0.6, 0.2, 0.1, 0.1]), list(range(8)))
    assert close["same_top1"] == 1.0 and not I.mismatch(close)
    flipped = I.probe(base, _Fixed([0.3, 0.5, 0.1, 0.1]), list(range(8)))   # top-1 lost, KL small
    kl = 0.7 * np.log(0.7 / 0.3) + 0.1 * np.log(0.1 / 0.5)
    assert np.isclose(flipped["kl_mean"], kl, rtol=1e-9) and flipped["same_top1"] == 0.0 and not I.mismatch(flipped)
    other = I.probe(base, _Fixed([0.001, 0.997, 0.001, 0.001]), list(range(8)))
    assert other["kl_mean"] > I.MISMATCH_KL and I.mismatch(other)


@pytest.mark.slow          # ~30 s on 2 cores: make test-slow (CI runs it)
def test_consistency_run_alone_refuses_a_server_of_another_model(tmp_path, capsys):
    """`fidelity consistency` has no kld baseline: given the checkpoint, the golden is built for
    the probe alone (or its --arm reference is used), and another model is exit 2 before any
    probe is sent. Without --checkpoint nothing is asked (it needs the tokenizer alone)."""
    ck = _another_model(tmp_path)
    args = ["--families", "prefix", "--probes", "1", "--quiet", "--checkpoint", str(EMBEDDED)]
    with served("golden", extra=("--checkpoint", str(ck))) as (other,), served("golden") as (same,):
        rc = main(["consistency", "--endpoint", f"e={other}", *args, "--out", str(tmp_path / "a")])
        err = capsys.readouterr().err
        assert rc == 2 and "e does not serve" in err and "answers as 'another'" in err, err
        assert not (tmp_path / "a" / "consistency" / "probes.jsonl").exists()    # nothing probed
        rc = main(["consistency", "--endpoint", f"e={same}", *args, "--out", str(tmp_path / "b")])
        assert rc in (0, 1) and "does not serve" not in capsys.readouterr().err
        rc = main(["consistency", "--endpoint", f"e={other}", *args[:-2], "--out", str(tmp_path / "c")])
        assert rc in (0, 1) and "does not serve" not in capsys.readouterr().err     # not asked
