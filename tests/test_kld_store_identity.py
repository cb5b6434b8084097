"""Stored kld scores are matched to the server by what it says it is, not by its URL: the
same `fidelity serve` arm relaunched on another port resumes; another arm under the old name
is refused, naming what changed (real server processes)."""
import pytest

from fidelity.kld.endpoint import Endpoint
from fidelity.kld.run import ScoredArm, check_identity
from fidelity.scores.store import ScoreStore
from needle_util import served


def _entry(url: str) -> ScoredArm:
    return ScoredArm("engine", Endpoint("engine", url).connect(), "arm")


def test_a_relaunch_on_another_port_resumes_and_another_arm_is_refused(tmp_path):
    store = ScoreStore(tmp_path)
    with served("golden") as (url,):
        first = _entry(url)
        assert first.scorer.describe()["server"]["serves"]["arm"] == "golden"
        check_identity(store, first)
    with served("golden") as (url2,):                     # relaunched (another free port), same arm
        check_identity(store, _entry(url2))
        assert url2.rsplit(":", 1)[1] in (tmp_path / "engine" / "arm.json").read_text()   # the new URL kept
    with served("wo_a_fp8") as (url3,):
        with pytest.raises(RuntimeError, match=r"another server or arm \(server: .*golden.*wo_a_fp8"):
            check_identity(store, _entry(url3))
