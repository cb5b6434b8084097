"""`fidelity serve`: the reference model under one arm as a stand-in engine. It speaks
SGLang's dialect (so it is read as `sglang`) and states the arm it serves in
/get_server_info, which is its twin; launched as `fidelity serve` with the arm in
DSV4_FIDELITY_ARM."""
from __future__ import annotations

import sys

from .sglang import SGLang

ENGINE = "fidelity serve"         # /get_server_info's `engine`


class FidelityServe(SGLang):
    name = "fidelity"
    wire = False                  # read through the sglang dialect
    profiled = False
    launch_needs = ""
    ready_poll = 0.2                      # starts in seconds: poll often

    def claims(self, found):
        return False

    def check(self, e, where):
        return None

    def twin_of_endpoint(self, ep):
        info = getattr(ep, "info", None) or {}
        si = info.get("server_info") or {}
        served = (si.get("arms") or {}).get(getattr(ep, "model", None))
        if si.get("engine") != ENGINE or not served:
            return None
        profile = served.get("profile") or "reference"
        arm = served.get("arm") or "golden"
        return (arm if profile == "reference" or arm.startswith(f"{profile}:") else f"{profile}:{arm}",
                "the arm fidelity serve states it serves")

    def twin_of_arm(self, e, arm):
        return (str(arm.toggles) or "golden", "the arm's toggles") if arm.toggles is not None else None

    def command(self, e):
        python = sys.executable if e.python == "python3" else e.python   # python3: this interpreter
        cmd = [python, "-m", "fidelity.cli", "serve", "--host", e.host, "--port", str(e.port)]
        return cmd + (["--checkpoint", e.model] if e.model else [])

    def numerics(self, arm, e, env, flags, notes):
        env["DSV4_FIDELITY_ARM"] = str(arm.toggles) if arm.toggles is not None else "golden"

    def output_flags(self, captures, max_logprobs):
        return ["--max-logprobs", str(max_logprobs)] if max_logprobs is not None else []
