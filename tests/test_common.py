"""The shared helpers: build discovery, ptxas parsing, results store, timing, plots."""

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from common import build, plotting, results, timing
from common.metrics import rel_err


def test_cuda_home_found_behind_a_wrapper(tmp_path, monkeypatch):
    """An nvcc on PATH that is a wrapper script: its folder is not the toolkit."""
    home = build.find_cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit on this machine")
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec {home}/bin/nvcc \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    assert build.find_cuda_home() == str(Path(home).resolve())


def test_parse_ptxas():
    text = """ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 1024 bytes smem, 380 bytes cmem[0]
"""
    rows = build._parse_ptxas(text)
    assert rows == [dict(kernel="kernel", registers=40, smem_bytes=1024, stack_bytes=8, spill_stores=4,
                         spill_loads=4)]


def test_results_roundtrip(tmp_path):
    meta = results.metadata(command="pytest")
    assert {"device", "date", "commit", "command", "torch"} <= set(meta)
    p = results.save(tmp_path / "x" / "r.json", [dict(stage="00_naive", ms=1.5)], meta)
    data = results.load(p)
    assert data["rows"][0]["ms"] == 1.5 and data["meta"]["command"] == "pytest"
    assert "recorded on" in results.label(data["meta"])
    json.loads(p.read_text())


def test_time_cpu_counts_repetitions():
    calls = []
    out = timing.time_cpu(lambda: calls.append(1), warmup=2, reps=4)
    assert len(calls) == 6 and out["reps"] == 4 and out["ms"] >= 0


def test_plots_draw():
    ax = plotting.plot_profile({"a": {"r1": 1.0, "r2": 2.0}, "b": {"r1": 0.5}}, "cycles")
    assert len(ax.patches) == 3  # bar a: two regions, bar b: one
    widths = sorted(round(p.get_width(), 6) for p in ax.patches)
    assert widths == [round(1 / 3, 6), round(2 / 3, 6), 1.0]  # shares of each bar's total
    texts = [t.get_text() for t in ax.texts]
    assert "3 cycles" in texts and "0.5 cycles" in texts  # each bar's total beside it
    ax = plotting.plot_latency([dict(stage="s", T=64, ms=1.0), dict(stage="s", T=128, ms=2.0)], y="ms")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["s"]
    pts = {(float(x), float(y)) for line in ax.lines for x, y in zip(line.get_xdata(), line.get_ydata())}
    assert pts == {(64.0, 1.0), (128.0, 2.0)}


def test_recorded_points_are_hollow_and_dashed():
    rows = [dict(stage="s", T=64, ms=1.0), dict(stage="s", T=128, ms=2.0, recorded=True)]
    ax = plotting.plot_latency(rows, y="ms")
    segments = [line for line in ax.lines if len(line.get_xdata()) == 2]
    assert [line.get_linestyle() for line in segments] == ["--"]
    hollow = [line for line in ax.lines if len(line.get_xdata()) == 1 and line.get_markerfacecolor() == "white"]
    assert [float(line.get_xdata()[0]) for line in hollow] == [128.0]
    assert "hollow, dashed: recorded" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_profile_totals_in_the_unit_of_the_axis():
    ax = plotting.plot_profile({"00 fwd": {"fwd: Aqk": 0.0123}}, "s")
    assert "12.3 ms" in [t.get_text() for t in ax.texts]
    assert "wall time" in ax.get_xlabel()


def test_a_region_has_one_colour_in_every_figure():
    a = plotting.plot_profile({"x": {"fwd: pre-stage": 1.0, "fwd: Aqk": 1.0}}, "s")
    b = plotting.plot_profile({"y": {"fwd: Aqk": 5.0, "fwd: recurrence": 1.0, "bwd: autograd": 2.0}}, "s")

    def color(ax, region):
        leg = ax.get_legend()
        (h,) = [h for h, t in zip(leg.legend_handles, leg.get_texts()) if t.get_text() == region]
        return tuple(h.get_facecolor())

    assert color(a, "fwd: Aqk") == color(b, "fwd: Aqk") == tuple(plotting.region_color("fwd: Aqk"))
    assert plotting.region_color("a new region") == plotting.region_color("a new region")


