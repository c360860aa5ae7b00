"""The plots of the notebooks and the tour: region profiles, latency curves,
grouped bars, the fragment maps of stage 07, and stage 08's paths side by side
and its fused kernel's timeline per chunk.

- No backend is chosen here: a notebook's own (``%matplotlib inline``, VS Code,
  nbconvert, nbval) shows every figure, and the command line picks Agg itself.
- One colour per region name in every figure: a region belongs to a phase
  family of the chunked algorithm (DESIGN.md section 3), one hue per family,
  and its shade within the family is fixed by REGION_COLORS below, whatever
  else a figure shows.
- A profile is drawn as each bar's shares (one bar per stage and kernel or
  direction), with the bar's total written beside it, so a 20 ms bar and a
  0.2 ms bar are equally readable.
"""

from __future__ import annotations

import zlib

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgba

# Phase families: colormap -> region names, in the order their shades are given.
_FAMILIES = {
    "Blues": ["fwd: pre-stage", "K1: load+pre-stage", "fused prepare: decay columns", "bwd: pre-stage adjoint"],
    "Oranges": ["fwd: WY transform", "K1: L/Aqk products", "K1: inverse", "K1: w/u + store", "bwd: WY adjoint",
                "bwd: WY/Aqk adjoint"],
    "Greens": ["fwd: Aqk", "bwd: autograd", "bwd: recompute"],
    "Reds": ["fwd: recurrence", "K2: w@S", "K2: qd@S", "K2: qd@S + Aqk@vcorr", "K2: o store", "bwd: recurrence",
             "bwd: reverse recurrence"],
    "Purples": ["K2: vcorr", "K2: Aqk@vcorr", "K2: kr^T@vcorr", "K2: S decay", "K2: S update", "K2: S to bf16"],
    "Greys": ["K2: loads / barriers", "K2: wait for operands", "K2 load warp: wait for a free slot",
              "K2 load warp: issue cp.async", "K2 producer: wait (free slot, barrier)",
              "K2 producer: issue loads (+ stage rows, fused)", "fused prepare: team barrier"],
}


def _shades(cmap: str, n: int):
    """n shades of a sequential colormap between light and dark, interleaved so
    that neighbours in the list differ most."""
    cm = plt.get_cmap(cmap)
    levels = [0.4 + 0.5 * i / max(n - 1, 1) for i in range(n)]
    order = levels[0::2] + levels[1::2]
    return [cm(x) for x in order]


REGION_COLORS = {name: color for cmap, names in _FAMILIES.items() for name, color in zip(names, _shades(cmap, len(names)))}
_FALLBACK = plt.get_cmap("tab10").colors


def region_color(name: str):
    """The colour of a region name, the same in every figure. A name no family
    lists (a region a student adds) gets a fixed colour from its hash."""
    return REGION_COLORS.get(name) or _FALLBACK[zlib.crc32(name.encode()) % len(_FALLBACK)]


# tab10 without its grey (index 7): grey is FLA's, and stage 07 beside FLA must be told apart;
# a dark teal for the tenth stage (09), a navy for 10, a maroon for 11 and a dark olive for 12, so that no two
# stages share a colour
_STAGE_COLORS = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7] + [(0.0, 0.4, 0.4), (0.1, 0.15, 0.45),
                                                                                   (0.5, 0.0, 0.0), (0.35, 0.4, 0.0)]


def series_color(label: str):
    """One colour per stage (by its number) and per reference, in every figure:
    "07_movm_register (B1 ...)" and "07_movm_register" share a colour; FLA is
    grey, FlashKDA black."""
    if label.startswith("FLA"):
        return (0.45, 0.45, 0.45, 1.0)
    if label.startswith("FlashKDA"):
        return (0.0, 0.0, 0.0, 1.0)
    if label[:2].isdigit():
        return _STAGE_COLORS[int(label[:2]) % len(_STAGE_COLORS)]
    return _FALLBACK[zlib.crc32(label.encode()) % len(_FALLBACK)]


