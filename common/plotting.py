"""The plots of the notebooks and the tour: region profiles as stacked bars and
latency curves. One colour per region name across every stage, so the same
phase looks the same in every figure."""

from __future__ import annotations

import matplotlib

if not matplotlib.get_backend().lower().startswith(("module://", "nbagg", "ipympl", "widget")):
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_PALETTE = plt.get_cmap("tab20").colors


def _region_colors(names):
    known = {}
    for i, n in enumerate(sorted(set(names))):
        known[n] = _PALETTE[i % len(_PALETTE)]
    return known


def plot_profile(profiles: dict, unit: str = "s", *, title: str = "Where the time goes", ax=None,
                 normalize: bool = False):
    """Stacked bars: one bar per label (stage), one segment per region.

    profiles: {label: {region: value}}; unit: "s", "ms" or "cycles".
    With ``normalize`` each bar is shown as fractions of its total.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(1.8 + 1.6 * len(profiles), 4.2))
    regions = []
    for prof in profiles.values():
        regions += [r for r in prof if r not in regions]
    colors = _region_colors(regions)
    labels = list(profiles)
    scale = 1e3 if unit == "s" else 1.0
    shown_unit = "ms" if unit == "s" else unit
    for x, lab in enumerate(labels):
        prof = profiles[lab]
        total = sum(prof.values()) or 1.0
        bottom = 0.0
        for r in regions:
            val = prof.get(r, 0.0)
            val = val / total if normalize else val * scale
            ax.bar(x, val, bottom=bottom, color=colors[r], label=r, width=0.6, edgecolor="white", linewidth=0.5)
            bottom += val
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("fraction of total" if normalize else shown_unit)
    ax.set_title(title)
    handles, names = ax.get_legend_handles_labels()
    seen = {}
    for h, n in zip(handles, names):
        seen.setdefault(n, h)
    ax.legend(seen.values(), seen.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.figure.tight_layout()
    return ax


def plot_latency(rows, *, x: str = "T", y: str = "ms", by: str = "stage", title: str = "Latency",
                 ax=None, logy: bool = True, logx: bool = True, xlabel: str | None = None,
                 ylabel: str | None = None, style: dict | None = None):
    """One line per value of ``by`` through the points (row[x], row[y])."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    groups: dict = {}
    for r in rows:
        if r.get(y) is None:
            continue
        groups.setdefault(r[by], []).append((r[x], r[y]))
    for name, pts in groups.items():
        pts.sort()
        kw = (style or {}).get(name, {})
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(name), **kw)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def plot_bars(rows, *, x: str, y: str, by: str, title: str = "", ax=None, logy: bool = True, ylabel=None):
    """Grouped bars: one group per value of ``x`` (e.g. a shape), one bar per ``by``."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.2))
    xs = []
    bys = []
    for r in rows:
        if r[x] not in xs:
            xs.append(r[x])
        if r[by] not in bys:
            bys.append(r[by])
    width = 0.8 / max(len(bys), 1)
    for j, b in enumerate(bys):
        vals = []
        for xv in xs:
            v = [r[y] for r in rows if r[x] == xv and r[by] == b and r.get(y) is not None]
            vals.append(v[0] if v else 0.0)
        ax.bar([i + j * width for i in range(len(xs))], vals, width=width, label=str(b))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(xs))], [str(v) for v in xs], rotation=20, fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel or y)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
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
