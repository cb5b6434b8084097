"""`fidelity engines`' twins (fidelity.engines.twins): each launched arm's in-process twin,
known from the spec before launch -- llama.cpp's from its flags or toggles, SGLang's from
its profiled defaults -- one per distinct arm, none without an in-process baseline. The end
to end judgement is in tests/test_engines_gpu_sharing.py (a served arm equal to its twin)."""
from fidelity.design.arms import parse_arm
from fidelity.engines.spec import load_spec
from fidelity.engines.twins import engine_twins, with_twin
from fidelity.llamacpp import flags as LF

SPEC = """
[engines.ref]
kind = "inprocess"
devices = "cpu"
[engines.llama]
kind = "llamacpp"
model = "/models/tiny.gguf"
port = 8080
[engines.sg]
kind = "sglang"
model = "/models/v4"
version = "0.5.23"
port = 8081
[engines.ext]
kind = "external"
url = "http://127.0.0.1:9/v1"
[[arms]]
name = "golden"
engine = "{base}"
[[arms]]
name = "llama"
engine = "llama"
[[arms]]
name = "llama-ub"
engine = "llama"
flags = ["-ub", "64"]
[[arms]]
name = "llama-q8"
engine = "llama"
flags = ["-ctk", "q8_0", "-ctv", "q8_0"]
[[arms]]
name = "sglang"
engine = "sg"
[[arms]]
name = "other"
engine = "ext"
"""


def _spec(tmp_path, base="ref"):
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(base=base))
    return load_spec(p)


def test_twins_of_launched_arms(tmp_path):
    twins = engine_twins(_spec(tmp_path), "v4")
    got = {t.name: (t.spelling, t.engines) for t in twins}
    assert got == {"twin-llama": (LF.scored_twin([]), ["llama", "llama-ub"]),      # -ub: no numerics toggle
                   "twin-llama-q8": (LF.scored_twin(["-ctk", "q8_0"]), ["llama-q8"]),
                   "twin-sglang": (parse_arm("engine:sglang").name, ["sglang"])}  # the external server: none
    assert with_twin(_spec(tmp_path), "v4") == {"llama", "llama-ub", "llama-q8", "sglang"}


def test_no_twin_without_an_inprocess_baseline(tmp_path):
    assert engine_twins(_spec(tmp_path, base="llama"), "v4") == []