def format_ms(ms: float) -> str:
    """A latency as a reader would say it: "0.21 ms", "24.9 ms", "12.3 s"."""
    return f"{ms:.3g} ms" if ms < 1e3 else f"{ms / 1e3:.3g} s"


def bar_group(region: str) -> str:
    """The bar a region is drawn in: the text before its colon ("fwd", "bwd",
    "K1", "K2", "K2 load warp"). Regions of different kernels or directions
    are not added up: their times are per block of different grids, or run
    in parallel."""
    return region.split(":", 1)[0].strip() if ":" in region else ""


def split_bars(label: str, prof: dict) -> dict:
    """{label group: {region: value}}: one bar per kernel or direction."""
    out: dict = {}
    for region, v in prof.items():
        g = bar_group(region)
        out.setdefault(f"{label} {g}".strip(), {})[region] = v
    return out


def format_total(value: float, unit: str) -> str:
    """A bar's total: wall time for unit "s", else clock64 cycles ("2.6e5 cycles")."""
    if unit == "s":
        return format_ms(value * 1e3)
    mant, exp = f"{value:.2g}".split("e") if "e" in f"{value:.2g}" else (f"{value:.2g}", None)
    return (f"{mant}e{int(exp)}" if exp is not None else mant) + " cycles"


def plot_profile(profiles: dict, unit: str = "s", *, title: str = "Where the time goes", ax=None,
                 min_label: float = 0.07):
    """One horizontal bar per entry of ``profiles`` ({bar label: {region: value}}),
    showing each region's share of the bar; the bar's total is written at its
    right ("ms" of wall time for unit "s", clock64 "cycles" otherwise).
    Segments wider than ``min_label`` carry their region's short name."""
    labels = list(profiles)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.9 + 0.5 * len(labels)))
    seen = {}
    for y, lab in enumerate(labels):
        prof = {r: v for r, v in profiles[lab].items() if v > 0}
        total = sum(prof.values())
        left = 0.0
        for region, v in prof.items():
            share = v / total
            bar = ax.barh(y, share, left=left, color=region_color(region), edgecolor="white", linewidth=0.8,
                          height=0.7)
            seen.setdefault(region, bar)
            if share >= min_label:
                short = region.split(":", 1)[-1].strip()
                r, g, b, _ = to_rgba(region_color(region))
                ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"  # readable on dark shades
                ax.text(left + share / 2, y, short, ha="center", va="center", fontsize=7, clip_on=True, color=ink)
            left += share
        ax.text(1.01, y, format_total(total, unit), va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the bar's total (total at the right: "
                  + ("wall time" if unit == "s" else "clock64 cycles per block") + ")")
    ax.set_title(title)
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=4, frameon=False)
    ax.figure.tight_layout()
    return ax


