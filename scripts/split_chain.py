"""The chain split across the GPU, composed from the last stage's own calls: a measurement of the idea
before it becomes a stage (issue 39).

With few heads and a long sequence the serial chain over chunks sets the time and most SMs wait. Cut the
sequence into N segments. The state after a segment is an affine map of the state before it,

    S_end = M S_start + C        (M [K, K], C [K, V] per head)

because each chunk's update is: S <- (diag(e^glast) - kr^T w) S + kr^T u, with u = Af v. So, with the stage's
packed-sequence call (each segment a sequence of its own):

1. C: the segments from a zero state (the real v): their final states;
2. M: the segments from the identity (h0 = I, V = K) with v = 0 (so u = 0): their final states;
3. the scan: S_start[0] = h0, S_start[i + 1] = M_i S_start[i] + C_i (N steps of [K, K] x [K, V] per head);
4. o: the segments again, each from its true starting state.

Steps 1, 2 and 4 run all segments' chains at once; step 3 is short. Exact up to rounding; about three
forwards of work, spread over N times the blocks.

    python scripts/split_chain.py --out $OUT/split_chain.json [--segments 8,16,32,64] [--gate bounded]

Each shape: the stage alone and split into each N, the same inputs, the split's difference from the stage
(o and the final state, relative), GPU time by CUDA-graph replay where the call captures, else CUDA events
(common.bench._timed). Needs a GPU; split_forward itself runs on any ``forward`` (tests/test_split_chain.py
checks it on the CPU against the fp64 token loop).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = [dict(B=1, T=65536, H=4, K=128, V=128), dict(B=1, T=8192, H=1, K=128, V=128),
          dict(B=1, T=32768, H=16, K=128, V=128), dict(B=1, T=65536, H=4, K=64, V=64)]


def segment_bounds(T: int, n: int, chunk: int = 16) -> list[int]:
    """n + 1 token offsets cutting [0, T) into n segments of whole chunks (the last takes the tail)."""
    if n < 1:
        raise ValueError(f"the number of segments must be positive, got {n}")
    chunks = -(-T // chunk)
    if n > chunks:
        raise ValueError(f"{n} segments of whole {chunk}-token chunks need T >= {(n - 1) * chunk + 1}, got {T}")
    per = -(-chunks // n)
    cuts = [min(i * per * chunk, T) for i in range(n)] + [T]
    return sorted(set(cuts))


def split_forward(forward, q, k, v, g, beta, *, n_segments: int, initial_state=None, chunk: int = 16, **kw):
    """(o, final state) of ``forward`` (a stage's, taking cu_seqlens) on one [1, T, H, *] sequence, run as
    ``n_segments`` segments joined by the scan of their affine maps (the module docstring)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if B != 1 or K != V:
        raise ValueError(f"split_forward takes one sequence (B = 1) with K = V, got B={B}, K={K}, V={V}")
    cuts = segment_bounds(T, n_segments, chunk)
    N = len(cuts) - 1
    cu = torch.tensor(cuts, dtype=torch.int32, device=q.device)
    _, C = forward(q, k, v, g, beta, cu_seqlens=cu, initial_state=None, output_final_state=True, **kw)
    f32 = C.dtype  # the state's dtype (fp32 from a stage): the scan runs in it
    eye = torch.eye(K, dtype=f32, device=q.device).expand(N, H, K, K).contiguous()
    _, M = forward(q, k, torch.zeros_like(v), g, beta, cu_seqlens=cu, initial_state=eye, output_final_state=True,
                   **kw)
    S = torch.zeros(H, K, V, dtype=f32, device=q.device) if initial_state is None else initial_state[0].to(f32)
    starts = []
    for i in range(N):  # the scan: N steps of [K, K] x [K, V] per head
        starts.append(S)
        S = M[i].to(f32) @ S + C[i].to(f32)
    o, ht = forward(q, k, v, g, beta, cu_seqlens=cu, initial_state=torch.stack(starts), output_final_state=True,
                    **kw)
    return o, ht[-1:]


def busy_ms(fn, reps: int = 5) -> float:
    """The GPU's busy time per call of ``fn``: the union of its kernels' intervals (torch.profiler), over
    ``reps`` calls, divided by ``reps``. Time the host spends between launches is left out, so this is what a
    single compiled call of the same kernels would take at best, not what the Python composition takes."""
    from torch.autograd import DeviceType

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # the union of the intervals (kernels on two streams overlap)
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy / reps / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp/kdalab-out")) / "split_chain.json"))
    ap.add_argument("--segments", default="8,16,32,64")
    ap.add_argument("--gate", default="bounded", choices=("bounded", "softplus"))
    ap.add_argument("--shapes", default=None, help="indices into SHAPES")
    ap.add_argument("--budget", type=float, default=0.4)
    ap.add_argument("--fp64", action="store_true",
                    help="also each one's error against the fp64 token loop (common.reference; T <= 16384 only)")
    ap.add_argument("--g-shift", type=float, default=0.0,
                    help="added to g: -10 makes the bounded gate decay slowly (about 2e-4 a token), so that the "
                         "state carries across segments and the scan's maps matter")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("split_chain.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from common import bench
    from common.results import metadata, save
    from common.stages import last_stage, load_stage

    stage = load_stage(last_stage())
    meta = metadata(command="python scripts/split_chain.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    meta["what"] = (f"stage {stage.SPEC.name} alone and split into N segments joined by the scan of their affine "
                    "maps (scripts/split_chain.py), the same inputs (h0 present), GPU time and difference")
    rows = []
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    for shape in shapes:
        kw = bench.path_inputs(shape, gate=args.gate)
        kw["g"] = kw["g"] + args.g_shift
        with torch.no_grad():
            o_ref, S_ref = stage.forward(**kw)
        exact = None
        if args.fp64 and shape["T"] <= 16384:
            from common.reference import kda_reference
            with torch.no_grad():
                exact = kda_reference(**{x: y for x, y in kw.items() if x != "chunk_size"})

        def vs64(o, S):  # the larger of o's and the state's relative error against fp64
            if exact is None:
                return None
            return max(float((o.double() - exact[0]).norm() / exact[0].norm()),
                       float((S.double() - exact[1]).norm() / exact[1].norm()))

        def plain():
            with torch.no_grad():
                return stage.forward(**kw)
        row = dict(variant="stage", gate=args.gate, g_shift=args.g_shift, err_vs_fp64=vs64(o_ref, S_ref),
                   busy_ms=busy_ms(plain), **shape)
        row.update({"fwd_" + x: y for x, y in bench._timed(plain, "cuda", args.budget, True).items()})
        rows.append(row)
        print(row, flush=True)
        for n in [int(x) for x in args.segments.split(",")]:
            q, k, v, g, beta = (kw[x] for x in ("q", "k", "v", "g", "beta"))
            rest = {x: y for x, y in kw.items() if x not in ("q", "k", "v", "g", "beta", "initial_state")}

            def split(n=n):
                with torch.no_grad():
                    return split_forward(stage.forward, q, k, v, g, beta, n_segments=n,
                                         initial_state=kw["initial_state"], **rest)
            o, S = split()
            err = max(float((o.float() - o_ref.float()).norm() / o_ref.float().norm()),
                      float((S.float() - S_ref.float()).norm() / S_ref.float().norm()))
            row = dict(variant=f"split{n}", segments=n, gate=args.gate, g_shift=args.g_shift, err_vs_stage=err,
                       err_vs_fp64=vs64(o, S),
                       busy_ms=busy_ms(split), **shape)
            row.update({"fwd_" + x: y for x, y in bench._timed(split, "cuda", args.budget, True).items()})
            rows.append(row)
            print(row, flush=True)
            save(Path(args.out), rows, meta)
        del kw
        torch.cuda.empty_cache()
    save(Path(args.out), rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
