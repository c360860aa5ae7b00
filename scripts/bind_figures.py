"""Write docs/figures.json: for every measured figure in the prose, the record it
quotes (common.prose). Entries that still hold are kept, also where the rest of a figure's
line was edited (the same figure with the same words around it); a figure without one (new,
or whose record changed) gets the record its context names best, among those whose
value rounds to it; a figure no record gives is listed, to be written in
NOT_MEASURED below with the reason, or fixed in the prose.

    python scripts/bind_figures.py            # update the index, print what changed
    python scripts/bind_figures.py --check    # only say what is wrong (as tests/test_prose.py)
    python scripts/bind_figures.py --rebind   # propose every entry afresh (keeps NOT_MEASURED)

Review the diff of docs/figures.json: each proposed entry says its score and how many
records tied ("why").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import prose  # noqa: E402

# (document, text around the figure) -> why no record gives it. The text must contain the figure.
NOT_MEASURED = {
    ("stages/12_softplus/README.md", "the bound is 1.02x"): "the bound issue 36 sets (common.report.SUMMIT_BOUND)",
    ("docs/PERF_NOTES.md", "0.02 ms"): "the byte count at the measured copy rate (a derived estimate)",
    ("docs/PERF_NOTES.md", "about 1.8e3 cycles per"): "a prediction from the instruction mix, before the first call",
    ("docs/PERF_NOTES.md", "that is 0.61 ms"): "the difference of the two times the sentence quotes (1.5863 - 0.9809 ms)",
    ("docs/PERF_NOTES.md", "0.06-0.13 ms"): "an estimate of the chain's floor (1-2 us per chunk step x 64 chunks)",
    ("docs/PERF_NOTES.md", "0.69 GB"): "the byte count of K1's workspace",
    ("docs/PERF_NOTES.md", "0.54 GB"): "the byte count of the inputs",
    ("docs/PERF_NOTES.md", "0.13 GB"): "the byte count of o",
    ("docs/PERF_NOTES.md", "16.8 MB"): "the byte count of one bf16 input",
    ("docs/PERF_NOTES.md", "3-5e3 cycles"): "the prediction before stage 08 was built",
    ("stages/05_cute_bf16/README.md", "5.5e34"): "e^80, a constant",
    ("stages/05_cute_bf16/README.md", "3.4e38"): "the largest bf16 value",
    ("docs/PERF_NOTES.md", "4 x 16.8 MB"): "the byte count of the four bf16 inputs",
    ("docs/PERF_NOTES.md", "(16.8 MB)"): "the byte count of o",
    ("docs/PERF_NOTES.md", "2 x 4.2 MB"): "the byte count of h0 and the final state",
    ("docs/PERF_NOTES.md", "about 92 MB"): "the byte count of the whole call (a sum of the above)",
    ("docs/GUIDE.md", "330 s that lease"): "the time limit of a run that did not finish (results/h200/notebooks.json, note)",
    ("docs/DESIGN.md", "v2 26.8 / 73.1 ms"): "the seed's own figures on an H20 (shared/seed), not a run of this project",
    ("docs/PERF_NOTES.md", "measured K1 at 27% and K2 at 71%"): "the seed's own H20 profile (shared/seed)",
    ("stages/05_cute_bf16/README.md", "K2 at 71% and K1 at 27%"): "the seed's own H20 profile (shared/seed)",
    ("stages/06_ws_pipeline/README.md", "took 24% of K2"): "the seed's own H20 profile (shared/seed)",
    ("stages/06_ws_pipeline/README.md", "and 7.2% once"): "the seed's own H20 profile (shared/seed)",
    ("notebooks/06_ws_pipeline.ipynb", "at 24% of K2, and 7.2% once"): "the seed's own H20 profile (shared/seed)",
    ("docs/PERF_NOTES.md", "throughput 85%"): "an Nsight Compute reading of that session (not stored in results/)",
    ("stages/10_smem_diet/README.md", "throughput 85%"): "an Nsight Compute reading (PERF_NOTES outcome 11; not stored in results/)",
    ("stages/04_warp/README.md", "gradients at 1.03e-5 from fp64"): "the figure of a report (issue 22), not reproduced",
    ("stages/04_warp/README.md", "h0), 8.5e-6 before"): "the figure of a report (issue 22), not reproduced",
    ("docs/PERF_NOTES.md", "0.7-1.0 ms at long+short"): "a prediction before the hybrid's first call",
    ("docs/PERF_NOTES.md", "(59.7-62 us, sometimes 67.8 us)"): "session 14's notes (outcome 19); its records did not reach results/",
    ("docs/PERF_NOTES.md", "stays at 93-97 us"): "session 14's notes (outcome 19); its records did not reach results/",
    ("docs/PERF_NOTES.md", "cost 27% at K = 64"): "session 14's notes (outcome 19); its records did not reach results/",
    # one significant digit and unit-less decimals (issue 35)
    ('docs/GUIDE.md', 'at most 10x the worst error its check'): 'the rule a tolerance is held to (tests/test_tolerances.py MAX_FACTOR)',
    ('docs/GUIDE.md', '("about 2 GB")'): 'an example of a figure, not a measurement',
    ('docs/GUIDE.md', '"within 0.7x" is bound'): 'an example of a figure, not a measurement',
    ('README.md', 'at most 10x the worst error'): 'the rule a tolerance is held to (tests/test_tolerances.py MAX_FACTOR)',
    ('docs/DESIGN.md', '1.65 / 9.49, v9+ws 1.28 / 8.08, v10+ws 1.09 / 7.13, FLA 1.01 / 5.06'): "the seed's own figures on an H20 (shared/seed), not a run of this project",
    ('docs/PERF_NOTES.md', 'the 4.27 TB/s measured copy rate'): "the H200's copy rate measured on 2026-11-29 (shared/DEVICE_NOTES.md), not a results file",
    ('docs/PERF_NOTES.md', 'about 0.6 MFLOP'): 'a FLOP count',
    ('docs/PERF_NOTES.md', '~2.6 GFLOP, 3 us at the 788 TFLOP/s'): 'a FLOP count and its time at the measured bf16 rate (an estimate)',
    ('docs/PERF_NOTES.md', 'At ~1-2 us per chunk step'): 'an estimate of one chunk step',
    ('docs/PERF_NOTES.md', '>= 3x overall'): 'a prediction',
    ('docs/PERF_NOTES.md', '>= 20x over 03 at T >= 512'): 'a prediction',
    ('docs/PERF_NOTES.md', 'close the gap to FLA to ~2-3x'): 'a prediction',
    ('docs/PERF_NOTES.md', 'the ~2 GB workspace round trip at B=8 gone, ~0.7 ms there'): 'a prediction from the byte count',
    ('docs/PERF_NOTES.md', 'about 2 GB. At ~4 TB/s that is ~0.5 ms, some 40%'): 'an estimate from the byte count',
    ('docs/PERF_NOTES.md', 'near 40% of the time'): 'an estimate from the byte count',
    ('docs/PERF_NOTES.md', "(about 40% of stage 07's time at B=8 by the byte"): 'an estimate from the byte count',
    ('docs/PERF_NOTES.md', 'would take about 0.7 ms if the prepare'): 'a prediction',
    ('docs/PERF_NOTES.md', 'slots 40% busy, 0.42 warps issued per scheduler'): 'an Nsight Compute reading (not stored in results/)',
    ('stages/10_smem_diet/README.md', 'issue slots 40% busy'): 'an Nsight Compute reading (PERF_NOTES outcome 11; not stored in results/)',
    ('docs/PERF_NOTES.md', '(8 x 12.5 KB'): 'a byte count',
    ('docs/PERF_NOTES.md', "time at most 0.8x FlashKDA's at every D=128 shape"): 'the target stages 09-10 were built to, not a measurement',
    ('stages/10_smem_diet/README.md', "The target was at most 0.8x FlashKDA's"): 'the target stages 09-10 were built to, not a measurement',
    ('notebooks/10_smem_diet.ipynb', "and at most 0.8x FlashKDA's"): 'the target stages 09-10 were built to, not a measurement',
    ('docs/PERF_NOTES.md', 'would cut that traffic'): 'a count of the shared-memory traffic (a prediction)',
    ('docs/PERF_NOTES.md', '     4x. A large change'): 'a count of the shared-memory traffic (a prediction)',
    ('docs/PERF_NOTES.md', 'threshold max(2048, 4x the mean)'): 'a constant of the rule',
    ('stages/11_varlen/README.md', 'max(2048, 4 x the mean length'): 'a constant of the rule',
    ('docs/PERF_NOTES.md', 'have at most 0.02% wide chunks'): "counted on the CPU by notebook 12 (stage.wide_chunks on the benchmark's inputs), not a results file",
    ('stages/12_softplus/README.md', 'at most 0.02% of the chunks'): "counted on the CPU by notebook 12 (stage.wide_chunks on the benchmark's inputs), not a results file",
    ('docs/PERF_NOTES.md', '10 us slower after the larger shapes'): 'the difference of two recorded times (the rounds of speed_e573e2b.json)',
    ('docs/PERF_NOTES.md', 'an instruction issued every 3.6 cycles'): 'an Nsight Compute reading (not stored in results/)',
    ('docs/PERF_NOTES.md', 'cost K2 about 7% at these shapes'): "K2's cycles in the profiles of outcome 12 (not stored per region in results/)",
    ('docs/PERF_NOTES.md', "The 7% the segments' parameters cost K2"): "K2's cycles in the profiles of outcome 12 (not stored per region in results/)",
    ('docs/PERF_NOTES.md', 'Prediction: the chain\n'): 'a prediction',
    ('docs/PERF_NOTES.md', '~20% shorter; fused8'): 'a prediction',
    ('stages/02_cuda_baseline/README.md', '4x the recurrence work per token'): 'a count of the work per token (a 128 x 128 state against 64 x 64)',
    ('stages/02_cuda_baseline/README.md', 'yet the time is about 7x'): 'against an interpolated figure of the sweep, not a record',
    ('stages/02_cuda_baseline/README.md', 'their states (4 MB)'): 'a byte count',
    ('stages/02_cuda_baseline/README.md', 'should be **at least 3x faster**'): "the seed's expectation (a target)",
    ('stages/02_cuda_baseline/README.md', 'at least 20x faster than stage 03'): "the seed's expectation (a target)",
    ('stages/03_chunk_parallel/README.md', '**at least 3x** over stage 02'): "the seed's expectation (a target)",
    ('stages/03_chunk_parallel/README.md', 'least 20x faster than this stage'): "the seed's expectation (a target)",
    ('stages/03_chunk_parallel/README.md', "the seed's expectation (3x or more over 02)"): "the seed's expectation (a target)",
    ('stages/04_warp/README.md', 'is **>= 20x faster than stage 03'): "the seed's expectation (a target)",
    ('stages/04_warp/README.md', "seed's expectation (20x or more over 03"): "the seed's expectation (a target)",
    ('notebooks/03_chunk_parallel.ipynb', 'seed expected 3x or more'): "the seed's expectation (a target)",
    ('stages/04_warp/README.md', "`dg` is about 3x the float32 token loop's error"): 'the ratio of the two errors of that sentence (1.75e-6, 5.8e-7)',
    ('stages/05_cute_bf16/README.md', "the forward's wall time by about 3%"): "the seed's own H20 profile (shared/seed)",
    ('stages/08_segments/README.md', 'about 1.3 KB per'): 'a byte count',
    ('notebooks/08_segments.ipynb', 'about 1.3 KB per token'): 'a byte count',
    ('docs/PERF_NOTES.md', 'about 1.3 KB per token and head'): 'a byte count',
}

# Evidence below which a proposed entry is marked for review: a figure of two significant digits (a
# coincidence among thousands of records is likely there) that several records give, not taken from the
# figures beside it, whose context names its record weakly.
WEAK_SCORE = 4.0


def stage_of(doc: str):
    m = re.match(r"(?:stages|notebooks)/(\d\d)_", doc)
    return m.group(1) if m else None


def not_measured(fig):
    for (doc, text), why in NOT_MEASURED.items():
        if doc == fig.doc and text in fig.line:
            a = fig.line.index(text)
            if a <= fig.start and fig.end <= a + len(text):
                return why
    return None


def local(at: str, text: str, before: int = 16, after: int = 10) -> str:
    """The words right around a figure in an entry's ``at`` snippet: what identifies it when the rest of its
    line is edited (an entry bound by hand keeps its record then)."""
    i = at.find(text)
    return at if i < 0 else at[max(0, i - before):i + len(text) + after]


def by_hand(e) -> bool:
    """An entry a person bound (its "why" gives a reason), not one the binder proposed ("score ...")."""
    return bool(e.get("why")) and not e["why"].startswith("score")


class Leftovers:
    """The entries of the old index that no figure's key finds any more (their line was edited), and the rules
    that give one of them to a figure of the edited line. Each leftover goes to one figure at most."""

    def __init__(self, entries: dict):
        self.moved = {}  # (masked-line hash, index in line) -> the entry
        self.by_context = {}  # (document, figure, the text right around it) -> the entries
        self.hand = {}  # (document, figure) -> the entries bound by hand
        for k, e in entries.items():
            doc, h, _, i = k.split("|")
            self.moved.setdefault((h, int(i)), e)
            self.by_context.setdefault((doc, e["figure"], local(e["at"], e["figure"].split()[0])), []).append(e)
            if by_hand(e):
                self.hand.setdefault((doc, e["figure"]), []).append(e)
        self.used = set()

    def _one(self, cands):
        cands = [e for e in cands if id(e) not in self.used]
        return cands[0] if len(cands) == 1 else None

    def find(self, f, entry):
        """The leftover entry of figure ``f`` (``entry``: its new key, snippet and figure), or None.

        In order: text moved to another line or document (the same masked line); its line changed elsewhere (the
        one entry with the same figure and words around it); the words around it changed too, but the document
        keeps one unused entry bound by hand for that figure (a person's binding is not re-proposed from scratch,
        which can pick a wrong record among those that round to the figure)."""
        e = self.moved.get((f.key[1], f.key[3]))
        if e is None or id(e) in self.used:
            e = self._one(self.by_context.get((f.doc, entry["figure"], local(entry["at"], f.text)), []))
        if e is None:
            e = self._one(self.hand.get((f.doc, entry["figure"]), []))
        if e is not None:
            self.used.add(id(e))
        return e


def snippet(fig) -> str:
    return fig.line[max(0, fig.start - 40):fig.end + 12].strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--rebind", action="store_true")
    args = p.parse_args(argv)
    if args.check:
        bad = prose.check()
        print("\n".join(bad) or "every figure is its record")
        return 1 if bad else 0

    docs = prose.documents()
    lines = {d: t.splitlines() for d, t in docs}
    figs = prose.all_figures(docs)
    old = {} if args.rebind else prose.load_index()
    table = prose.atoms()
    binder = prose.Binder(table)
    keys = {prose.key_str(f.key) for f in figs}
    left = Leftovers({k: e for k, e in old.items() if k not in keys and "not_measured" not in e})
    out, kept, proposed, missing = [], 0, 0, []
    bound = {}  # figure key -> its entry, values first, so that a ratio can use the figures beside it
    order = sorted(range(len(figs)), key=lambda i: figs[i].kind in ("ratio", "percent"))
    results = [None] * len(figs)
    for i in order:
        f = figs[i]
        k = prose.key_str(f.key)
        why_not = not_measured(f)
        entry = {"key": k, "at": snippet(f), "figure": f"{f.text} {f.unit}".strip()}
        if why_not is not None:
            results[i] = {**entry, "not_measured": why_not}
            continue
        e = old.get(k) or left.find(f, entry)
        if e is not None and "not_measured" not in e:
            if prose.figure_problem(f, e, table) is None:
                results[i] = {**entry, **{x: e[x] for x in ("of", "ratio", "pct", "op", "at_most", "at_least", "min", "max", "fact",
                                                             "from", "why", "review") if x in e}}
                bound[f.key] = results[i]
                kept += 1
                continue
        ctx = prose.context(lines[f.doc], f, stage_of(f.doc), binder.regions)
        near = [table[bound[g.key]["of"]] for g in figs
                if g.doc == f.doc and g.lineno == f.lineno and g.kind == "time" and "of" in bound.get(g.key, {})]
        got = binder.propose(f, ctx, near)
        if got is None:
            missing.append(f)
            continue
        e, s, ties, n = got
        results[i] = {**entry, **e, "why": f"score {s:.1f}, {ties} of {n} candidates tied"}
        if prose.sig_digits(f.text) <= 2 and s < WEAK_SCORE and n > 1 and "from" not in e:
            results[i]["review"] = "weak: two digits, a context that names its record weakly"
        bound[f.key] = results[i]
        proposed += 1
    out = [r for r in results if r is not None]
    prose.INDEX.write_text(json.dumps({"note": "which record each measured figure of the prose quotes: "
                                               "see common/prose.py; written by scripts/bind_figures.py",
                                       "figures": out}, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(figs)} figures: {kept} entries kept, {proposed} proposed, "
          f"{sum('not_measured' in e for e in out)} not measured, {len(missing)} without any record, "
          f"{sum('review' in e for e in out)} marked for review (weak evidence)")
    for f in missing:
        print(f"  NO RECORD {f.doc}:{f.lineno}: {f.text} {f.unit} in: {f.line.strip()[:150]}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
