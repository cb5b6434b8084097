"""`fidelity llamacpp kld-base` without a llama.cpp build: the golden's logits file for
llama-perplexity, and the same file read back and scored against the golden, which must
find nothing but the file's 16-bit rounding; bad files are named errors."""
import json

from fidelity.cli import main
from fidelity.llamacpp import logits_file as F


def test_golden_file_written_then_scored_against_the_golden_is_zero(tmp_path, capsys):
    out = tmp_path / "golden.kld"
    assert main(["llamacpp", "kld-base", "--checkpoint", "tiny-needle-v2", "--ctx", "64", "--chunks", "2",
                 "--out", str(out), "--threads", "1"]) == 0
    lf = F.read(out)
    assert (lf.n_ctx, lf.n_chunk, lf.n_vocab) == (64, 2, 512)
    capsys.readouterr()
    assert main(["llamacpp", "kld-base", "--checkpoint", "tiny-needle-v2", "--compare", str(out),
                 "--threads", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["positions"] == 2 * (64 - 1 - 32) and res["same_top1"] == 1.0
    assert abs(res["kld_mean"]) < 1e-6 and res["kld_max"] < 1e-5


def test_missing_and_foreign_files_are_named(tmp_path, capsys):
    assert main(["llamacpp", "kld-base", "--compare", str(tmp_path / "none.kld")]) == 2
    assert "cannot read" in capsys.readouterr().err
    junk = tmp_path / "junk.kld"
    junk.write_bytes(b"GGUF" + bytes(100))
    assert main(["llamacpp", "kld-base", "--compare", str(junk)]) == 2
    assert "not a llama.cpp logits file" in capsys.readouterr().err


def test_the_build_script_pins_the_version_paths_expects():
    """scripts/build_llama_cpp.sh builds the version fidelity.llamacpp.paths requires, into the
    per-user cache folder named by it."""
    import re
    from pathlib import Path
    from fidelity.llamacpp import paths
    script = (Path(__file__).resolve().parents[1] / "scripts" / "build_llama_cpp.sh").read_text()
    assert f'PINNED_VERSION="{paths.PINNED.split("==")[1]}"' in script
    assert re.fullmatch(r"llama\.cpp-b\d+", paths.BUILD_NAME) and paths.BUILD_NAME[len("llama.cpp-b"):] in paths.PINNED
