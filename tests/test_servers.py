"""The engine house (fidelity/servers/): one module per engine behind one registry, the
files docs/architecture.md says a new engine touches, and how many branches on an
engine's name are left outside it (counted on the source, so a new one shows here)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fidelity import servers
from fidelity.servers import Found, Generation

ROOT = Path(__file__).resolve().parents[1]
NAMES = "|".join(["sglang", "vllm", "llamacpp", "llama.cpp", "openai", "fidelity"])
BRANCH = re.compile(rf"""(==|!=)\s*["']({NAMES})["']|\bin\s*\(\s*["']({NAMES})["']""")
BRANCHES_LEFT = 1     # outside fidelity/servers/: `fidelity toggles --engine fidelity` refusing toggles (34 in 8 files before)


def branches_outside() -> list[str]:
    out = []
    for f in sorted((ROOT / "fidelity").rglob("*.py")):
        if "servers" in f.relative_to(ROOT).parts:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if BRANCH.search(line.split("#", 1)[0]):
                out.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    return out


def test_engine_name_branches_live_in_the_engine_modules():
    left = branches_outside()
    assert len(left) <= BRANCHES_LEFT, "branches on an engine's name outside fidelity/servers/:\n" + "\n".join(left)


def documented_files() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- new-engine-files:start -->", 1)[1].split("<!-- new-engine-files:end -->", 1)[0]
    return re.findall(r"^- `([^`]+)`", block, flags=re.M)


def test_a_new_engines_files_are_the_documented_ones():
    """Each registered engine has exactly the documented pieces: its own module, its
    registry entry, its profile entries when it is profiled, its wire fixture's test."""
    assert documented_files() == ["fidelity/servers/<engine>.py", "fidelity/servers/__init__.py",
                                  "kernel_toggles/engine_profiles.json", "tests/test_kld_dialects.py"]
    registry = (ROOT / "fidelity/servers/__init__.py").read_text()
    profiles = json.loads((ROOT / "kernel_toggles/engine_profiles.json").read_text())
    fixtures = (ROOT / "tests/test_kld_dialects.py").read_text() + (ROOT / "tests/test_kld_nonfinite.py").read_text()
    for name, server in servers.REGISTRY.items():
        module = type(server).__module__.rsplit(".", 1)[-1]
        assert (ROOT / "fidelity/servers" / f"{module}.py").is_file()
        assert f"{type(server).__name__}()" in registry
        if server.profiled:
            assert name in json.dumps(profiles), f"{name} is profiled but has no profile entries"
        if server.wire:
            assert f"fidelity.servers.{module} import" in fixtures, f"{name}: no wire fixture parsed in the tests"


def test_detection_order_and_fallback():
    assert servers.detect(Found(model_info={"x": 1}, version="0.9")) == "sglang"
    assert servers.detect(Found(version={"version": "0.9"})) == "vllm"
    assert servers.detect(Found(llama_server=True)) == "llamacpp"
    assert servers.detect(Found(props={"engine": "mlx-vlm", "route": "decode"})) == "mlxvlm"
    assert servers.detect(Found(props={"engine": "other"})) == "openai"
    assert servers.detect(Found()) == "openai"
    assert servers.DIALECTS == ("sglang", "vllm", "llamacpp", "mlxvlm", "openai")
    assert set(servers.launchable()) == {"sglang", "vllm", "llamacpp", "mlxvlm", "fidelity"}
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        servers.get("tgi")
    assert servers.find("vllm") is servers.REGISTRY["vllm"]
    assert servers.find("external") is None and servers.find("inprocess") is None and servers.find(None) is None


def test_generation_requests_in_each_dialect():
    """What a consistency probe sends, engine by engine (one body each, fields by hand)."""
    class Ep:
        model, dialect = "m", None

        def piece_ids(self):
            return {"a": 1}
    g = Generation(max_tokens=3, k=2, seed=7)
    path, body, _ = servers.get("sglang").generation([1, 2], g, Ep())
    assert path == "/generate" and body["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.0,
                                                               "ignore_eos": True, "sampling_seed": 7}
    path, body, _ = servers.get("vllm").generation([1, 2], g, Ep())
    assert path == "/v1/completions" and body["return_tokens_as_token_ids"] and body["seed"] == 7
    path, body, _ = servers.get("openai").generation([1, 2], g, Ep())
    assert "ignore_eos" not in body and "return_tokens_as_token_ids" not in body and body["model"] == "m"
    path, body, _ = servers.get("llamacpp").generation([1, 2], g, Ep())
    assert path == "/completion" and "id_slot" not in body and body["n_probs"] == 2
    path, body, _ = servers.get("mlxvlm").generation([1, 2], g, Ep())
    assert path == "/v1/completions" and body["prompt"] == [1, 2] and body["logprobs"] == 2 and body["ignore_eos"]
    assert [s.takes_ignore_eos for s in map(servers.get, servers.DIALECTS)] == [True, True, True, True, False]


def test_twins_of_endpoints_come_from_their_engine():
    class Ep:
        def __init__(self, dialect, info=None, llama=False):
            self.dialect, self.info, self.llama_server, self.model = dialect, info or {}, llama, "m"
    assert servers.served_as(Ep("sglang")).twin_of_endpoint(Ep("sglang"))[0] == "engine:sglang"
    own = Ep("sglang", {"server_info": {"engine": "fidelity serve", "arms": {"m": {"arm": "fp8-kv"}}}})
    assert servers.served_as(own).name == "fidelity" and servers.served_as(own).twin_of_endpoint(own)[0] == "fp8-kv"
    assert servers.served_as(Ep("openai", llama=True)).name == "llamacpp"
    assert servers.served_as(Ep("openai")).twin_of_endpoint(Ep("openai")) is None
    # mlx-vlm: the exact profile, computed in the calls its route makes
    # mlx-vlm: the exact profile with its HISA setting, computed in the calls its route makes
    hisa = {"index_topk": 8, "index_block": 64, "index_keep": 16}
    mlx = lambda route, h=hisa: Ep("mlxvlm", {"props": {"route": route, "hisa": h}})  # noqa: E731
    twin = lambda ep: servers.served_as(ep).twin_of_endpoint(ep)[0]  # noqa: E731
    assert twin(mlx("decode")) == "exact:hisa(block=64,keep=16)@decode_from(1)"
    assert twin(mlx("prefill")) == "exact:hisa(block=64,keep=16)"
    assert twin(mlx("chunked:64", {**hisa, "index_block": 0})) == "exact:@chunked(64)"   # HISA off
