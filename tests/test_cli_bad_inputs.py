"""Bad input a new user gives the commands (issue 37): each is one named error, exit 2,
before anything runs -- never a traceback, never a run that silently drops what was asked
for. An ab arm whose schedule cannot apply at the requested lengths; a checkpoint that is
a file or an empty folder; a tokenizer that is garbage, not a tokenizer, or missing."""
import pytest

from fidelity.cli import main


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ---- ab: an arm that cannot run at these lengths -------------------------------------------
@pytest.mark.parametrize("arm,lengths,named", [
    ("engine@prefix_hit(5000)", "250", "prefix_hit(5000)"),
    ("engine@decode_from(300)", "250,511", "decode_from(300)"),      # too long for one of them
    ("engine,wo_a_fp8@chunked(600)", "250,511", "chunked(600)"),     # no chunk boundary at all
])
def test_ab_arm_whose_schedule_cannot_apply_is_an_error_before_running(arm, lengths, named, capsys,
                                                                      tmp_path):
    rc = main(["ab", "--arm", arm, "--lengths", lengths, "--out", str(tmp_path)])
    err = _err(capsys)
    assert rc == 2, err
    assert "stage 1" not in err and not list(tmp_path.iterdir())        # nothing ran
    line = next(ln for ln in err.splitlines() if ln.startswith("error: "))
    assert arm.split("@")[0] in line and named in line and "250" in line


def test_ab_schedule_option_that_cannot_apply_is_an_error(capsys, tmp_path):
    rc = main(["ab", "--arm", "engine", "--schedule", "prefix_hit(400)", "--lengths", "250",
               "--out", str(tmp_path)])
    err = _err(capsys)
    assert rc == 2 and "prefix_hit(400)" in err and "250" in err


# ---- a checkpoint or tokenizer that is not one ---------------------------------------------
def test_ab_checkpoint_that_is_a_file_is_a_named_error(capsys, tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 64)
    assert main(["ab", "--checkpoint", str(f), "--out", str(tmp_path / "o")]) == 2
    err = _err(capsys)
    assert f"error: checkpoint {f} is a file" in err and "checkpoint folder" in err


def test_ab_checkpoint_that_is_an_empty_folder_is_a_named_error(capsys, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    assert main(["ab", "--checkpoint", str(d), "--out", str(tmp_path / "o")]) == 2
    err = _err(capsys)
    assert f"error: checkpoint {d} is not a usable checkpoint" in err and "no config.json" in err


def _no_specials_tokenizer(path):
    from tokenizers import Tokenizer, models
    path.write_text(Tokenizer(models.BPE()).to_str())
    return path


@pytest.mark.parametrize("kind,expect", [
    ("garbage", "not a tokenizer.json"),
    ("config", "not a tokenizer.json"),                 # JSON, but another file
    ("no-specials", "special token(s) missing"),        # a tokenizer, not DeepSeek-V4's
    ("missing", "tokenizer file not found"),
])
def test_serve_tokenizer_that_is_not_one_is_a_named_error(kind, expect, capsys, tmp_path):
    from fidelity.weights.source import EMBEDDED
    from needle_util import free_port
    path = {"garbage": tmp_path / "g.json", "config": EMBEDDED / "config.json",
            "no-specials": tmp_path / "t.json", "missing": tmp_path / "nope.json"}[kind]
    if kind == "garbage":
        path.write_bytes(b"\x00\xffnot json{{")
    if kind == "no-specials":
        _no_specials_tokenizer(path)
    assert main(["serve", "--tokenizer", str(path), "--port", str(free_port())]) == 2
    err = _err(capsys)
    assert err.startswith("error: ") and str(path) in err and expect in err


# ---- serve on a port already in use ----------------------------------------------------------
def test_serve_on_a_busy_port_says_so_before_announcing(tmp_path):
    import socket
    import subprocess

    from needle_util import ROOT, fidelity_cmd
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        p = subprocess.run(fidelity_cmd("serve", "--port", str(port)), cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "fidelity serve:" not in p.stderr     # never announced
    assert f"error: cannot listen on 127.0.0.1:{port}" in p.stderr and "--port" in p.stderr


# ---- endpoints that are not http(s) URLs -----------------------------------------------------
BAD_URLS = ["ftp://127.0.0.1:9", "127.0.0.1:9", "localhost:9/v1", "http://", "http://127.0.0.1:notaport"]


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("command", ["kld", "consistency", "chat-check", "needle"])
def test_endpoint_that_is_not_an_http_url_is_refused_at_once(command, url, capsys, tmp_path):
    """One shared check (infra.http.check_url) where the option is parsed: exit 2 naming the
    option and the URL, no request made (so no retries)."""
    endpoint = url if command == "chat-check" else f"a={url}"
    extra = {"kld": ["--arm", "golden=golden"]}.get(command, [])
    with pytest.raises(SystemExit) as ei:
        main([command, "--endpoint", endpoint, *extra, "--retries", "1", "--out", str(tmp_path)])
    err = _err(capsys)
    assert ei.value.code == 2
    assert "argument --endpoint" in err and repr(url) in err and "http:// or https:// URL" in err
    assert "retry" not in err


def test_check_url_accepts_http_and_https_and_hides_passwords():
    from infra.http import URLError, check_url
    for ok in ("http://127.0.0.1:30000", "https://api.example.com/v1", "http://[::1]:8000/v1"):
        assert check_url(ok) == ok
    with pytest.raises(URLError) as ei:
        check_url("ftp://user:s3cret@host/v1")
    assert "s3cret" not in str(ei.value)


def test_inspect_a_file_that_is_no_checkpoint_names_it(capsys, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    assert main(["inspect", str(f)]) == 2
    err = _err(capsys)
    assert f"error: {f} is a file" in err and "error: .:" not in err


def test_needle_inprocess_arm_whose_schedule_cannot_apply_is_an_error(capsys, tmp_path):
    """Needle prefills all but a prompt's last token under the schedule: prefix_hit(382) on
    383-token prompts cannot apply (it was a server_error on every trial, exit 0)."""
    rc = main(["needle", "--arm", "golden", "--arm", "engine@prefix_hit(382)", "--lengths", "383",
               "--depths", "0", "--no-plots", "--out", str(tmp_path)])
    err = _err(capsys)
    assert rc == 2 and "arm 'engine@prefix_hit(382)'" in err and "383 tokens" in err
    assert not (tmp_path / "needle" / "results.jsonl").exists()


def test_kld_inprocess_arm_whose_schedule_cannot_apply_is_an_error_before_scoring(capsys, tmp_path):
    rc = main(["kld", "--arm", "golden=golden", "--arm", "e=engine@prefix_hit(250)",
               "--lengths", "250", "--depths", "50", "--decode-steps", "1", "--no-floors", "--out", str(tmp_path)])
    err = _err(capsys)
    assert rc == 2 and "arm 'e'" in err and "250 tokens" in err and "prefix_hit(250)" in err
    assert not (tmp_path / "kld").exists()                  # nothing scored