def plot_latency(rows, *, x: str = "T", y: str = "ms", by: str = "stage", title: str = "Latency",
                 ax=None, logy: bool = True, logx: bool = True, xlabel: str | None = None,
                 ylabel: str | None = None, style: dict | None = None):
    """One line per value of ``by`` through the points (row[x], row[y]). A row
    with ``recorded`` true is drawn as a hollow marker joined by a dashed
    segment, so live and recorded points of one series read as one curve."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7.2, 4.4))
    groups: dict = {}
    for r in rows:
        if r.get(y) is None:
            continue
        groups.setdefault(r[by], []).append((r[x], r[y], bool(r.get("recorded"))))
    any_recorded = False
    for name, pts in groups.items():
        pts.sort()
        kw = dict(color=series_color(str(name)), **(style or {}).get(name, {}))
        xs, ys, rec = [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
        ax.plot([], [], marker="o", label=str(name), **kw)  # the legend entry
        for i in range(len(pts) - 1):
            dashed = rec[i] or rec[i + 1]
            ax.plot(xs[i:i + 2], ys[i:i + 2], linestyle="--" if dashed else kw.get("linestyle", "-"),
                    color=kw["color"])
        for xi, yi, ri in pts:
            ax.plot([xi], [yi], marker="o", color=kw["color"], markerfacecolor="white" if ri else kw["color"])
        any_recorded |= any(rec)
    if any_recorded:
        ax.plot([], [], marker="o", linestyle="--", color="0.4", markerfacecolor="white", label="hollow, dashed: recorded")
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.figure.tight_layout()
    return ax


def plot_bars(rows, *, x: str, y: str, by: str, title: str = "", ax=None, logy: bool = True, ylabel=None,
              value_fmt: str = ".3g", value_rotation: float = 90, value_fontsize: float = 6):
    """Grouped bars: one group per value of ``x`` (e.g. a shape), one bar per ``by``. Each bar carries its
    value (so that steps of 1.02-1.3x, which a log axis hides, can be read; ``value_fmt``, written at
    ``value_rotation`` degrees) and a missing one says "n/a"; the log axis is labelled at 1, 2 and 5 of
    every decade."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4.8))
    xs = []
    bys = []
    for r in rows:
        if r[x] not in xs:
            xs.append(r[x])
        if r[by] not in bys:
            bys.append(r[by])
    width = 0.8 / max(len(bys), 1)
    present = [r[y] for r in rows if r.get(y)]
    floor = min(present) / 2 if present else 1.0
    for j, b in enumerate(bys):
        at, vals = [], []
        for i, xv in enumerate(xs):
            v = [r[y] for r in rows if r[x] == xv and r[by] == b and r.get(y) is not None]
            at.append(i + j * width)
            vals.append(v[0] if v else None)
        ax.bar(at, [v or 0.0 for v in vals], width=width, label=str(b), color=series_color(str(b)),
               alpha=0.55 if "anchor" in str(b) or "recorded" in str(b) else 1.0)
        for xpos, v in zip(at, vals):
            text, ypos = ("n/a", floor) if v is None else (format(v, value_fmt), v)
            ax.text(xpos, ypos * (1.06 if logy else 1.0), text, rotation=value_rotation, ha="center", va="bottom",
                    fontsize=value_fontsize)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(xs))], [str(v) for v in xs], rotation=20, ha="right",
                  fontsize=8)
    if logy:
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor / 1.5, top=(max(present) if present else 1.0) * 3)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.figure.tight_layout()
    return ax


MEMORY_GAIN = 1.5  # an ablation whose peak memory grows this much shows it beside its time (its gain is memory)


