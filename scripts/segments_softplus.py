"""The last stage with the softplus gate at one shape (default B1 T4096 H16 K128): graph time for several
segment lengths of the split path (chunks per K1 + K2 pair; the rule's is SEGMENT_CHUNKS), two rounds, and
in the first round the mean time per launch of K1 and K2 (torch.profiler). With one segment K1 runs
wholly before K2; with several, K1 of the next segment runs beside K2 of this one on a side stream.

    python scripts/segments_softplus.py now $OUT/segs_now.json
    KDALAB_STAGES_DIR=.before python scripts/segments_softplus.py before $OUT/segs_before.json  # an earlier commit's
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_softplus import gpu_inputs, timing_row  # noqa: E402
from common.bench import kernel_times  # noqa: E402
from common.stages import load_stage, stage_ids  # noqa: E402

SHAPE = dict(B=1, T=4096, H=16, K=128, V=128)
SEGMENTS = (None, 32, 128, 256)  # None: the rule's


def main(argv=None) -> int:
    label, out = (argv if argv is not None else sys.argv[1:])[:2]
    top = load_stage(stage_ids()[-1])
    kw = gpu_inputs(**SHAPE, gate="softplus")
    rows = []
    for rnd in range(2):
        for seg in SEGMENTS:
            def call(seg=seg):
                with torch.no_grad(), top.path(segment_chunks=seg):
                    return top.forward(**kw)
            r = timing_row("softplus", label, SHAPE, call, seg=seg, round=rnd)
            if rnd == 0:  # {kernel: (launches, us per launch)}
                r["kernels"] = {k[:40]: (n, ms * 1000) for k, (n, ms) in kernel_times(call).items() if "kda" in k}
            rows.append(r)
            print(label, seg, rnd, r.get("graph_ms"), r.get("kernels"), flush=True)
    Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
