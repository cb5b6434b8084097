"""`fidelity engines plan|run SPEC.toml`: real engine configurations as arms."""
from __future__ import annotations

from pathlib import Path

from fidelity.commands.options import output_options
from fidelity.errors import CommandError, exit_code

# Lazy imports inside the functions: building the parser imports every command module,
# and only the command that runs should pay for its machinery (pandas, plots, readers).

HELP = ("Launch SGLang / vLLM / fidelity-serve configurations from a spec, one at a time, "
        "score them over HTTP (KLD, needle) and attribute drift across them; an in-process "
        "golden on the same GPUs is scored and released first.")
EXAMPLES = """\
    fidelity engines plan examples/engines/sglang-v4-flash.toml   # each arm's command line and env, nothing launched
    fidelity engines run examples/engines/fidelity-demo.toml --out reports
"""


def add_arguments(p):
    p.add_argument("action", choices=("plan", "run"),
                   help="plan: print each arm's command line and environment and write a launch "
                        "script; run: launch, score and report (resumes)")
    p.add_argument("spec", help="the engines spec (TOML); see fidelity/engines/spec.py")
    g = output_options(p, "engines", "the spec's name", fresh="run: discard earlier results of this run",
                       out_default=None, out_help="output folder: writes <out>/engines/<run-id>/ (default: "
                       "the spec's [run] out, else 'reports' in the current directory)")
    g.add_argument("--script", default=None, help="plan: where to write the launch script "
                   "(default <out>/engines/<run-id>/launch.sh)")


def run(args) -> int:
    from infra.server_process import LaunchError
    from fidelity.engines.run import plans, run_engines, write_script
    from fidelity.engines.spec import SpecError, load_spec
    from fidelity.kld.endpoint import EndpointError
    from fidelity.progress import Progress

    try:
        spec = load_spec(args.spec)
        if args.out:
            spec.out = args.out
        run_id = args.run_id or Path(args.spec).stem
        if args.action == "plan":
            ps = plans(spec)
            for p in ps:
                ready = "computed first, in this process" if p.kind == "inprocess" else \
                    f"ready: GET {p.url}{p.ready_path}"
                print(f"# {p.arm}  ({p.kind} engine {p.engine}, {ready})")
                for n in p.notes:
                    print(f"#   note: {n}")
                if p.cmd or p.kind == "external":
                    print(p.shell() if p.cmd else f"#   external: {p.url} (not launched)")
                print()
            script = Path(args.script) if args.script else Path(spec.out) / "engines" / run_id / "launch.sh"
            print(f"launch script: {write_script(spec, ps, script)}")
            return 0
        out = run_engines(spec, run_id, Progress(args.quiet), args.fresh)
    except (SpecError, LaunchError, EndpointError, ValueError, RuntimeError) as e:
        raise CommandError(str(e)) from None
    if "verdict" in out:
        print(out["verdict"]["sentence"])
    print(f"report: {out['root'] / 'summary.md'}")
    return exit_code(bool(out.get("flagged")))