def plot_ablation(bought, full_ms: dict, *, title: str = "What each idea bought", unit: str = "cycles", axes=None):
    """Two panels for a stage's ablations (common.ablation.bought rows).

    Left: what each idea bought, as the time with that one idea turned off over
    the stage's time with every idea on, at the same shape (the shape is in the
    label: an idea is measured where it runs), one bar per idea and direction,
    with both times written at the bar's end; a line at 1 (above it: the idea
    pays); a log axis only when the ratios span more than 10x; an idea whose gain is
    memory (peak MEMORY_GAIN x or more without it) gets a grey bar of its peak memory
    too. ``full_ms`` is kept for the caller's title. Right: the profile region each
    idea shrank most (ablation.bought), with and without it (per block, ``unit``, log
    axis), in that region's colour."""
    import textwrap

    n_dirs = 1 + any(b.get("bwd_ms_without") is not None for b in bought)
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(13, 1.8 + 0.62 * max(len(bought) * n_dirs, 3)),
                                 gridspec_kw={"width_ratios": [3, 2]})
    ax, bx = axes
    wrap = lambda t: "\n".join(textwrap.wrap(t, 46))  # noqa: E731
    shapes = {b.get("shape") for b in bought}
    labels, vals, colors, notes = [], [], [], []
    for y in ("fwd", "bwd"):
        for b in bought:
            if b.get(f"{y}_ms_without") is None:
                continue
            bad = "  CHECKS FAILED" if not b["checks_ok"] else ""
            at = f", {b['shape']}" if len(shapes) > 1 and b.get("shape") else ""
            labels.append(wrap(f"{b['idea']} ({y}{at})"))
            vals.append(b[f"{y}_speedup"])
            colors.append(region_color(b["region"]) if b.get("region") else "#999999")
            notes.append(f"x{b[f'{y}_speedup']:.2f}  ({format_ms(b[f'{y}_ms_without'])} without, "
                         f"{format_ms(b[f'{y}_ms_with'])} with){bad}")
    for b in bought:  # an idea whose gain is memory: its peak memory too (MEMORY_GAIN or more)
        if b.get("peak_mb_with") and b.get("peak_mb_without", 0) / b["peak_mb_with"] >= MEMORY_GAIN:
            at = f", {b['shape']}" if len(shapes) > 1 and b.get("shape") else ""
            labels.append(wrap(f"{b['idea']} (peak memory{at})"))
            vals.append(b["peak_mb_without"] / b["peak_mb_with"])
            colors.append("#bbbbbb")
            notes.append(f"x{vals[-1]:.2f}  ({b['peak_mb_without']:.0f} MB without, {b['peak_mb_with']:.0f} MB with)")
    ys = list(range(len(labels)))
    what = "time (grey: peak memory)" if "#bbbbbb" in colors else "time"
    ax.barh(ys, vals, color=colors, height=0.7)
    for yv, v, n in zip(ys, vals, notes):
        ax.text(v, yv, "  " + n, va="center", fontsize=8)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(ys, labels, fontsize=7)
    ax.invert_yaxis()
    if vals and max(vals) / min(vals) > 10:
        ax.set_xscale("log")
        ax.set_xlim(min(min(vals), 1.0) / 1.5, max(vals) * 8)
        ax.set_xlabel(f"{what} without the idea / with it (log axis; above 1: the idea pays)")
    else:
        ax.set_xlim(0, max(vals + [1.0]) * 2.3)
        ax.set_xlabel(f"{what} without the idea / with it (above 1: the idea pays)")
    ax.set_title(title, fontsize=10)
    moved = [b for b in bought if b.get("region")]
    ys = list(range(len(moved)))
    bx.barh([y - 0.18 for y in ys], [max(b["region_with"], 1.0) for b in moved], height=0.36,
            color=[region_color(b["region"]) for b in moved], label="with the idea")
    bx.barh([y + 0.18 for y in ys], [max(b["region_without"], 1.0) for b in moved], height=0.36,
            color=[region_color(b["region"]) for b in moved], alpha=0.45, hatch="//", label="without it")
    bx.set_yticks(ys, [wrap(f"{b['region']} (without {b['idea']})"
                            + ("" if b.get("region_shrank", True) else "; no region shrank")) for b in moved],
                  fontsize=7)
    bx.invert_yaxis()
    bx.set_xscale("log")
    lo = min([max(b["region_with"], 1.0) for b in moved] + [max(b["region_without"], 1.0) for b in moved] or [1.0])
    hi = max([b["region_with"] for b in moved] + [b["region_without"] for b in moved] or [10.0])
    bx.set_xlim(lo / 4, hi * 2)
    bx.set_xlabel(("seconds" if unit == "s" else "cycles per block (clock64)") + ", log axis")
    bx.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    bx.set_title("where it shows: the region each idea shrank most", fontsize=10)
    ax.figure.tight_layout()
    return ax


def fragment_owner(layout: str, row: int, col: int) -> int:
    """The lane of a warp that holds element (row, col) of a 16x16 tile in an
    SM80 m16n8k16 fragment: layout "C" (accumulator, row = m, col = n) or "B"
    (B operand, row = k, col = n). Lane = 4 g + t with g = lane / 4, t = lane % 4:
    C puts rows on g and column pairs on t, B puts columns on g and row pairs on t."""
    if layout == "C":
        return 4 * (row % 8) + (col % 8) // 2
    if layout == "B":
        return 4 * (col % 8) + (row % 8) // 2
    raise ValueError(f"layout must be 'C' or 'B', got {layout!r}")