def test_every_stage_region_has_a_colour_of_its_phase_family():
    from common.stages import load_stage, stage_ids

    missing = [r for s in stage_ids() for r in load_stage(s).SPEC.regions if r not in plotting.REGION_COLORS]
    assert not missing
    colors = [plotting.REGION_COLORS[r] for r in load_stage("07").SPEC.regions]
    assert len(set(colors)) == len(colors)  # the regions of one stage are told apart


def test_every_stage_and_reference_has_its_own_series_colour():
    from common.stages import STAGE_DIRS

    labels = list(STAGE_DIRS.values()) + ["FLA chunk_kda", "FlashKDA (measured)"]
    colors = [tuple(round(x, 3) for x in plotting.to_rgba(plotting.series_color(n))) for n in labels]
    assert len(set(colors)) == len(colors), dict(zip(labels, colors))
    grey = [n for n, c in zip(labels[:-2], colors) if abs(c[0] - c[1]) < 0.05 and abs(c[1] - c[2]) < 0.05]
    assert not grey, f"stages drawn grey like FLA: {grey}"
    assert plotting.series_color("07_movm_register (B1 H64 K128)") == plotting.series_color("07_movm_register")


def test_rel_err_rejects_nan_and_shape_mismatch():
    assert rel_err(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")
    with pytest.raises(ValueError):
        rel_err(torch.zeros(2), torch.zeros(3))


def test_fragment_maps_are_transposes():
    """The picture of notebook 07: the B-operand lane map is the accumulator map transposed."""
    from common.plotting import fragment_owner

    for r in range(16):
        for c in range(16):
            assert fragment_owner("B", r, c) == fragment_owner("C", c, r)
    # every lane holds 8 elements of a 16x16 tile in either layout
    for layout in ("C", "B"):
        counts = [0] * 32
        for r in range(16):
            for c in range(16):
                counts[fragment_owner(layout, r, c)] += 1
        assert counts == [8] * 32
    with pytest.raises(ValueError, match="layout"):
        fragment_owner("A", 0, 0)


def test_frag_check_rejects_bad_arguments_before_any_kernel():
    from common.stages import load_stage

    stage = load_stage("07")
    with pytest.raises(ValueError, match="CUDA"):
        stage.frag_check(torch.zeros(16, 16, dtype=torch.bfloat16), torch.zeros(16, 16))
    with pytest.raises(TypeError, match="torch tensors"):
        stage.frag_check([[0.0]], torch.zeros(16, 16))


def test_split_bars_gives_each_kernel_and_the_load_warp_its_own_bar():
    out = plotting.split_bars("06", {"K1: inverse": 1.0, "K2: w@S": 3.0, "K2 load warp: issue cp.async": 2.0})
    assert out == {"06 K1": {"K1: inverse": 1.0}, "06 K2": {"K2: w@S": 3.0},
                   "06 K2 load warp": {"K2 load warp: issue cp.async": 2.0}}
    assert list(plotting.split_bars("00", {"fwd: Aqk": 1.0, "bwd: autograd": 2.0})) == ["00 fwd", "00 bwd"]


def test_short_rows_without_graph_replay_are_labelled_eager():
    from common.notebook import _eager_mark

    assert _eager_mark({"bwd_ms": 2.8, "bwd_graph_ms": None}, "bwd") == " eager"  # FLA's autograd backward
    assert _eager_mark({"bwd_ms": 2.8, "bwd_graph_ms": 2.1}, "bwd") == ""
    assert _eager_mark({"bwd_ms": 8600.0, "bwd_graph_ms": None}, "bwd") == ""  # long call: overhead is noise
    assert _eager_mark({"fwd_ms": None}, "fwd") == ""


def test_best_ms_prefers_graph_replay():
    from common.bench import best_ms

    assert best_ms({"fwd_ms": 1.2, "fwd_graph_ms": 0.4}) == 0.4
    assert best_ms({"fwd_ms": 1.2, "fwd_graph_ms": None}) == 1.2
    assert best_ms({"bwd_ms": 3.0}, "bwd") == 3.0
    assert best_ms({"error": "out of memory"}) is None


def test_parse_shape_is_the_inverse_of_shape_label_and_names_a_bad_shape():
    from common import bench

    s = dict(B=8, T=1024, H=64, K=128, V=128)
    assert bench.parse_shape(bench.shape_label(s)) == s
    for bad in ("B8 T1024 H64 K128", "B8 Tx H64 K128 V128", ""):
        with pytest.raises(ValueError, match="a shape is 'B.. T.. H.. K.. V..'"):
            bench.parse_shape(bad)


def test_a_timing_whose_repeats_disagree_says_so():
    """Under load the repeats of one timing spread (a busy 2-core machine gave stage 00 375-1,537 ms against
    7-25 ms idle): the row says so, and a sweep prints it; steady repeats say nothing."""
    import time

    from common import bench

    assert "unsteady" not in timing._summary([10.0, 10.5, 9.8, 11.0, 10.1])
    out = timing._summary([10.0, 30.0, 1.0, 40.0, 10.0])
    assert out["ms"] == 10.0 and out["min_ms"] == 1.0 and out["max_ms"] == 40.0
    assert "from 1 to 40 ms (40.0x" in out["unsteady"] and "load average" in out["unsteady"]
    naps = iter([0.001, 0.001, 0.1, 0.001, 0.001, 0.001])  # the warm-up, then one repeat 100x the others
    out = timing.time_cpu(lambda: time.sleep(next(naps)), warmup=1, reps=5)
    assert out["reps"] == 5 and "unsteady" in out, out
    row = dict(stage="00_naive", B=1, T=64, H=2, K=32, V=32, **{"fwd_" + k: v for k, v in out.items()})
    (msg,) = bench.unsteady(row)
    assert msg.startswith("00_naive at B1 T64 H2 K32 V32, fwd time: its 5 repeats") and "busy" in msg
    assert timing._summary([2.0, 2.0, 5.0], "graph_")["graph_unsteady"]


def test_build_progress_reaches_the_terminal_under_pytest():
    """conftest.py sends the build's progress lines to pytest's terminal with its capture lifted, so a cold
    compile inside `pytest` shows `still compiling (N s)` instead of minutes of silence."""
    import contextlib
    import importlib.util

    from common.paths import REPO_ROOT

    shown, lifted = [], []

    class Plugins:
        def get_plugin(self, name):
            return {"terminalreporter": Terminal(), "capturemanager": Capture()}[name]

    class Terminal:
        def ensure_newline(self):
            pass

        def write_line(self, line):
            shown.append((line, bool(lifted)))

    class Capture:
        @contextlib.contextmanager
        def global_and_fixture_disabled(self):
            lifted.append(1)
            yield
            lifted.pop()

    config = type("Config", (), {"pluginmanager": Plugins()})()
    spec = importlib.util.spec_from_file_location("root_conftest", REPO_ROOT / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    old = build.set_progress(None)
    try:
        build.set_progress(old)
        mod.pytest_configure(config)
        build._say("kda_02: still compiling (15 s)")
    finally:
        build.set_progress(old)
    assert shown == [("[kdalab] kda_02: still compiling (15 s)", True)]


def test_a_build_that_fails_fails_again_in_the_same_process(tmp_path, monkeypatch):
    """torch rebuilds an extension name it has seen in this process only when a source file or a flag changed,
    not a header. A header that stops compiling must fail every call, not only the first, which would let a
    later call import the last module that built (a check passing on yesterday's code)."""
    import sys

    from torch.utils import cpp_extension

    monkeypatch.setattr(build, "BUILD_DIR", tmp_path / "build")
    src = tmp_path / "ext"
    src.mkdir()
    (src / "h.h").write_text("inline int f() { return 1; }\n")
    (src / "m.cpp").write_text('#include "h.h"\n#include <torch/extension.h>\nint g() { return f(); }\n'
                               'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("g", &g); }\n')
    name = build.extension_name("hdr_check", False, None)
    args = dict(quiet=True, extra_cflags=["-Wfatal-errors"])
    assert build.load_extension(src, "hdr_check", ["m.cpp"], **args).g() == 1
    (src / "h.h").write_text("inline int f() { return not C++; }\n")
    for cache in (build._LOADED, cpp_extension.JIT_EXTENSION_VERSIONER.entries, sys.modules):
        cache.pop(name, None)  # as a new process finds them, the module that built still on disk
    for _ in range(2):
        with pytest.raises(build.CompileError):
            build.load_extension(src, "hdr_check", ["m.cpp"], **args)
