"""User toggles reach the CLI through plugins: `--plugin FILE_OR_MODULE`,
$DSV4_FIDELITY_PLUGINS and the `dsv4_fidelity.toggles` entry-point group; every failure
exits 2 naming the plugin, with its traceback; loading a plugin twice is a no-op."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

import kernel_toggles as K
from kernel_toggles import plugins
from kernel_toggles.plugins import PluginError, load_plugins
from kernel_toggles.registry import unregister

ROOT = Path(__file__).resolve().parents[1]


def toggle_src(name, kernel="wo_a", category="known-bug", extra=""):
    """Plugin source registering `name`: a wo_a replacement scaling the output by 1.01."""
    cat = f", category={category!r}" if category else ""
    return textwrap.dedent(f"""\
        from kernel_toggles import toggle

        @toggle({name!r}, kernel={kernel!r}{cat})
        def _{name}(golden, o, w):
            \"\"\"Test plugin: wo_a output scaled by 1.01.\"\"\"
            return golden.wo_a(o, w) * 1.01
        """) + extra


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def cli(*argv, env=None, pythonpath=()):
    """`python -m fidelity.cli ...` in a fresh process (no inherited plugin env var)."""
    e = {k: v for k, v in os.environ.items() if k != plugins.PLUGINS_ENV_VAR}
    e.setdefault("OMP_NUM_THREADS", "1")
    if pythonpath:
        e["PYTHONPATH"] = os.pathsep.join([str(p) for p in pythonpath]
                                          + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "fidelity.cli", *argv], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def clean(monkeypatch):
    """Undo everything an in-process test loads: user toggles, the loaded-plugin memory and
    the plugin modules in sys.modules (so other tests see the plain registry)."""
    monkeypatch.delenv(plugins.PLUGINS_ENV_VAR, raising=False)
    names, loaded, mods = set(K.names()), set(plugins._LOADED), set(sys.modules)
    yield
    for n in set(K.names()) - names:
        unregister(n)
    plugins._LOADED.clear()
    plugins._LOADED.update(loaded)
    for m in set(sys.modules) - mods:
        if m.startswith(plugins._MODULE_PREFIX) or m.startswith("plug_"):
            del sys.modules[m]


# ---- (i)-(iv): the CLI sees plugin toggles -------------------------------------------------
def test_cli_plugin_file_lists_and_parses_the_toggle(tmp_path):
    f = write(tmp_path / "my_plugin.py", toggle_src("my_toggle"))
    r = cli("toggles", "--plugin", str(f))
    assert r.returncode == 0, r.stderr
    row = [ln for ln in r.stdout.splitlines() if ln.startswith("my_toggle")]
    assert len(row) == 1 and "known-bug" in row[0] and "wo_a" in row[0]
    r = cli("toggles", "--plugin", str(f), "--arm", "my_toggle")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "my_toggle"
    assert "my_toggle: replaces wo_a (known-bug)" in r.stdout
    r = cli("toggles", "--arm", "my_toggle")                   # without the plugin: unknown
    assert r.returncode == 2 and "unknown toggle 'my_toggle'" in r.stderr


def test_cli_env_var_and_dotted_module(tmp_path):
    f = write(tmp_path / "env_plugin.py", toggle_src("env_toggle"))
    moddir = tmp_path / "mods"
    moddir.mkdir()
    write(moddir / "plug_dotted.py", toggle_src("dotted_toggle", kernel="lm_head")
          .replace("wo_a(o, w) * 1.01", "lm_head(o, w)"))
    r = cli("toggles", env={plugins.PLUGINS_ENV_VAR: f"{f}{os.pathsep}plug_dotted"},
            pythonpath=[moddir])
    assert r.returncode == 0, r.stderr
    names = [ln.split()[0] for ln in r.stdout.splitlines()[1:] if ln.strip()]
    assert names[-2:] == ["env_toggle", "dotted_toggle"]       # registration (= load) order
    r = cli("toggles", "--plugin", "plug_dotted", "--arm", "dotted_toggle,my_t",
            env={plugins.PLUGINS_ENV_VAR: f" , {f}"}, pythonpath=[moddir])
    assert r.returncode == 2 and "unknown toggle 'my_t'" in r.stderr   # both loaded, my_t not
    r = cli("toggles", "--plugin", "plug_dotted", "--arm", "env_toggle,dotted_toggle",
            env={plugins.PLUGINS_ENV_VAR: str(f)}, pythonpath=[moddir])
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "env_toggle,dotted_toggle"


def fake_distribution(root: Path, entry_points: str):
    info = root / "fakepkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dsv4_fidelity.toggles]\n" + entry_points)


def test_cli_entry_points_module_and_callable(tmp_path):
    write(tmp_path / "my_plugin_mod.py", toggle_src("ep_toggle"))
    write(tmp_path / "my_ep_funcs.py", "def register():\n"
          + textwrap.indent(toggle_src("ep_callable_toggle", kernel="lm_head")
                            .replace("wo_a(o, w) * 1.01", "lm_head(o, w)"), "    "))
    fake_distribution(tmp_path, "mine = my_plugin_mod\nfn = my_ep_funcs:register\n")
    r = cli("toggles", pythonpath=[tmp_path])
    assert r.returncode == 0, r.stderr
    assert "ep_toggle " in r.stdout and "ep_callable_toggle " in r.stdout


def test_cli_broken_entry_point_names_it_and_its_distribution(tmp_path):
    write(tmp_path / "my_broken_mod.py", "raise ImportError('needs libfoo')\n")
    fake_distribution(tmp_path, "broken = my_broken_mod\n")
    r = cli("toggles", pythonpath=[tmp_path])
    assert r.returncode == 2
    assert "entry point 'broken' = my_broken_mod" in r.stderr and "fakepkg 0.1" in r.stderr
    assert "Traceback" in r.stderr and "needs libfoo" in r.stderr


def test_cli_ab_runs_a_plugin_arm(tmp_path):
    f = write(tmp_path / "my_plugin.py", toggle_src("my_toggle"))
    out = tmp_path / "reports"
    # 170 tokens: the needle template's minimum prompt is 161 tokens (48 is refused)
    r = cli("ab", "--plugin", str(f), "--arm", "my_toggle", "--lengths", "170",
            "--reps", "1", "--decode-steps", "1", "--shapley-top", "0",
            "--n-boot", "20", "--out", str(out), "--run-id", "r")
    assert r.returncode == 1, r.stderr                       # flagged: the verdict names my_toggle
    summary = pd.read_csv(out / "r" / "summary.csv").set_index("arm")
    assert "my_toggle" in summary.index
    assert summary.loc["my_toggle", "kld_mean"] > 0          # the 1.01 scaling changed logits


# ---- (v): bad plugins exit 2 and say why ----------------------------------------------------
def test_cli_plugin_raising_at_import(tmp_path):
    f = write(tmp_path / "raising_plugin.py", "x = 1\nraise RuntimeError('boom in plugin')\n")
    r = cli("toggles", "--plugin", str(f))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: plugin ")
    assert str(f) in r.stderr and "(from --plugin)" in r.stderr
    assert "Traceback (most recent call last)" in r.stderr
    assert f'File "{f}", line 2' in r.stderr and "RuntimeError: boom in plugin" in r.stderr


def run_main(argv, capsys):
    from fidelity.cli import main
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_missing_file(tmp_path, capsys, monkeypatch, clean):
    missing = tmp_path / "nope.py"
    rc, out, err = run_main(["toggles", "--plugin", str(missing)], capsys)
    assert rc == 2 and out == ""
    assert err == f"error: plugin '{missing}' (from --plugin): no such file: {missing}\n"
    monkeypatch.setenv(plugins.PLUGINS_ENV_VAR, str(missing))
    with pytest.raises(PluginError, match=r"\(from \$DSV4_FIDELITY_PLUGINS\): no such file"):
        load_plugins()
    with pytest.raises(PluginError, match="not a Python file"):
        load_plugins([str(write(tmp_path / "notes.txt", "x"))], environ={})


def test_clash_with_builtin(tmp_path, capsys, clean):
    f = write(tmp_path / "clash.py", toggle_src("kv_bf16"))
    rc, _, err = run_main(["toggles", "--plugin", str(f)], capsys)
    assert rc == 2 and str(f) in err
    assert "ToggleError: toggle 'kv_bf16' clashes with the built-in toggle" in err
    assert "Traceback" in err
    assert K.get("kv_bf16").builtin                            # the built-in is untouched


def test_missing_category(tmp_path, capsys, clean):
    f = write(tmp_path / "nocat.py", toggle_src("no_category_toggle", category=None))
    rc, _, err = run_main(["toggles", "--plugin", str(f)], capsys)
    assert rc == 2 and str(f) in err and "give category= explicitly" in err
    assert "no_category_toggle" not in K.names()


def test_two_toggles_on_one_kernel_refused_in_an_arm(tmp_path, capsys, clean):
    f = write(tmp_path / "two.py", toggle_src("wo_a_first") + toggle_src("wo_a_second")
              .replace("from kernel_toggles import toggle\n", ""))
    rc, out, err = run_main(["toggles", "--plugin", str(f)], capsys)
    assert rc == 0 and "wo_a_first" in out and "wo_a_second" in out
    rc, out, err = run_main(["toggles", "--plugin", str(f), "--arm", "wo_a_first,wo_a_second"],
                            capsys)
    assert rc == 2 and out == ""
    assert "wo_a_first" in err and "wo_a_second" in err and "kernel wo_a" in err


# ---- (vi): in-process semantics ---------------------------------------------------------------
def test_loading_twice_is_a_no_op_and_the_toggle_works(tmp_path, clean):
    f = write(tmp_path / "twice.py", toggle_src("twice_toggle"))
    first = load_plugins([str(f)], environ={})
    assert first == [f"'{f}' (from --plugin)"]
    order = K.get("twice_toggle").order
    other_spelling = f"{tmp_path}/./twice.py"                  # same file after resolving
    assert load_plugins([str(f), other_spelling], environ={}) == [
        first[0], f"'{other_spelling}' (from --plugin)"]
    assert K.names().count("twice_toggle") == 1 and K.get("twice_toggle").order == order
    mods = [m for m in sys.modules if m.startswith(plugins._MODULE_PREFIX + "twice_")]
    assert len(mods) == 1 and sys.modules[mods[0]].__file__ == str(f)
    nx = K.ToggleSet.parse("twice_toggle").numerics()
    g = torch.Generator().manual_seed(0)
    o, w = torch.randn(3, 2, 8, generator=g).double(), torch.randn(2, 4, 8, generator=g).double()
    gold = K.golden().numerics().wo_a(o, w)
    assert torch.allclose(nx.wo_a(o, w), gold * 1.01)


def test_same_module_as_file_and_as_dotted_name_loads_once(tmp_path, monkeypatch, clean):
    monkeypatch.syspath_prepend(str(tmp_path))
    a = write(tmp_path / "plug_alias_a.py", toggle_src("alias_a"))
    load_plugins([str(a)], environ={})
    load_plugins(["plug_alias_a"], environ={})                 # file first, then dotted: no-op
    b = write(tmp_path / "plug_alias_b.py", toggle_src("alias_b"))
    load_plugins(["plug_alias_b"], environ={})
    load_plugins([str(b)], environ={})                         # dotted first, then file: no-op
    assert K.names().count("alias_a") == 1 and K.names().count("alias_b") == 1


def test_load_order_env_then_specs(tmp_path, clean):
    x = write(tmp_path / "order_x.py", toggle_src("order_x"))
    y = write(tmp_path / "order_y.py", toggle_src("order_y"))
    z = write(tmp_path / "order_z.py", toggle_src("order_z"))
    labels = load_plugins([str(x)], environ={plugins.PLUGINS_ENV_VAR: f"{y},{z}"})
    assert labels == [f"'{y}' (from $DSV4_FIDELITY_PLUGINS)",
                      f"'{z}' (from $DSV4_FIDELITY_PLUGINS)", f"'{x}' (from --plugin)"]
    assert K.names()[-3:] == ["order_y", "order_z", "order_x"]


def test_failed_plugin_leaves_no_toggles_and_can_be_retried(tmp_path, clean):
    f = write(tmp_path / "half.py", toggle_src("half_toggle") + "raise ValueError('late')\n")
    with pytest.raises(PluginError) as e:
        load_plugins([str(f)], environ={})
    assert str(e.value).startswith(f"plugin '{f}' (from --plugin) failed to load: ValueError: late")
    assert "half_toggle" not in K.names()
    write(f, toggle_src("half_toggle"))                        # fixed: loads on the next call
    load_plugins([str(f)], environ={})
    assert "half_toggle" in K.names()


def test_entry_point_callable_runs_once_per_process(tmp_path, monkeypatch, clean):
    write(tmp_path / "plug_ep_once.py", "CALLS = []\n\ndef register():\n    CALLS.append(1)\n"
          + textwrap.indent(toggle_src("ep_once_toggle"), "    "))
    fake_distribution(tmp_path, "once = plug_ep_once:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    label = ("entry point 'once' = plug_ep_once:register "
             "(group dsv4_fidelity.toggles, distribution fakepkg 0.1)")
    assert load_plugins(environ={}) == [label]
    assert load_plugins(environ={}) == [label]                 # no "already registered"
    assert sys.modules["plug_ep_once"].CALLS == [1]
    assert K.get("ep_once_toggle").category == "known-bug"
