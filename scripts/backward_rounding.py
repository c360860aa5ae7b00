"""What storing the backward's intermediates in bf16 would cost in accuracy, predicted on the CPU before the
tensor-core backward is written (issue 38).

The tensor-core backward (common/backward_model.py: states kept every few chunks, the reverse chain, the chunk
adjoint) keeps in memory the chains' operands (qd, kr, w, u, Aqk), do and the two chains' checkpoints. Each can be
bf16 or fp32; bf16 halves the bytes, fp32 checkpoints would double the saved states' memory against FLA's. This
script rounds each group to bf16 in turn (chunked_backward's ``operands`` and ``checkpoints``), on inputs rounded to bf16 as the GPU
takes them, and prints every gradient's error against fp64 autograd through the token loop on those same inputs:
FLA's ratio, the RMS of the difference over the RMS of the reference.

    python scripts/backward_rounding.py [--out results/cpu/backward_rounding.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import backward_model as bm  # noqa: E402
from common.reference import activate, kda_recurrence  # noqa: E402
from common.results import metadata, save  # noqa: E402

F64 = torch.float64
CASES = [dict(B=2, T=256, H=2, K=64, V=64, gate="bounded"), dict(B=2, T=256, H=2, K=64, V=64, gate="softplus"),
         dict(B=1, T=200, H=2, K=128, V=128, gate="softplus")]


def bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


def inputs(B, T, H, K, V, gate, seed=0):
    """Activated inputs as a kernel sees them (common.reference.activate on bf16 raw inputs, A_log = 0,
    dt_bias = 0, the bounded gate at -5), an h0, do and the final state's gradient."""
    g = torch.Generator().manual_seed(seed)
    q, k, x = (bf16(torch.randn(B, T, H, K, dtype=F64, generator=g)) for _ in range(3))
    v = bf16(torch.randn(B, T, H, V, dtype=F64, generator=g))
    beta = bf16(torch.randn(B, T, H, dtype=F64, generator=g))
    qn, kn, b, a = activate(q, k, x, beta, torch.zeros(H, dtype=F64), torch.zeros(H, K, dtype=F64), gate=gate,
                            lower_bound=-5.0 if gate == "bounded" else None)
    h0 = torch.randn(B, H, K, V, dtype=F64, generator=g) * 0.1
    do = bf16(torch.randn(B, T, H, V, dtype=F64, generator=g))
    dht = torch.randn(B, H, K, V, dtype=F64, generator=g) * 0.1
    return qn, kn, v, b, a, h0, do, dht


def reference(qn, kn, v, b, a, h0, do, dht, scale):
    leaves = [t.clone().requires_grad_() for t in (qn, kn, v, b, a, h0)]
    o, S = kda_recurrence(*leaves[:5], scale=scale, initial_state=leaves[5])
    ((o * do).sum() + (S * dht).sum()).backward()
    return dict(zip(("dqn", "dkn", "dv", "db", "da", "dh0"), (t.grad for t in leaves)))


VARIANTS = {"exact": {}, "operands and do bf16": {"operands": bf16}, "checkpoints bf16": {"checkpoints": bf16},
            "all bf16": {"operands": bf16, "checkpoints": bf16}}


def run_case(case, every=4):
    B, T, H, K, V, gate = (case[x] for x in ("B", "T", "H", "K", "V", "gate"))
    qn, kn, v, b, a, h0, do, dht = inputs(B, T, H, K, V, gate)
    scale = K ** -0.5
    ref = reference(qn, kn, v, b, a, h0, do, dht, scale)
    rows = []
    for name, kw in VARIANTS.items():
        got = bm.chunked_backward(qn, kn, v, b, a, do, dht, scale=scale, initial_state=h0, every=every, **kw)
        errs = {f"{n}_err": float((got[n] - r).norm() / r.norm()) for n, r in ref.items()}
        rows.append(dict(case, variant=name, every=every, **errs))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "cpu" / "backward_rounding.json"))
    args = ap.parse_args(argv)
    meta = metadata(command="python scripts/backward_rounding.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    meta["what"] = ("every gradient of common.backward_model.chunked_backward against fp64 autograd through the token "
                    "loop, on bf16-rounded inputs, with the backward's stored intermediates exact or rounded to bf16 "
                    "(the chains' operands and do, the checkpoints of both chains, or all); error = RMS of the "
                    "difference over RMS of the reference")
    rows = [r for case in CASES for r in run_case(case)]
    save(Path(args.out), rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
