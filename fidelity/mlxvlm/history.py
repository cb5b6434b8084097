"""mlx-vlm's history on the common frame (fidelity.history): its releases with DeepSeek-V4 (0.6.0
on) from PyPI, each installed into a venv of its own (scripts/install_mlx_vlm.sh), asked whether
it loads DeepSeek's own checkpoint unaided, served by our harness on its own Python, and scored
by `fidelity kld` against the golden and against the twin; adjacent releases compared against the
twin's floors and a change bisected to two neighbouring releases, where the two installed
packages' DeepSeek-V4 sources say whose change it is (the model code, its caches, the loader).

Every release is scored on the same weights (`f32` by default: the checkpoint dequantised once,
so a difference is mlx-vlm's arithmetic, not its loader) and against one twin: the route's twin
without HISA, since HISA never engages at the history's kld lengths (it takes more than
index_keep x index_block compressed entries; the needle, --needle-length, is where it shows)."""
from __future__ import annotations

import difflib
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from fidelity.history import engine_history
from fidelity.history.ledger import failure_reason
from .twin import twin

from . import convert, paths
from .server import ServerFailed, serving

FIRST = "0.6.0"                         # the first mlx-vlm release with models/deepseek_v4
SCRIPT = paths.HARNESS.parents[2] / "scripts" / "install_mlx_vlm.sh"
# what runs for DeepSeek-V4 in an installed mlx-vlm, by whose part it is
SOURCES = (("model", "mlx_vlm/models/deepseek_v4/"), ("cache", "mlx_vlm/models/cache.py"),
           ("loader", "mlx_vlm/utils.py"), ("loader", "mlx_vlm/fp8.py"))
LOAD_CHECK = ("import sys; from pathlib import Path; from mlx_vlm.utils import load_model; "
              "load_model(Path(sys.argv[1])); print('loaded')")


class ReleasesError(RuntimeError):
    pass


def version_key(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def parse_versions(text: str) -> list[str]:
    """PyPI's mlx-vlm releases with DeepSeek-V4, oldest first, from `pip index versions`."""
    line = next((ln for ln in text.splitlines() if ln.startswith("Available versions:")), "")
    got = [v.strip() for v in line.split(":", 1)[-1].split(",") if re.fullmatch(r"\d+(\.\d+)+", v.strip())]
    if not got:
        raise ReleasesError(f"pip listed no versions of mlx-vlm: {failure_reason(text)}")
    return sorted((v for v in got if version_key(v) >= version_key(FIRST)), key=version_key)


def available() -> list[str]:
    import sys
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "mlx-vlm"],
                       capture_output=True, text=True)
    return parse_versions(r.stdout + r.stderr)


@dataclass
class Settings(engine_history.Settings):
    """The common settings, and how every release is served: weights and route."""
    weights: str = "f32"
    route: str = "decode"
    needle_length: int = 0                # 0: none (through mlx-vlm, ~3 min a trial at 8K here)


def arm(version: str) -> str:
    return f"mlx-vlm-{version}"