def plot_fragments(ax=None):
    """Two 16x16 maps of lane ownership: a matrix X held as an MMA accumulator
    (C) and the same X as the B operand of A @ X. Each cell shows the lane that
    holds that element; equal lanes have equal colours. The B map is the C map
    transposed, which is what movmatrix (an 8x8 transpose across the warp)
    repairs."""
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(11, 5.4))
    cmap = plt.get_cmap("hsv")
    for a, layout, title in ((ax[0], "C", "X as accumulator (C): lane holding X[m, n]"),
                             (ax[1], "B", "X as B operand: lane that must hold X[k, n]")):
        own = np.array([[fragment_owner(layout, r, c) for c in range(16)] for r in range(16)])
        a.imshow(own, cmap=cmap, vmin=0, vmax=32, alpha=0.55)
        for r in range(16):
            for c in range(16):
                a.text(c, r, str(own[r, c]), ha="center", va="center", fontsize=6)
        a.set_xticks(range(16))
        a.set_yticks(range(16))
        a.tick_params(labelsize=6)
        a.set_xlabel("n (column)")
        a.set_ylabel("m (row)" if layout == "C" else "k (row)")
        a.set_title(title, fontsize=9)
        a.axhline(7.5, color="k", lw=1)  # the four 8x8 quadrants movmatrix works on
        a.axvline(7.5, color="k", lw=1)
    ax[0].figure.tight_layout()
    return ax


def _ratio_colors():
    """The colour scale of a time or a memory against a reference: log2 of the
    ratio, green below 1 (faster, smaller), red above, from 1/2 to 8."""
    from matplotlib.colors import TwoSlopeNorm

    return plt.get_cmap("RdYlGn_r"), TwoSlopeNorm(vmin=-1.0, vcenter=0.0, vmax=3.0)


def plot_paths(cells: dict, *, shapes, columns, ref: str, mem_columns, title: str = "", row_labels=None,
               axes=None):
    """A kernel's paths side by side, one row per shape: left, the time of
    each column (a path, the previous stage, a reference) written in its cell
    and coloured by its ratio to column ``ref`` at the same shape, the fastest
    of a row in bold; right, the peak memory of ``mem_columns`` ([(heading,
    column)]) coloured the same way against ``ref``'s. ``cells`` maps (shape,
    column) to {"ms": ..., "peak_mb": ...}; a missing cell (a path that does
    not exist for the shape) is left grey. ``row_labels`` replaces the shape
    labels (e.g. to mark recorded rows)."""
    import math

    import numpy as np

    cmap, norm = _ratio_colors()
    cmap = cmap.with_extremes(bad="#eeeeee")
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(14.5, 1.7 + 0.5 * len(shapes)),
                                 gridspec_kw={"width_ratios": [len(columns), len(mem_columns) + 0.5]})
    ax, mx = axes

    def value(sh, col, key):
        return cells.get((sh, col), {}).get(key)

    def grid(a, heads, key, bold=None):
        """heads: [(heading, column)]; cells coloured by log2(value / ref's)."""
        img = np.full((len(shapes), len(heads)), np.nan)
        for i, sh in enumerate(shapes):
            r = value(sh, ref, key)
            for j, (_, col) in enumerate(heads):
                v = value(sh, col, key)
                if v is not None and r:
                    img[i, j] = math.log2(v / r)
        im = a.imshow(np.ma.masked_invalid(img), cmap=cmap, norm=norm, aspect="auto")
        for i, sh in enumerate(shapes):
            for j, (_, col) in enumerate(heads):
                v = value(sh, col, key)
                dark = False
                if not np.isnan(img[i, j]):
                    r, g, b, _ = cmap(norm(img[i, j]))
                    dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.45
                a.text(j, i, "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.3g}", ha="center",
                       va="center", fontsize=8, color="white" if dark else "black",
                       fontweight="bold" if bold is not None and bold.get(sh) == col else "normal")
        a.set_xticks(range(len(heads)), [h for h, _ in heads], fontsize=8)
        a.set_yticks(range(len(shapes)), row_labels or list(shapes), fontsize=8)
        a.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False)
        a.set_xticks(np.arange(-0.5, len(heads)), minor=True)
        a.set_yticks(np.arange(-0.5, len(shapes)), minor=True)
        a.grid(which="minor", color="white", linewidth=2)
        a.tick_params(which="minor", length=0)
        return im

    fastest = {}
    for sh in shapes:
        have = [(value(sh, c, "ms"), c) for c in columns if value(sh, c, "ms") is not None]
        if have:
            fastest[sh] = min(have)[1]
    im = grid(ax, [(c, c) for c in columns], "ms", fastest)
    ax.set_title((title + "\n" if title else "") + f"GPU ms per call (bold: the fastest of the row); "
                 f"colour: time / {ref}'s", fontsize=10)
    grid(mx, mem_columns, "peak_mb")
    mx.set_yticklabels([])
    mx.set_title(f"peak MB above the inputs, one call\ncolour: memory / {ref}'s", fontsize=10)
    cb = ax.figure.colorbar(im, ax=list(axes), fraction=0.025, pad=0.02)
    ticks = [-1, 0, 1, 2, 3]
    cb.set_ticks(ticks, labels=[f"{2.0 ** t:g}x" for t in ticks])
    cb.ax.tick_params(labelsize=8)
    cb.set_label(f"against {ref} (log scale)", fontsize=8)
    return ax


