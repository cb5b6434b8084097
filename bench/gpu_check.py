"""The whole GPU check, for a machine with CUDA (it cannot run on the CPU-only build
machine; without CUDA it says so and exits 0):

  1. golden on the tiny model, CUDA vs CPU, fp64 accumulation (the reference profile):
     prefill logits and two decode steps must be bit-identical;
  2. the same with fp32 accumulation on CUDA: within a stated bound of the CPU fp64
     golden (max KLD below 3x the CPU-measured reduction-order floor);
  3. with two or more GPUs: layers placed across cuda:0,cuda:1 equal one GPU bit for bit;
  4. a V4-Flash-shaped layer's FP8 and FP4 tensors dequantised on the GPU equal the CPU
     dequantisation bit for bit, with throughput;
  5. the tiny model saved as a checkpoint and held quantised-resident on the GPU gives the
     CPU dense golden's logits bit for bit;
  6. with two or more GPUs: the golden's lockstep as 2 torchrun ranks (NCCL, one GPU each,
     fidelity.pipeline) gives the one-process tables on cuda:0 bit for bit (fp64);
  7. timings of each step.

Exit status 1 on any failed check; results also written to bench/results/gpu_check.md.
    bash bench/gpu_check.sh
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity.ab.metrics import kld_per_position  # noqa: E402
from reference_model import Model, Numerics, flash, tiny  # noqa: E402
from reference_model import quant as Q  # noqa: E402
from reference_model.checkpoint import decode_fp4, decode_fp8  # noqa: E402
from reference_model.weights import random_weights  # noqa: E402

lines, failed = [], []


def say(msg):
    print(msg, flush=True)
    lines.append(msg)


def check(ok, what):
    say(("PASS " if ok else "FAIL ") + what)
    if not ok:
        failed.append(what)


def run(model, toks):
    logits, st = model.extend(toks, None, "all")
    out = [logits.cpu()]
    for t in (5, 9):
        lg, st = model.extend(torch.tensor([t], device=toks.device), st, "last")
        out.append(lg.cpu())
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): skipped")
        return 0
    say(f"# GPU check\n\n{torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, {time.strftime('%Y-%m-%d %H:%M')}\n")
    w = random_weights(tiny(), seed=0)
    toks = torch.randint(2, 500, (300,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    cpu = run(Model(w, Numerics("reference")), toks)
    t_cpu = time.perf_counter() - t0
    t0 = time.perf_counter()
    gpu = run(Model(w, Numerics("reference"), devices=["cuda:0"]), toks)
    torch.cuda.synchronize()
    t_gpu = time.perf_counter() - t0
    diff = max(float((a - b).abs().max()) for a, b in zip(cpu, gpu))
    check(all(torch.equal(a, b) for a, b in zip(cpu, gpu)),
          f"tiny golden fp64, CUDA vs CPU bit-identical (max |Δlogit| {diff:.3g}; CPU {t_cpu:.2f} s, CUDA {t_gpu:.2f} s)")
    floor = max(float(kld_per_position(a, b).max()) for a, b in
                zip(cpu, run(Model(w, Numerics("reference", torch.float32)), toks)))
    g32 = run(Model(w, Numerics("reference", torch.float32), devices=["cuda:0"]), toks)
    k32 = max(float(kld_per_position(a, b).max()) for a, b in zip(cpu, g32))
    check(k32 <= 3 * max(floor, 1e-9),
          f"tiny golden fp32 on CUDA: max KLD vs CPU fp64 {k32:.3g} <= 3 x CPU fp32 floor {floor:.3g}")
    if torch.cuda.device_count() >= 2:
        two = run(Model(w, Numerics("reference"), devices=["cuda:0", "cuda:1"]), toks)
        check(all(torch.equal(a, b) for a, b in zip(gpu, two)), "layers across cuda:0,cuda:1 equal one GPU")
    else:
        say("skip: placement across two GPUs (one device)")
    cfg = flash()
    g = torch.Generator().manual_seed(1)
    for name, shape, fmt in (("wq_b-like FP8", (cfg.n_heads * cfg.head_dim, cfg.q_lora_rank), "fp8"),
                             ("expert w1 FP4", (cfg.moe_inter_dim, cfg.dim), "fp4")):
        x = torch.randn(shape, generator=g)
        if fmt == "fp8":
            q, s = Q.quantize_fp8_weight(x)
            packed, s8, decode = q, Q.float_to_e8m0(s), decode_fp8
        else:
            v, s = Q.quantize_fp4_weight(x)
            packed, s8, decode = Q.pack_fp4(v), Q.float_to_e8m0(s), decode_fp4
        a = decode(packed, s8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b = decode(packed.cuda(), s8.cuda(), "cuda")
        torch.cuda.synchronize()
        nbytes = packed.numel() + s8.numel()
        dt = time.perf_counter() - t0
        check(torch.equal(a, b.cpu()), f"V4-Flash {name} {list(shape)} dequantised on CUDA == CPU "
                                       f"({nbytes / dt / 1e9:.2f} GB/s of checkpoint bytes)")
    import tempfile
    from reference_model.checkpoint import save_checkpoint
    from reference_model.resident import QuantisedResidentWeights
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(w, Path(d) / "tiny")
        t0 = time.perf_counter()
        rq = QuantisedResidentWeights(Path(d) / "tiny", devices=["cuda:0"])
        res = run(Model(rq, Numerics("reference"), devices=["cuda:0"]), toks)
        torch.cuda.synchronize()
        check(all(torch.equal(a, b) for a, b in zip(cpu, res)),
              f"quantised-resident tiny checkpoint on CUDA == CPU dense golden ({time.perf_counter() - t0:.2f} s)")
    if torch.cuda.device_count() >= 2:
        distributed_check()
    else:
        say("skip: the golden over 2 torchrun ranks (one device)")
    (ROOT / "bench" / "results" / "gpu_check.md").write_text("\n".join(lines) + "\n")
    say(f"\n{'FAILED: ' + '; '.join(failed) if failed else 'all GPU checks passed'}")
    return 1 if failed else 0


def distributed_check() -> None:
    """2 pipeline ranks (torchrun, NCCL, cuda:0 and cuda:1) vs one process on cuda:0."""
    import pickle
    import subprocess
    import tempfile

    import pandas as pd
    sys.path.insert(0, str(ROOT / "tests"))
    from distributed.cases import arms, prompts, tables

    from fidelity.ab.lockstep import LockstepRunner, RunnerSettings
    one = tables(LockstepRunner(random_weights(tiny(), seed=0), arms(),
                                RunnerSettings(decode_steps=2, devices=("cuda:0",)), {"bug": "engine"}).run(prompts()))
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "got.pkl"
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            str(ROOT / "bench" / "gpu_check_dist.py"), str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            check(False, f"golden over 2 torchrun ranks ran ({r.stderr.strip().splitlines()[-1:]})")
            return
        got = pickle.loads(out.read_bytes())["tables"]
    same = all(v.equals(got[k]) if len(v) else len(got[k]) == 0 for k, v in one.items())
    rows = sum(len(v) for v in one.values())
    check(same and isinstance(got["kld"], pd.DataFrame),
          f"golden over 2 torchrun ranks (NCCL) == one process on cuda:0: {rows} table rows bit-identical "
          f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