class History(engine_history.EngineHistory):
    """mlx-vlm's history folder: the ledger, kld's score store, every release's logs."""
    ENGINE, UNIT = "mlx-vlm", "release"
    READY = (("installed", "install"),)
    AXIS = "mlx-vlm release (PyPI)"
    BISECT_HINT = "fidelity mlxvlm history --bisect A..B   # the first release that changes between two"
    SERVE_ERRORS = (ServerFailed,)

    def label(self, version: str) -> str:
        return arm(version)

    def order(self, keys) -> list:
        return sorted(keys, key=version_key)

    def ready(self, version: str) -> bool:
        got = self.ledger.get("installed", version)
        if got is None:
            got = self._install(version)
        if got["ok"] and self.ledger.get("native load", version) is None:
            self._native_load(version)
        return bool(got["ok"])

    def _install(self, version: str) -> dict:
        inst = paths.of(version)
        cached, start = inst.installed(), time.monotonic()
        log = self.out / "logs" / f"install-{version}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        if not cached:
            self.say(f"{arm(version)}: installing from PyPI into {inst.home} (once)")
            with open(log, "w") as f:
                rc = subprocess.run(["bash", str(SCRIPT), str(inst.home), version], stdout=f,
                                    stderr=subprocess.STDOUT).returncode
            if rc != 0 or not inst.installed():
                return self.ledger.add("installed", version, ok=False,
                                       reason="install: " + failure_reason(log.read_text(errors="replace")))
        mlx = subprocess.run([str(inst.python()), "-c", "import mlx.core as mx; print(mx.__version__)"],
                             capture_output=True, text=True).stdout.strip()
        return self.ledger.add("installed", version, ok=True, cached=cached, mlx=mlx,
                               seconds=round(time.monotonic() - start, 1))

    def _native_load(self, version: str) -> dict:
        """Whether the release's own loader loads DeepSeek's checkpoint as shipped (FP8 / FP4)."""
        self.say(f"{arm(version)}: loading DeepSeek's checkpoint with its own loader")
        r = subprocess.run([str(paths.of(version).python()), "-c", LOAD_CHECK,
                            str(convert.model_dir(self.ck, "native"))], capture_output=True, text=True)
        ok = r.returncode == 0 and "loaded" in r.stdout
        return self.ledger.add("native load", version, ok=ok,
                               reason="" if ok else _last_error(r.stderr))

    def serving(self, version: str, log: Path, ctx: int):
        return serving(self.ck, log, self.s.weights, self.s.route, arm(version), install=paths.of(version))

    def extra_args(self, version: str) -> list[str]:
        """One twin for every release (the module doc says why HISA is not in it)."""
        return ["--twin", f"{arm(version)}={twin(self.s.route)}"]

    def summary(self, version: str) -> dict:
        return {**super().summary(version), "native load": self.ledger.get("native load", version)}

    # -- the page ------------------------------------------------------------------------------
    def describe(self) -> str:
        s = self.s
        return (f"mlx-vlm releases from PyPI (mlx-cpu), each in a venv of its own, served by our harness on "
                f"its own Python ({s.weights} weights, route {s.route}); `fidelity kld` on {s.lengths} tokens "
                f"x 3 depths x {s.reps} (top-{s.top_k}) against the golden and against the twin "
                f"`{twin(s.route)}` (HISA does not engage at these lengths)"
                + (f"; needle at {s.needle_length} tokens." if s.needle_length else ".")
                + " `loads DeepSeek's checkpoint`: the release's own load_model on the checkpoint as DeepSeek ships it.")

    def row_columns(self, items: list[dict]) -> list[dict]:
        out = []
        for t in items:
            i, n = t["summary"]["installed"], t["summary"]["native load"]
            out.append({"mlx": (i or {}).get("mlx", ""),
                        "install": "" if not i or not i["ok"] else "cached" if i["cached"] else f"{i['seconds']:.0f} s",
                        "loads DeepSeek's checkpoint": "" if n is None else "yes" if n["ok"] else f"no: {n['reason']}"})
        return out

    def _load_changes_found(self) -> list[dict]:
        """The load bisections' results, one per change point (two bisections over nested spans
        find the same one)."""
        return list({tuple(r["change"]): r for r in self.ledger.all("load bisect") if r.get("change")}.values())

    def findings(self) -> list[str]:
        """Each release where DeepSeek's checkpoint stops (or starts) loading, bisected."""
        out = []
        for r in self._load_changes_found():
            c = self.ledger.get("cause", r["change"])
            what = f"; what changed: {c['words']}" if c and c.get("ok") else ""
            out.append(f"{r['sentence'][:1].upper()}{r['sentence'][1:]}{what}")
        return out

    def marks(self) -> list[tuple]:
        return [(*r["change"], "loader fails" if "stops" in r["sentence"] else "loader loads")
                for r in self._load_changes_found()]

    def load_changes(self, keys: list[str]) -> list[tuple[str, str]]:
        """Adjacent releases of `keys` whose own loader loads DeepSeek's checkpoint in one and not the other."""
        got = [(v, (self.ledger.get("native load", v) or {}).get("ok")) for v in self.order(keys)]
        got = [(v, ok) for v, ok in got if ok is not None]
        return [(a, b) for (a, x), (b, y) in zip(got, got[1:]) if x != y]

    def bisect_load(self, candidates: list[str], a: str, b: str) -> dict:
        """The first release after `a` whose own loader does on DeepSeek's checkpoint what b's
        does (fails or loads): installs and one load per probe, no scoring."""
        key = [a, b]
        got = self.ledger.get("load bisect", key)
        if got is not None:
            return got
        span = candidates[candidates.index(a):candidates.index(b) + 1]

        def loads(v: str) -> bool | None:
            if not self.ready(v):
                return None
            return self.ledger.get("native load", v)["ok"]
        want = loads(b)
        lo, hi, probed, _ = self._first_change(span, lambda v: loads(v) is not None, lambda v: loads(v) == want)
        before, after = span[lo], span[hi]
        why = (self.ledger.get("native load", after) or {}).get("reason") or ""
        verb = "stops loading" if not want else "loads"
        words = (f"DeepSeek's checkpoint {verb} with mlx-vlm's own loader at {arm(after)} ({arm(before)} -> "
                 f"{arm(after)}{': ' + why if why else ''})")
        return self.ledger.add("load bisect", key, ok=True, change=[before, after], adjacent=hi - lo == 1,
                               tested=self.order({a, b, *probed}), sentence=words)

    # -- at a change point ----------------------------------------------------------------
    def cause(self, a: str, b: str) -> dict:
        """Which of mlx-vlm's parts that run for DeepSeek-V4 changed between two installed
        releases (model code, caches, loader), with lines added and removed per file."""
        got = self.ledger.get("cause", [a, b])
        if got is not None:
            return got
        roots = {}
        for v in (a, b):
            site = _site_packages(paths.of(v))
            if site is None:
                return self.ledger.add("cause", [a, b], ok=False, reason=f"{arm(v)} is not installed")
            roots[v] = site
        files = source_diff(roots[a], roots[b])
        parts = sorted({f["part"] for f in files})
        who = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)
        return self.ledger.add("cause", [a, b], ok=True, files=files, who=who,
                               words=("; ".join(f"{f['path']} (+{f['added']} -{f['removed']})" for f in files)
                                      or "no source that runs for DeepSeek-V4 changed"))


