"""The training step through kdalab.chunk_kda beside FLA's chunk_kda, in one call (issue 38's measure): the step
is the forward and the backward as autograd runs them, o = chunk_kda(...) then the gradients of every input from
a fixed do, with the Kimi Linear layer's flags (gate, l2norm and sigmoid(beta) in the kernel; no initial state,
as in pre-training). Each side is timed eagerly (CUDA events) and by CUDA-graph replay of the whole step (the
median: GPU time), its peak memory taken, each of its kernels timed (torch.profiler), and the two sides'
gradients compared. FLA runs its own kernels (kdalab's FLA backend is not registered here). Rows are saved
after every one. (GPU.)

    python scripts/bench_train.py --out $OUT/train.json [--gates softplus,bounded] [--shapes "1,8192,32,128;..."]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common import bench, timing  # noqa: E402
from common.metrics import rel_err  # noqa: E402
from common.results import metadata  # noqa: E402

# Kimi Linear's shapes and the ladder's first benchmark shape (K = V = 128)
SHAPES = "1,8192,32,128;4,4096,32,128;1,8192,96,128;1,1024,64,128"
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def inputs(B, T, H, K, gate, seed=0):
    """bf16 q, k, v, g, beta, fp32 A_log [H] and dt_bias [H * K] as the layer holds them, and the flags."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    kw = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, K), g=r(B, T, H, K), beta=r(B, T, H),
              A_log=torch.log(torch.rand(H, device="cuda", generator=gen) * 0.5 + 0.5),
              dt_bias=torch.randn(H * K, device="cuda", generator=gen) * 0.5 - 1,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if gate == "bounded":
        kw.update(safe_gate=True, lower_bound=-5.0)
    return kw


def step_fn(chunk_kda, kw, do):
    """One training step's op work: forward, then the gradients of every input (a fresh graph each call)."""
    leaves = {n: kw[n].detach().requires_grad_() for n in NAMES}

    def step():
        o, _ = chunk_kda(**dict(kw, **leaves))
        return torch.autograd.grad(o, [leaves[n] for n in NAMES], do)

    return step


@contextlib.contextmanager
def backward_variant(variant):
    """kdalab.chunk_kda's backward built as ``variant`` (one change turned off) inside the block."""
    from common.stages import load_next
    from kdalab import op

    ext = load_next(op.BACKWARD).build(variant=variant)
    real = op._backward_extension
    op._backward_extension = lambda: ext
    try:
        yield
    finally:
        op._backward_extension = real


def bench_side(name, chunk_kda, kw, do) -> tuple[dict, list]:
    step = step_fn(chunk_kda, kw, do)
    grads = step()
    row = dict(side=name)
    row.update(timing.time_cuda(step, warmup=3, reps=10))
    try:
        row.update(timing.time_cuda_graph(step, warmup=3, reps=20))
    except RuntimeError as e:
        row["graph_error"] = str(e).splitlines()[0][:200]
    row["peak_mb"] = bench.peak_mb(step)
    row["kernels"] = bench.kernel_times(step, warmup=1, calls=3)
    return row, grads


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="B,T,H,K;...")
    ap.add_argument("--gates", default="softplus,bounded")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--variant", action="append", default=[],
                    help="also time kdalab with this build of the backward (next/13_backward BACKWARD_VARIANTS)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import kdalab

    sides = [("kdalab", kdalab.chunk_kda)]
    variants = {f"kdalab_{v}": v for v in args.variant}
    sides += [(name, kdalab.chunk_kda) for name in variants]
    if not args.no_fla:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        sides.append(("fla", fla_chunk_kda))
    rec = dict(meta=metadata(), what="training step (forward + backward of every input), Kimi Linear's flags",
               rows=[])
    t0 = time.time()
    for s in args.shapes.split(";"):
        B, T, H, K = (int(x) for x in s.split(","))
        for gate in args.gates.split(","):
            kw = inputs(B, T, H, K, gate)
            do = torch.randn(B, T, H, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) \
                .to(torch.bfloat16)
            got = {}
            for name, fn in sides:
                try:
                    with backward_variant(variants[name]) if name in variants else contextlib.nullcontext():
                        row, got[name] = bench_side(name, fn, kw, do)
                except Exception as e:  # noqa: BLE001 - recorded, the next side runs
                    row = dict(side=name, error=f"{type(e).__name__}: {str(e)[:300]}")
                row.update(B=B, T=T, H=H, K=K, V=K, gate=gate)
                if name.startswith("kdalab"):  # what the backward allocates, by stage.backward_bytes
                    from common.stages import load_next
                    from kdalab import op

                    row["bwd_bytes_declared_mb"] = load_next(op.BACKWARD).backward_bytes(
                        B, T, H, K, variant=variants.get(name))["total"] / 1e6
                if name != "kdalab" and "kdalab" in got and name in got:  # FLA's, or a variant's
                    row["grad_rel_err_vs_kdalab"] = {n: rel_err(a, b) for n, a, b in zip(NAMES, got[name],
                                                                                         got["kdalab"])}
                rec["rows"].append(row)
                print(f"[{time.time() - t0:6.1f} s] {name} B{B} T{T} H{H} K{K} {gate}: step {row.get('ms')} ms,"
                      f" graph {row.get('graph_ms')} ms, peak {row.get('peak_mb')} MB {row.get('error', '')}",
                      flush=True)
                Path(args.out).write_text(json.dumps(rec, indent=1, default=str))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
