"""A server started with an API key (`fidelity serve --api-key-env VAR`, as vLLM's and
SGLang's --api-key) is reachable from every command that talks to servers when the key is in
the variable --api-key-env names (OPENAI_API_KEY by default), refused with one named error
(exit 2) without it, and the key is written into no output file (real server process)."""
import httpx
import pytest

from fidelity.cli import main
from needle_util import served

KEY = "sk-test-4f1c9e"
GRID = ("--lengths", "200", "--depths", "50", "--reps", "1", "--decode-steps", "2")


@pytest.fixture(scope="module")
def url():
    import os
    os.environ["DSV4_TEST_SERVE_KEY"] = KEY
    try:
        with served("golden", extra=("--api-key-env", "DSV4_TEST_SERVE_KEY")) as (u,):
            yield u
    finally:
        del os.environ["DSV4_TEST_SERVE_KEY"]


def test_the_server_wants_the_key_but_not_for_health(url):
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


COMMANDS = {
    "kld": lambda u: ["kld", "--arm", "golden=golden", "--endpoint", f"e={u}", *GRID, "--no-captures",
                      "--no-floors", "--no-twin"],
    "needle": lambda u: ["needle", "--endpoint", f"golden={u}/v1", "--lengths", "300", "--depths", "50",
                         "--max-tokens", "8", "--no-plots"],
    "consistency": lambda u: ["consistency", "--endpoint", f"e={u}", "--families", "prefix", "--probes", "1",
                              "--length", "200", "--max-tokens", "2"],
    "chat-check": lambda u: ["chat-check", "--endpoint", u],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_reaches_it_with_the_key_only(command, url, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    rc = main([*COMMANDS[command](url), "--retries", "1", "--out", str(tmp_path / "without"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "HTTP 401" in err and "--api-key-env" in err, err[-800:]
    assert "--model" not in err                     # a refused key is not a missing model name
    monkeypatch.setenv("MY_KEY", KEY)
    rc = main([*COMMANDS[command](url), "--api-key-env", "MY_KEY", "--out", str(tmp_path / "with"), "--quiet"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-800:]
    assert KEY not in out.out + out.err
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not [p for p in written if KEY.encode() in p.read_bytes()]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_api_key_variable_named_but_unset_is_named(command, url, tmp_path, monkeypatch, capsys):
    """--api-key-env VAR with VAR unset: the user meant a key to be sent; exit 2 naming VAR
    (it once went out without one and came back as a 401 that did not say why)."""
    monkeypatch.delenv("NOT_SET_KEY", raising=False)
    rc = main([*COMMANDS[command](url), "--api-key-env", "NOT_SET_KEY", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "--api-key-env NOT_SET_KEY: that environment variable is not set" in err, err[-800:]
    assert "HTTP 401" not in err


def test_engines_reaches_a_keyed_engine_through_its_api_key_env(tmp_path, monkeypatch):
    """`fidelity engines` with an engine launched with a key (`fidelity serve --api-key-env`):
    the engine's `api_key_env` carries it to kld and consistency; without it the run stops
    at the first request with the 401 named."""
    import subprocess
    from needle_util import ROOT, fidelity_cmd, free_port
    monkeypatch.setenv("DSV4_ENGINE_KEY", KEY)
    spec = """[run]
baseline = "golden"
tasks = ["kld", "consistency"]
out = "{out}"
[run.kld]
lengths = [200]
depths = [50]
steps = 2
n_boot = 200
[run.consistency]
families = ["prefix"]
probes = 1
length = 200
max_tokens = 2
[engines.fs]
kind = "fidelity"
port = {port}
stop_grace = 5
flags = ["--api-key-env", "DSV4_ENGINE_KEY"]
{key}
[[arms]]
name = "golden"
engine = "fs"
toggles = "golden"
"""
    for name, key in (("with", 'api_key_env = "DSV4_ENGINE_KEY"'), ("without", "")):
        p = tmp_path / f"{name}.toml"
        p.write_text(spec.format(out=tmp_path / name, port=free_port(), key=key))
        r = subprocess.run(fidelity_cmd("engines", "run", str(p)), cwd=ROOT, capture_output=True, text=True,
                           timeout=1800)
        if name == "with":
            assert r.returncode == 0, r.stderr[-2000:]
        else:
            assert r.returncode != 0 and "HTTP 401" in r.stderr, r.stderr[-2000:]
        assert KEY not in r.stdout + r.stderr
        assert not [f for f in (tmp_path / name).rglob("*") if f.is_file() and KEY.encode() in f.read_bytes()]
