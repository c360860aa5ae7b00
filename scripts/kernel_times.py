"""Per-kernel GPU time of the last stage with the softplus gate (torch.profiler: 20 warm-up calls, then 50
profiled; the mean per launch), at three shapes: which kernel moved when a whole call's time did.

    python scripts/kernel_times.py now $OUT/kprof_now.json
    KDALAB_STAGES_DIR=.before python scripts/kernel_times.py before $OUT/kprof_before.json   # an earlier commit's

(``.before`` holds an earlier commit's stage directory; each label runs in its own process.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_softplus import gpu_inputs  # noqa: E402
from common.bench import kernel_times  # noqa: E402
from common.stages import load_stage, stage_ids  # noqa: E402

SHAPES = [dict(B=1, T=4096, H=16, K=128, V=128), dict(B=1, T=8192, H=96, K=128, V=128),
          dict(B=8, T=1024, H=64, K=128, V=128)]


def main(argv=None) -> int:
    label, out = (argv if argv is not None else sys.argv[1:])[:2]
    top = load_stage(stage_ids()[-1])
    rows = []
    for shp in SHAPES:
        kw = gpu_inputs(**shp, gate="softplus")
        with torch.no_grad():
            times = kernel_times(lambda: top.forward(**kw), warmup=20, calls=50)
        rows += [dict(label=label, **shp, kernel=name[:90], count=n, avg_us=ms * 1000, avg_ms=ms)
                 for name, (n, ms) in times.items()]
    Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(label, r["T"], r["H"], r["kernel"][:60], r["count"], round(r["avg_us"], 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
