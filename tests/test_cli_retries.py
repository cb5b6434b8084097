"""Retries on the console, through a real fault proxy in front of a real `fidelity serve`:
each retry is shown once (not once by the command and again by Python's last-resort log
handler), and every retry a command makes is counted where its run is summarised --
needle's start-up requests and trials included."""
import json
import subprocess

import pytest

from fidelity.cli import main

from fault_proxy import FaultProxy
from needle_util import ROOT, fidelity_cmd, served


@pytest.fixture(scope="module")
def url():
    with served("golden") as (u,):
        yield u


def test_kld_shows_each_retry_once(url, tmp_path):
    with FaultProxy(url, {"/generate": ["500"]}) as px:
        p = subprocess.run(fidelity_cmd("kld", "--arm", "golden=golden", "--endpoint", f"e={px.url}",
                                        "--lengths", "250", "--depths", "50", "--decode-steps", "1", "--no-floors",
                                        "--n-boot", "50", "--retries", "2", "--out", str(tmp_path)),
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("POST /generate: HTTP 500") == 1, p.stderr
    assert "retries: e 1 (POST /generate 1)" in p.stdout


def test_needle_counts_startup_and_trial_retries(url, tmp_path, capsys):
    faults = {"/v1/models": ["500"], "/v1/chat/completions": ["502"]}
    with FaultProxy(url, faults) as px:
        rc = main(["needle", "--endpoint", f"golden={px.url}/v1", "--lengths", "300", "--depths", "0,100",
                   "--temperature", "0", "--max-tokens", "8", "--retries", "2", "--no-plots", "--quiet",
                   "--out", str(tmp_path), "--run-id", "r"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "retries: golden 2 (start-up 1, trials 1)" in out
    meta = json.loads((tmp_path / "needle" / "r" / "summary.json").read_text())["meta"]
    assert meta["retries"] == {"golden": {"startup": 1, "trials": 1}}


def test_needle_without_retries_prints_no_retry_line(url, tmp_path, capsys):
    rc = main(["needle", "--endpoint", f"golden={url}/v1", "--lengths", "300", "--depths", "0",
               "--max-tokens", "8", "--no-plots", "--quiet", "--out", str(tmp_path)])
    assert rc == 0 and "retries:" not in capsys.readouterr().out