def plot_chunk_timeline(bars: dict, *, labels: dict | None = None, title: str = "", ax=None,
                        min_label: float = 0.04, unit: str = "cycles per chunk", brace=None):
    """Stacked horizontal bars on one absolute axis: {bar: {region: value}},
    each region in its colour, in the order given; segments wider than
    ``min_label`` of the widest bar carry ``labels[region]`` (default: the
    region's name after its colon), and their value too when wider than
    2.5 times that; each bar's total at its right. ``brace``: (bar, first
    region, text): a bracket above that bar from the start of that region to
    the bar's end, with the text above it."""
    labels = labels or {}
    names = list(bars)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 2.6 + 0.85 * len(names)))
    top = max(sum(v for v in b.values() if v > 0) for b in bars.values())
    seen = {}
    for y, name in enumerate(names):
        left = 0.0
        for region, v in bars[name].items():
            if v <= 0:
                continue
            bar = ax.barh(y, v, left=left, color=region_color(region), edgecolor="white", linewidth=0.8, height=0.62)
            seen.setdefault(region, bar)
            if v >= min_label * top:
                r, g, b, _ = to_rgba(region_color(region))
                ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
                text = labels.get(region, region.split(":", 1)[-1].strip())
                if v >= 2.5 * min_label * top:
                    text += "\n" + format_total(v, "cycles").replace(" cycles", "")
                ax.text(left + v / 2, y, text, ha="center", va="center", fontsize=7, color=ink, clip_on=True)
            left += v
        ax.text(left + 0.01 * top, y, f"{format_total(left, 'cycles').replace(' cycles', '')} {unit}",
                va="center", fontsize=8)
    if brace is not None:
        name, first, text = brace
        y = names.index(name)
        regions = list(bars[name])
        x0 = sum(v for v in list(bars[name].values())[:regions.index(first)] if v > 0)
        x1 = sum(v for v in bars[name].values() if v > 0)
        yb = y - 0.36  # just above the bar (the y axis is inverted)
        ax.plot([x0, x0, x1, x1], [yb + 0.04, yb, yb, yb + 0.04], color="black", lw=0.9)
        ax.text((x0 + x1) / 2, yb - 0.03, text, ha="center", va="bottom", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.22)
    ax.set_xlabel(f"clock64 {unit} (mean over blocks)")
    ax.set_title(title, fontsize=10)
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3,
              frameon=False)
    ax.figure.tight_layout()
    return ax
