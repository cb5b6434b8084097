"""The layering of docs/architecture.md, checked on the source: no module imports a
package above its own, and no import circles but the documented one (kernel_toggles'
registry registers the built-in toggles on first use). Read with `ast`, lazy imports
inside functions included: a lazy import is still a dependency."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package -> the packages of ours it may import (besides itself)
ALLOWED = {
    "reference_model": set(),
    "infra": set(),
    "kernel_toggles": {"reference_model"},
    "needle": {"reference_model", "kernel_toggles", "infra"},
    "fidelity": {"reference_model", "kernel_toggles", "infra", "needle"},
    "training": {"reference_model", "kernel_toggles", "infra", "needle", "fidelity"},
}
# the one circle kept on purpose: the registry imports the built-ins on first use
REGISTRY_CIRCLE = {"kernel_toggles.registry", "kernel_toggles.builtin", "kernel_toggles.request",
                   "kernel_toggles.serving", "kernel_toggles.speculative", "kernel_toggles.v41",
                   "kernel_toggles.rope", "kernel_toggles.hisa", "kernel_toggles.moe",
                   "kernel_toggles.index_topk"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in ALLOWED:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> modules of ours it imports. `from pkg import sub` points at pkg.sub when
    that is a module (importing a submodule is not a dependency on the package's
    __init__ beyond the package itself being a package)."""
    mods = modules()
    edges = defaultdict(set)
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = subs if subs and len(subs) == len(node.names) else [mod, *subs]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
    return edges


def circles(edges) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def upward(edges) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs
                  if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]])


def test_no_package_imports_one_above_it():
    wrong = upward(import_graph())
    assert not wrong, "imports running up the layers:\n" + "\n".join(wrong)


def test_no_import_circles_but_the_registry():
    found = [c for c in circles(import_graph()) if not c <= REGISTRY_CIRCLE | {"kernel_toggles"}]
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in found)


def test_the_checker_finds_what_it_looks_for():
    """A checker that finds nothing proves nothing: a planted circle and upward import are
    found, and a real edge (the registry reads the seam's kernel names) is seen."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert upward({"needle.x": {"fidelity.y", "infra.z"}, "infra.z": {"reference_model.q"}}) == [
        "infra.z -> reference_model.q", "needle.x -> fidelity.y"]
    assert any(m.startswith("reference_model") for m in import_graph()["kernel_toggles.registry"])


def fidelity_package_graph(edges) -> dict[str, set[str]]:
    """fidelity's packages and loose modules (the first name under fidelity/) -> the others
    they import: the floors of docs/architecture.md's picture."""
    out = defaultdict(set)
    for a, bs in edges.items():
        if a.startswith("fidelity."):
            for b in bs:
                pa, pb = a.split(".")[1], b.split(".")[1] if b.startswith("fidelity.") else None
                if pb and pb != pa:
                    out[pa].add(pb)
    return out


def test_inside_fidelity_every_arrow_runs_down():
    """Issue 63: no import inside fidelity/ runs back up a floor. Floors exist, with every
    arrow pointing down, exactly when fidelity's packages import each other in no circle."""
    found = circles(fidelity_package_graph(import_graph()))
    assert not found, "fidelity packages importing each other:\n" + "\n".join(" <-> ".join(sorted(c)) for c in found)


def test_no_source_file_over_450_lines_and_few_loose_modules():
    """Issue 63's other two limits: no source file over 450 lines; at most five modules lie
    loose in fidelity/ (each with its reason in docs/architecture.md)."""
    long = [f"{p.relative_to(ROOT)}: {n}" for p in modules().values()
            if (n := len(p.read_text().splitlines())) > 450]
    assert not long, "files over 450 lines:\n" + "\n".join(long)
    loose = sorted(p.name for p in (ROOT / "fidelity").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 5, loose
