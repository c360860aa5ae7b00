"""FLA's KDA layer forward with and without the kdalab backend (GPU).

FLA's ``KimiDeltaAttention`` (safe_gate, lower_bound -5, bf16, inference mode)
at Kimi-style shapes -- 32 heads of 128 (Kimi Linear's 2304 hidden) and 96 heads
of 128 (7168 hidden) -- timed with the kdalab backend on (``import kdalab.fla``)
and off (``FLA_KDALAB=0``: FLA's own Triton kernels), each by CUDA events and by
CUDA-graph replay (common.timing), plus the op alone against FLA's chunk_kda at
the same shapes. Checks that the backend ran and that the outputs agree, and
writes one JSON results file (common.results) to $OUT (or --out).

On the H200: fla-core and flash-linear-attention (fla.layers) on the path, e.g.
    pip install --no-deps --target /tmp/site_fla .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
    PYTHONPATH=$PWD:/tmp/site_fla python3 scripts/bench_op.py --heads 32,96 --T 2048,8192
(transformers is not needed: kdalab.fla.kda_layer_class imports only fla/layers/kda.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.metrics import rel_err  # noqa: E402
from common.results import metadata, save  # noqa: E402
from common.timing import time_call  # noqa: E402

HIDDEN = {32: 2304, 96: 7168}  # hidden size per head count (Kimi Linear 48B: 2304 with 32 KDA heads)


@contextmanager
def backend(on: bool):
    """kdalab's backend on or off for FLA's dispatch (read at each call, so also at capture)."""
    old = os.environ.get("FLA_KDALAB")
    os.environ["FLA_KDALAB"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLA_KDALAB")
        else:
            os.environ["FLA_KDALAB"] = old


def timed(fn, reps) -> dict:
    out = time_call(fn, "cuda", reps=reps)
    return {k: out.get(k) for k in ("ms", "graph_ms", "graph_error") if k in out}


def bench_shape(H, hidden, B, T, reps, KimiDeltaAttention, counter) -> list[dict]:
    import kdalab
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=hidden, head_dim=128, num_heads=H, safe_gate=True, lower_bound=-5.0)
    layer = layer.cuda().bfloat16().eval()
    x = torch.randn(B, T, hidden, device="cuda", dtype=torch.bfloat16)
    rows = []
    with torch.inference_mode():
        # the layer
        n0 = len(counter)
        with backend(True):
            y = layer(x)[0]
            dispatched = len(counter) > n0
            t_k = timed(lambda: layer(x), reps)
        with backend(False):
            y_f = layer(x)[0]
            t_f = timed(lambda: layer(x), reps)
        rows.append(_row("layer", H, hidden, B, T, t_k, t_f, rel_err(y, y_f), dispatched))
        # the op alone, with the layer's flags
        D = 128
        q, k, v, g = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        kw = dict(q=q, k=k, v=v, g=g, beta=torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16),
                  A_log=torch.zeros(H, device="cuda"), dt_bias=torch.zeros(H * D, device="cuda"),
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  safe_gate=True, lower_bound=-5.0, state_v_first=True, output_final_state=True)
        o, _ = kdalab.chunk_kda(**kw)
        t_k = timed(lambda: kdalab.chunk_kda(**kw), reps)
        with backend(False):
            o_f, _ = fla_chunk_kda(**kw)
            t_f = timed(lambda: fla_chunk_kda(**kw), reps)
        rows.append(_row("op", H, hidden, B, T, t_k, t_f, rel_err(o, o_f), True))
    return rows


def bench_train_shape(H, hidden, B, T, reps, KimiDeltaAttention, counter) -> list[dict]:
    """FLA's layer in training (forward, then the gradients of the input and every parameter from a fixed dy):
    through the backend with FLA_KDALAB_TRAIN=1 (kdalab's forward and backward) against FLA's own kernels."""
    from common.bench import peak_mb

    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=hidden, head_dim=128, num_heads=H, safe_gate=True, lower_bound=-5.0)
    layer = layer.cuda().bfloat16().train()
    x = torch.randn(B, T, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, T, hidden, device="cuda", dtype=torch.bfloat16)
    params = [x] + [p for p in layer.parameters() if p.requires_grad]

    def step():
        return torch.autograd.grad(layer(x)[0], params, dy)

    old = os.environ.get("FLA_KDALAB_TRAIN")
    os.environ["FLA_KDALAB_TRAIN"] = "1"
    try:
        with backend(True):
            n0 = len(counter)
            g_k = step()
            dispatched = len(counter) > n0
            t_k = dict(timed(step, reps), peak_mb=peak_mb(step))
    finally:
        if old is None:
            os.environ.pop("FLA_KDALAB_TRAIN")
        else:
            os.environ["FLA_KDALAB_TRAIN"] = old
    with backend(False):
        g_f = step()
        t_f = dict(timed(step, reps), peak_mb=peak_mb(step))
    err = max(rel_err(a, b) for a, b in zip(g_k, g_f))
    return [_row("layer_train", H, hidden, B, T, t_k, t_f, err, dispatched)]


def _row(what, H, hidden, B, T, t_k, t_f, err, dispatched) -> dict:
    row = dict(what=what, H=H, D=128, hidden=hidden, B=B, T=T, dispatched=dispatched, rel_err_vs_fla=err)
    row.update({f"kdalab_{k}": v for k, v in t_k.items()})
    row.update({f"fla_{k}": v for k, v in t_f.items()})
    for k in ("ms", "graph_ms"):
        if row.get(f"kdalab_{k}") and row.get(f"fla_{k}"):
            row[f"speedup_{k}"] = row[f"fla_{k}"] / row[f"kdalab_{k}"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32,96", help="head counts (of 128), comma-separated")
    ap.add_argument("--T", default="2048,8192", help="sequence lengths, comma-separated")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="results file (default $OUT/bench_op.json)")
    ap.add_argument("--train", action="store_true", help="the layer's forward and backward (FLA_KDALAB_TRAIN=1)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_op.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import kdalab.fla

    KimiDeltaAttention = kdalab.fla.kda_layer_class()
    counter = []
    real = kdalab.fla.KdalabBackend.chunk_kda
    kdalab.fla.KdalabBackend.chunk_kda = lambda self, *a, **k: counter.append(1) or real(self, *a, **k)

    out = Path(args.out or Path(os.environ.get("OUT", "results")) / "bench_op.json")
    meta = metadata()
    meta["what"] = ("FLA KimiDeltaAttention forward (bf16, safe_gate, lower_bound -5, inference mode) with the "
                    "kdalab backend vs FLA's own kernels (FLA_KDALAB=0); 'op': kdalab.chunk_kda vs FLA chunk_kda"
                    if not args.train else
                    "FLA KimiDeltaAttention forward + backward (bf16, safe_gate, lower_bound -5): the gradients of x "
                    "and every parameter, through the kdalab backend with FLA_KDALAB_TRAIN=1 vs FLA's own kernels")
    rows = []
    for H in (int(h) for h in args.heads.split(",")):
        for T in (int(t) for t in args.T.split(",")):
            bench = bench_train_shape if args.train else bench_shape
            for row in bench(H, HIDDEN.get(H, 24 * H), args.B, T, args.reps, KimiDeltaAttention, counter):
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                save(out, rows, meta)  # after every row: a run cut short keeps what it measured
    bad = [r for r in rows if not r["dispatched"] or not r["rel_err_vs_fla"] < (3e-2 if args.train else 1e-2)]
    print(f"wrote {out}; {len(rows)} rows; {'all agree' if not bad else f'{len(bad)} rows disagree or did not dispatch'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