def _last_error(stderr: str) -> str:
    """A traceback's last line (the exception), else failure_reason's line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    exc = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    return (exc[-1] if exc else failure_reason(stderr))[:300]


def _site_packages(inst: paths.Install) -> Path | None:
    if not inst.installed():
        return None
    return next(iter(sorted((inst.home / "lib").glob("python*/site-packages"))), None)


def source_diff(a: Path, b: Path) -> list[dict]:
    """The files of SOURCES that differ between two site-packages, with their part and the
    lines added / removed (a file only on one side counts whole)."""
    out = []
    for part, rel in SOURCES:
        names = sorted({p.relative_to(root).as_posix() for root in (a, b) for p in
                        ((root / rel).rglob("*.py") if rel.endswith("/") else [root / rel]) if p.is_file()})
        for name in names:
            x, y = (_lines(root / name) for root in (a, b))
            if x == y:
                continue
            d = list(difflib.unified_diff(x, y, lineterm="", n=0))
            out.append({"path": name, "part": part,
                        "added": sum(1 for ln in d if ln.startswith("+") and not ln.startswith("+++")),
                        "removed": sum(1 for ln in d if ln.startswith("-") and not ln.startswith("---"))})
    return out


def _lines(p: Path) -> list[str]:
    return p.read_text(errors="replace").splitlines() if p.is_file() else []
