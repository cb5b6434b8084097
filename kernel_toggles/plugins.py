"""Loading user toggles into the registry before a command runs.

A user toggle is registered when the module defining it (`@kernel_toggles.toggle`) is
imported, but nothing imports a user's module on its own, so `fidelity ab --arm my_toggle`
would say "unknown toggle". `load_plugins` imports those modules, from three sources in
this order:

1. entry points in the group `dsv4_fidelity.toggles` of installed distributions
   (`[project.entry-points."dsv4_fidelity.toggles"] mine = "my_pkg.toggles"`); if the
   loaded object is a callable rather than a module, it is called with no arguments;
2. `$DSV4_FIDELITY_PLUGINS`: items separated by "," or os.pathsep;
3. the `specs` argument (`--plugin`, repeatable).

An item is a path to a .py file (anything ending in .py or containing a path separator)
or a dotted module name. Each plugin is loaded once per process: loading it again is a
no-op, so toggles are never registered twice. Any failure raises PluginError naming the
plugin, where it came from and the underlying traceback, and the toggles it registered
before failing are removed again so that a corrected retry starts clean."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
import types
from pathlib import Path
from typing import Callable, Iterable, Mapping

from . import registry

ENTRY_POINT_GROUP = "dsv4_fidelity.toggles"
PLUGINS_ENV_VAR = "DSV4_FIDELITY_PLUGINS"
_MODULE_PREFIX = "_dsv4_fidelity_plugin_"

# keys of plugins already loaded in this process: ('file', resolved path),
# ('module', dotted name) or ('entry_point', name, value)
_LOADED: set[tuple] = set()


class PluginError(ValueError):
    """A toggle plugin could not be found, imported or registered; the message names the
    plugin and its source so the user knows which file or package to fix."""


def load_plugins(specs: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> list[str]:
    """Import every toggle plugin: entry points, then $DSV4_FIDELITY_PLUGINS, then `specs`.

    Returns one label per plugin covered by this call (including plugins that an earlier
    call already loaded, which are not imported again), in load order. Raises PluginError
    on the first plugin that fails."""
    env = os.environ if environ is None else environ
    labels: list[str] = []
    for ep in _entry_points():
        dist = getattr(ep, "dist", None)
        where = f"group {ENTRY_POINT_GROUP}" + (
            f", distribution {dist.name} {dist.version}" if dist is not None else "")
        label = f"entry point {ep.name!r} = {ep.value} ({where})"
        _once(("entry_point", ep.name, ep.value), label, lambda ep=ep: _load_entry_point(ep))
        labels.append(label)
    env_items = [s.strip() for s in re.split("[," + re.escape(os.pathsep) + "]",
                                             env.get(PLUGINS_ENV_VAR, ""))]
    for source, items in ((f"${PLUGINS_ENV_VAR}", env_items), ("--plugin", list(specs))):
        for item in items:
            if not item:
                continue
            labels.append(_load_item(item, source))
    return labels


def _entry_points():
    from importlib.metadata import entry_points
    seen, out = set(), []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if (ep.name, ep.value) not in seen:          # same dist visible twice on sys.path
            seen.add((ep.name, ep.value))
            out.append(ep)
    return out


def _load_entry_point(ep) -> None:
    obj = ep.load()
    if callable(obj) and not isinstance(obj, types.ModuleType):
        obj()


def _is_path(item: str) -> bool:
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return item.endswith(".py") or any(s in item for s in seps)


def _load_item(item: str, source: str) -> str:
    label = f"{item!r} (from {source})"
    if not _is_path(item):
        origin = _module_origin(item)
        if origin is not None and ("file", origin) in _LOADED:   # already loaded as a file
            return label
        _once(("module", item), label, lambda: importlib.import_module(item))
        return label
    path = Path(item).expanduser()
    try:
        path = path.resolve()
    except OSError:
        pass
    if not path.is_file():
        raise PluginError(f"plugin {label}: " + ("not a file" if path.exists() else "no such file")
                          + f": {path}")
    if path.suffix != ".py":
        raise PluginError(f"plugin {label}: not a Python file (.py): {path}")
    if _imported_from(path):                       # e.g. imported already as a dotted module
        _LOADED.add(("file", str(path)))
        return label
    _once(("file", str(path)), label, lambda: _exec_file(path))
    return label


def _module_name_for(path: Path) -> str:
    """Stable and unique per file: the same file always gets the same module name (so
    pickling and re-imports agree), two files with the same stem never collide."""
    stem = re.sub(r"\W", "_", path.stem)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    return f"{_MODULE_PREFIX}{stem}_{digest}"


def _exec_file(path: Path) -> None:
    name = _module_name_for(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot build an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def _module_origin(name: str) -> str | None:
    """Resolved source file of a dotted module without importing it (None if unknown)."""
    if name in sys.modules:
        f = getattr(sys.modules[name], "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(name)
        except Exception:        # a failing parent package: import_module reports it below
            return None
        f = spec.origin if spec is not None and spec.has_location else None
    try:
        return str(Path(f).resolve()) if f else None
    except OSError:
        return None


def _imported_from(path: Path) -> bool:
    """Whether some already imported module was loaded from `path` (so executing the file
    again would register its toggles a second time)."""
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and f.endswith(path.name):
            try:
                if Path(f).resolve() == path:
                    return True
            except OSError:
                continue
    return False


def _is_machinery(filename: str) -> bool:
    return (filename == __file__ or filename.startswith("<frozen importlib")
            or filename.startswith(os.path.dirname(importlib.__file__) + os.sep))


def _user_frames(tb):
    """The traceback from the first frame outside this loader and importlib, so the report
    starts in the plugin's own code (unchanged if every frame is loader machinery, e.g. a
    plugin module that does not exist)."""
    t = tb
    while t is not None and _is_machinery(t.tb_frame.f_code.co_filename):
        t = t.tb_next
    return t if t is not None else tb


def _once(key: tuple, label: str, load: Callable[[], object]) -> None:
    """Run `load` unless `key` was loaded before; wrap any failure in PluginError and undo
    the toggles the failed plugin had registered."""
    if key in _LOADED:
        return
    before = set(registry.names())
    try:
        load()
    except Exception as e:
        for name in set(registry.names()) - before:
            try:
                registry.unregister(name)
            except registry.ToggleError:
                pass
        tb = "".join(traceback.format_exception(type(e), e, _user_frames(e.__traceback__))).rstrip()
        raise PluginError(f"plugin {label} failed to load: {type(e).__name__}: {e}\n{tb}") from e
    _LOADED.add(key)
