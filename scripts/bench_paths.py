"""Stage 08's paths side by side on the H200: every path of the stage (split with
1 or 2 compute warps per K2 block, fused with 1, 2, 4 or V/16), the stage's
rule, stage 07 and FlashKDA (when importable), at every benchmark shape plus
B1 T32768 H16. Per row: GPU time by CUDA-graph replay, peak memory above the
inputs during one call, and whether o and the final state are bitwise equal to
stage 07's. This is the measurement the stage's rule (kda_fwd_plan) was chosen
from; the bench-tc phase of gpu_run.py times the rule beside the other stages.

    python scripts/bench_paths.py [--shapes "B1 T1024 H64 K128 V128;..."] [--out $OUT/paths.json]
    python scripts/bench_paths.py --profile     # also clock64 regions of the fused path

Needs a GPU and stages 07 and 08 built (gpu_run.py's build phase).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common import bench  # noqa: E402
from common.inputs import make_inputs  # noqa: E402
from common.results import metadata, save  # noqa: E402
from common.stages import load_stage  # noqa: E402

LONG_SHAPE = dict(B=1, T=32768, H=16, K=128, V=128)


def parse_shapes(text):
    out = []
    for item in text.split(";"):
        d = {tok[0]: int(tok[1:]) for tok in item.split()}
        out.append(dict(B=d["B"], T=d["T"], H=d["H"], K=d["K"], V=d["V"]))
    return out


def peak_mb(fn) -> float:
    """max_memory_allocated above what is allocated before one call, in MB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None)
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp/kdalab-out")) / "paths.json"))
    p.add_argument("--budget", type=float, default=0.4, help="seconds of timing per row")
    p.add_argument("--profile", action="store_true", help="clock64 regions of the rule's path per shape")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes) if args.shapes else bench.TC_GPU_SHAPES + [LONG_SHAPE]
    s07, s08 = load_stage("07"), load_stage("08")
    try:
        from common.fla_ref import flashkda_available, flashkda_call, flashkda_forward
        fk_ok, fk_why = flashkda_available()
    except ImportError as e:  # an older common/ without FlashKDA
        fk_ok, fk_why = False, str(e)
    print(f"FlashKDA: {'importable' if fk_ok else fk_why}", flush=True)
    rows, meta = [], metadata(command="python scripts/bench_paths.py" + (" --profile" if args.profile else ""))
    for shape in shapes:
        label = bench.shape_label(shape)
        kw = make_inputs(**shape, seed=0, dtype=torch.bfloat16, device="cuda", gate="bounded", lower_bound=-5.0,
                         chunk_size=16)
        with torch.no_grad():
            o7, S7 = s07.forward(**kw)
        paths = [None, "split1", "split2", "fused1", "fused2", "fused4"] + (["fused8"] if shape["V"] >= 128 else [])
        cands = [("07", None, s07.forward)] + [("08", name, s08.forward) for name in paths]
        if fk_ok and shape["K"] == shape["V"] == 128:
            cands.append(("FlashKDA", None, flashkda_forward))
        for who, name, fwd in cands:
            t0 = time.time()
            row = dict(stage=who, path=name or "rule", **shape)
            try:
                with (s08.path(name) if who == "08" else nullcontext()):
                    def f():
                        with torch.no_grad():
                            return fwd(**kw)
                    o, S = f()
                    if who != "FlashKDA":
                        row["equal_to_07"] = bool(torch.equal(o, o7) and torch.equal(S, S7))
                    else:
                        row["o_vs_07"] = float(((o.float() - o7.float()).norm() / o7.float().norm()).item())
                    del o, S
                    if who == "08":
                        row["kernels"] = [x["kernel"] for x in s08.build().launches()]
                    if who == "FlashKDA":  # its own call as a model makes it: states in its layout, no transposes
                        call = flashkda_call(**kw)
                        t = bench._timed(call, "cuda", args.budget, True)
                        del call
                        row["peak_mb"] = round(peak_mb(lambda: flashkda_call(**kw)()), 1)
                    else:
                        t = bench._timed(f, "cuda", args.budget, True)
                        row["peak_mb"] = round(peak_mb(f), 1)
                    row.update({"fwd_" + k: v for k, v in t.items()})
                    if args.profile and who == "08":
                        row["profile"] = s08.profile(**kw)
            except Exception as e:  # noqa: BLE001 -- a path that does not exist for the shape: record why
                row["error"] = str(e).splitlines()[0][:300]
            torch.cuda.empty_cache()
            rows.append(row)
            ms = row.get("fwd_graph_ms") or row.get("fwd_ms")
            print(f"{label} {who:8s} {row['path']:7s} {('%.4f ms' % ms) if ms else row.get('error')} "
                  f"peak {row.get('peak_mb')} MB eq07={row.get('equal_to_07')} ({time.time() - t0:.1f} s)",
                  flush=True)
            save(Path(args.out), rows, meta)
        del kw, o7, S7
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
