"""A small KDA language model trained on a fixed synthetic language, once through FLA's chunk_kda and once
through kdalab.chunk_kda, each from two seeds (issue 38): the loss curves of the two kernels from one seed should
lie closer together than those of one kernel from two seeds (the run-to-run noise). (GPU.)

The language: blocks of 64 symbols of a first-order Markov chain over 256 symbols (each followed by one of four
successors, probabilities drawn once), each block then repeated: half the tokens are the chain's (entropy about
0.93 nats each), half a copy of the token 64 back, which only the attention's state can recall. The loss falls
from ln 256 = 5.55 towards about half the chain's entropy. The model: an
embedding, two blocks of (RMSNorm, kdalab.layer.KDALayer, residual; RMSNorm, a SiLU MLP, residual), a norm and a
head; parameters fp32, activations bf16 under autocast, AdamW. A seed fixes the initial weights and the batches.

    python scripts/train_small.py --steps 300 --out $OUT/loss.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from common.metrics import curve_gap, moving_mean  # noqa: E402
from common.results import metadata  # noqa: E402
from kdalab.layer import KDALayer  # noqa: E402

VOCAB, SUCCESSORS = 256, 4


def language(seed=1234, device="cuda"):
    """The chain: for each symbol its successors [VOCAB, SUCCESSORS] and their probabilities, and its entropy rate
    (nats per symbol, under the chain's stationary distribution)."""
    gen = torch.Generator().manual_seed(seed)
    succ = torch.stack([torch.randperm(VOCAB, generator=gen)[:SUCCESSORS] for _ in range(VOCAB)])
    prob = torch.softmax(torch.randn(VOCAB, SUCCESSORS, generator=gen) * 1.5, -1)
    P = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    P.scatter_(1, succ, prob.double())
    pi = torch.full((VOCAB,), 1.0 / VOCAB, dtype=torch.float64)
    for _ in range(2000):
        pi = pi @ P
    h = float(-(pi[:, None] * P * torch.log(P.clamp_min(1e-300))).sum())
    return succ.to(device), prob.to(device), h


BLOCK = 64


def pool(succ, prob, n, T, seed=99):
    """n sequences of T + 1 symbols: chain blocks of BLOCK symbols, each followed by its copy."""
    gen = torch.Generator(device=succ.device).manual_seed(seed)
    L = -(-(T + 1) // (2 * BLOCK)) * BLOCK  # chain symbols per sequence
    x = torch.empty(n, L, dtype=torch.long, device=succ.device)
    x[:, 0] = torch.randint(0, VOCAB, (n,), device=succ.device, generator=gen)
    for t in range(L - 1):
        j = torch.multinomial(prob[x[:, t]], 1, generator=gen)[:, 0]
        x[:, t + 1] = succ[x[:, t], j]
    blocks = x.view(n, -1, 1, BLOCK).expand(-1, -1, 2, -1)
    return blocks.reshape(n, -1)[:, :T + 1].contiguous()


class Model(nn.Module):
    def __init__(self, kernel, hidden=1024, heads=32, head_dim=128, layers=2, lower_bound=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict(dict(
                n1=nn.RMSNorm(hidden), attn=KDALayer(hidden, heads, head_dim, lower_bound=lower_bound, kernel=kernel),
                n2=nn.RMSNorm(hidden), mlp=nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.SiLU(),
                                                         nn.Linear(4 * hidden, hidden)))))
        self.norm, self.head = nn.RMSNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b["attn"](b["n1"](h))[0]
            h = h + b["mlp"](b["n2"](h))
        return self.head(self.norm(h))


def train(kernel, seed, steps, B, T, lower_bound, data, lr=1e-3, **dims):
    """The losses of ``steps`` AdamW steps from seed ``seed`` (weights and batches) on batches of ``data``."""
    torch.manual_seed(seed)
    model = Model(kernel, lower_bound=lower_bound, **dims).to(data.device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator(device=data.device).manual_seed(seed)
    losses = []
    for step in range(steps):
        x = data[torch.randint(0, data.shape[0], (B,), device=data.device, generator=gen)]
        with torch.autocast(data.device.type, dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--gate", default="softplus", choices=("softplus", "bounded"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import kdalab
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    lb = None if args.gate == "softplus" else -5.0
    succ, prob, _ = language()
    data = pool(succ, prob, 512, args.seq)
    rec = dict(meta=metadata(), steps=args.steps, batch=args.batch, seq=args.seq, gate=args.gate,
               entropy_nats=language()[2], runs={})
    t0 = time.time()
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, kernel in (("fla", fla_chunk_kda), ("kdalab", kdalab.chunk_kda)):
            losses = train(kernel, seed, args.steps, args.batch, args.seq, lb, data)
            rec["runs"][f"{name}_seed{seed}"] = losses
            print(f"[{time.time() - t0:6.1f} s] {name} seed {seed}: loss {losses[0]:.3f} -> {losses[-1]:.3f}",
                  flush=True)
            Path(args.out).write_text(json.dumps(rec, indent=1))
    seeds = [int(s) for s in args.seeds.split(",")]
    def gap(a, b):  # past the first third: where the curves have left ln 256
        return curve_gap(rec["runs"][a], rec["runs"][b], start=args.steps // 3)

    rec["kernel_gap"] = {s: gap(f"fla_seed{s}", f"kdalab_seed{s}") for s in seeds}
    if len(seeds) > 1:
        rec["seed_gap"] = {k: gap(f"{k}_seed{seeds[0]}", f"{k}_seed{seeds[1]}") for k in ("fla", "kdalab")}
    rec["final_smoothed"] = {k: moving_mean(v)[-1] for k, v in rec["runs"].items()}
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: rec[k] for k in ("kernel_gap", "seed_gap", "final_smoothed", "entropy_nats") if k in rec}),
          flush=True)
    assert math.isfinite(rec["final_smoothed"][f"kdalab_seed{seeds[0]}"])


if __name__ == "__main__":
    main()
