"""`fidelity toggles`: the kernel-toggle registry, arms and engine settings."""
from __future__ import annotations

from fidelity.errors import CommandError

# Lazy imports inside the functions: building the parser imports every command module,
# and only the command that runs should pay for its machinery (pandas, plots, readers).

HELP = "List the engine-numerics toggles (or check an arm, or show engine settings)."
EXAMPLES = """\
    fidelity toggles                                # every toggle, its kernel and the engines' settings
    fidelity toggles --category known-bug
    fidelity toggles --serving --engine vllm        # launch-only serving settings (MTP, CUDA graphs, ...)
"""


def add_arguments(p):
    p.add_argument("--markdown", action="store_true",
                   help="print the README toggle table (Markdown, full descriptions)")
    p.add_argument("--describe", metavar="NAME", help="print one toggle in full")
    p.add_argument("--arm", metavar="ARM",
                   help="parse an arm (e.g. 'index_keys_fp8,splitk_decode(splits=8)', "
                        "'engine:sglang') and print its canonical spelling and kernels")
    p.add_argument("--engine", choices=("sglang", "vllm", "fidelity"),
                   help="show each toggle's settings for this engine (with --arm: the "
                        "env/flags that realise the arm)")
    p.add_argument("--serving", action="store_true",
                   help="list the launch-only serving settings an engines arm can carry (serving = "
                        "{...}: mtp, cuda_graphs, prefix_cache, ...) and their flags per engine (with "
                        "--engine: one engine, with the sources)")
    from kernel_toggles.registry import CATEGORIES
    p.add_argument("--category", choices=CATEGORIES,
                   help="only toggles of this category (request: how a chat request is read "
                        "and rendered)")


def _settings(d) -> str:
    if d is None:
        return "(no known setting)"
    parts = [f"{k}={v}" for k, v in d.get("env", {}).items()] + list(d.get("flags", []))
    return " ".join(parts) or "(default)"


def run(args) -> int:
    import kernel_toggles as K
    from kernel_toggles import profiles

    try:
        if args.serving:
            from kernel_toggles import serving_settings
            print(serving_settings.render_text(args.engine), end="")
            return 0
        if args.engine == "fidelity":
            raise K.ToggleError("--engine fidelity lists serving settings only (with --serving): "
                                "fidelity serve takes toggles by name")
        if args.arm is not None:
            arm = K.ToggleSet.parse(args.arm)
            print(arm)
            for s in arm:
                print(f"  {s}: replaces {', '.join(s.toggle.kernels)} ({s.toggle.category})")
            if args.engine:
                ls = profiles.launch_settings(arm, args.engine)
                print(f"{args.engine} env: " + (" ".join(f"{k}={v}" for k, v in ls.env.items()) or "-"))
                print(f"{args.engine} flags: " + (" ".join(ls.flags) or "-"))
                for name, why in ls.unrealisable:
                    print(f"  cannot realise {name}: {why}")
                if ls.unconfirmed:
                    print(f"  mapping UNCONFIRMED for: {', '.join(ls.unconfirmed)}")
            return 0
        if args.describe:
            t = K.get(args.describe)
            print(f"{t.name} ({t.category}{', decode only' if t.phase == 'decode' else ''})")
            print(f"  replaces: {', '.join(t.kernels)}" + (f"  [exclusive group: {t.group}]" if t.group else ""))
            print(f"  parameters: {t.param_summary() or 'none'}")
            print(f"  provenance: {t.provenance.short()}")
            print(f"  {t.description}")
            if t.builtin:
                for eng in profiles.ENGINES:
                    e = profiles.entry(t.name, eng)
                    print(f"  {eng}: default={e['default']} on: {_settings(e['on'])} "
                          f"off: {_settings(e['off'])}{' UNCONFIRMED' if e['unconfirmed'] else ''}")
            return 0
        toggles = K.all_toggles(args.category)
        if args.markdown:
            print(K.render_markdown(toggles), end="")
        elif args.engine:
            for t in toggles:
                if not t.builtin:
                    continue
                e = profiles.entry(t.name, args.engine)
                print(f"{t.name:28} default={str(e['default']):5}  on: {_settings(e['on'])}  "
                      f"off: {_settings(e['off'])}{'  UNCONFIRMED' if e['unconfirmed'] else ''}")
        else:
            print(K.render_text(toggles))
        return 0
    except K.ToggleError as e:
        raise CommandError(str(e)) from None
