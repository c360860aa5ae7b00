"""FlashKDA beside the stages: the contract wrapper (validation before any GPU,
the [B, H, V, K] <-> [B, H, K, V] state transpose), finding a build, and the
reports preferring FlashKDA measured beside the stages over the anchor."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from common import bench, fla_ref, report, results
from common.inputs import make_inputs


def _inputs(K=128, V=128, gate="bounded", dtype=torch.bfloat16, B=1, T=3, H=2):
    return make_inputs(B, T, H, K, V, seed=0, dtype=dtype, gate=gate, chunk_size=16)


# --- (a) validation comes first, so it runs on a CPU ---------------------------------------------------------------

@pytest.mark.parametrize("kw, msg", [
    (dict(K=64, V=64), "K = V = 128"),
    (dict(K=128, V=64), "K = V = 128"),
    (dict(gate="softplus"), "bounded gate"),
    (dict(dtype=torch.float32), "bf16"),
])
def test_flashkda_forward_refuses_what_it_cannot_take(kw, msg, monkeypatch):
    monkeypatch.delitem(sys.modules, "flash_kda", raising=False)  # no FlashKDA: refused before importing it
    with pytest.raises(ValueError, match=msg):
        fla_ref.flashkda_forward(**_inputs(**kw))


def test_flashkda_forward_refuses_a_lower_bound_out_of_range():
    kw = _inputs()
    kw["lower_bound"] = -6.0
    with pytest.raises(ValueError, match="lower_bound"):
        fla_ref.flashkda_forward(**kw)


def test_bench_flashkda_raises_with_the_reason(monkeypatch):
    monkeypatch.setattr(bench, "flashkda_available", lambda: (True, ""))
    with pytest.raises(RuntimeError, match="K = V = 128"):
        bench.bench_stage("flashkda", dict(B=1, T=64, H=2, K=64, V=64))
    monkeypatch.setattr(bench, "flashkda_available", lambda: (False, "FlashKDA needs a GPU"))
    rows = bench.sweep(["flashkda"], [dict(B=1, T=64, H=2, K=128, V=128)])
    assert rows == [dict(stage="flashkda", B=1, T=64, H=2, K=128, V=128, error="FlashKDA needs a GPU")]


# --- (c) the state transpose --------------------------------------------------------------------------------------

def _fake_flash_kda(seen: dict):
    """A stand-in for FlashKDA's package: records its arguments and writes a
    known, non-symmetric final state in FlashKDA's [B, H, V, K] layout."""
    mod = types.ModuleType("flash_kda")

    def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
            cu_seqlens=None):
        seen.update(q=q, scale=scale, out=out, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                    initial_state=initial_state, final_state=final_state)
        out.fill_(1.0)
        if final_state is not None:
            final_state.copy_(torch.arange(final_state.numel(), dtype=torch.float32).reshape(final_state.shape))

    mod.fwd = fwd
    return mod


def test_flashkda_forward_transposes_the_states(monkeypatch):
    seen = {}
    monkeypatch.setitem(sys.modules, "flash_kda", _fake_flash_kda(seen))
    kw = _inputs(B=2, H=3)
    h0 = kw["initial_state"]  # ours: [B, H, K, V]
    o, S = fla_ref.flashkda_forward(**kw)
    B, H, K, V = h0.shape
    # FlashKDA got its layout, [B, H, V, K], contiguous fp32, for both states
    assert tuple(seen["initial_state"].shape) == (B, H, V, K) and seen["initial_state"].is_contiguous()
    assert seen["initial_state"].dtype == torch.float32 and seen["final_state"].dtype == torch.float32
    assert torch.equal(seen["initial_state"], h0.transpose(-1, -2))
    # and its final state comes back in ours, [B, H, K, V]
    written = torch.arange(B * H * V * K, dtype=torch.float32).reshape(B, H, V, K)
    assert tuple(S.shape) == (B, H, K, V) and S.dtype == torch.float32
    assert torch.equal(S, written.transpose(-1, -2))
    assert o is seen["out"] and o.dtype == torch.bfloat16 and tuple(o.shape) == tuple(kw["v"].shape)
    assert seen["scale"] == pytest.approx(128 ** -0.5) and seen["lower_bound"] == -5.0
    assert tuple(seen["dt_bias"].shape) == (H, K) and seen["A_log"].dtype == torch.float32


def test_flashkda_forward_without_states(monkeypatch):
    seen = {}
    monkeypatch.setitem(sys.modules, "flash_kda", _fake_flash_kda(seen))
    kw = _inputs()
    kw.update(initial_state=None, output_final_state=False)
    o, S = fla_ref.flashkda_forward(**kw)
    assert S is None and seen["initial_state"] is None and seen["final_state"] is None


@pytest.mark.gpu
def test_flashkda_against_the_fp64_reference():
    """On a GPU with FlashKDA built: o and the final state (transposed back)
    against fp64, within twice the bf16 tolerance (measured on the H200:
    6.1e-3 on o, 5.3e-3 on the state, at worst; without the transpose back
    the state's error is 1.4)."""
    from common.checks import check_flashkda, flashkda_cases
    from common.metrics import tolerance

    ok, why = fla_ref.flashkda_available()
    if not ok:
        pytest.skip(why)
    for case in flashkda_cases():
        for r in check_flashkda(case):
            assert r["err_ref"] <= 2 * tolerance("bf16"), (case.id, r)


# --- finding a build ----------------------------------------------------------------------------------------------

def test_use_flashkda_build_puts_the_build_and_the_checkout_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "build").mkdir()
    assert fla_ref.flashkda_built(tmp_path / "build") is None
    (tmp_path / "build" / "flash_kda_C.so").write_bytes(b"")
    assert fla_ref.flashkda_built(tmp_path / "build") == tmp_path / "build" / "flash_kda_C.so"
    dirs = fla_ref.use_flashkda_build(tmp_path / "src", build_dir=tmp_path / "build")
    assert dirs == [str(tmp_path / "build"), str(tmp_path / "src")] and sys.path[:2] == dirs
    monkeypatch.setenv(fla_ref.FLASHKDA_SRC_ENV, "elsewhere")
    assert fla_ref.flashkda_src() == fla_ref.REPO_ROOT / "elsewhere"


def test_the_build_script_builds_where_fla_ref_looks():
    text = (fla_ref.REPO_ROOT / "scripts" / "build_flashkda.py").read_text()
    assert "FLASHKDA_BUILD_DIR" in text and 'name="flash_kda_C"' in text


# --- (b) the reports: measured beside the stages first, the anchor elsewhere ---------------------------------------

SHAPE_A = dict(B=1, T=1024, H=64, K=128, V=128)  # the tensor-core regime's shape
SHAPE_B = dict(B=8, T=1024, H=64, K=128, V=128)
ANCHOR = Path("h200-2099-01-01.json")


@pytest.fixture
def recorded(monkeypatch):
    """Synthetic results: stage 07 at two shapes, FlashKDA measured beside it
    at the first only (an error row at the second); an anchor with FlashKDA
    at both."""
    tc = {"meta": dict(device="NVIDIA H200", date="2099-01-02 10:00 UTC", commit="abc123", command="x"),
          "rows": [dict(stage="07_movm_register", **SHAPE_A, fwd_ms=0.25, fwd_graph_ms=0.21),
                   dict(stage="07_movm_register", **SHAPE_B, fwd_ms=1.3, fwd_graph_ms=1.2),
                   dict(stage="FlashKDA", **SHAPE_A, fwd_ms=0.2, fwd_graph_ms=0.111),
                   dict(stage="FlashKDA", **SHAPE_B, error="out of memory")]}
    checks = {"meta": dict(device="NVIDIA H200", date="2099-01-02 09:00 UTC", commit="abc123", command="x"),
              "rows": [dict(stage="FlashKDA", output="o", err_ref=6.1e-3, err_prev=None, prev=None, tol=5e-3,
                            ok=False, cases=4),
                       dict(stage="FlashKDA", output="S", err_ref=4.9e-3, err_prev=None, prev=None, tol=5e-3,
                            ok=True, cases=4)]}
    anchor = {"date": "2099-01-01", "device": "NVIDIA H200, torch x",
              "accuracy_vs_fp64": {"flashkda": {"o": [0.0056, 0.0058], "S": [0.0048, 0.005]}},
              "rows": [dict(B=1, T=1024, H=64, D=128, flashkda_ms=0.188, fla_ms=0.25),
                       dict(B=8, T=1024, H=64, D=128, flashkda_ms=0.851, fla_ms=1.7)]}
    files = {"tc_stages": tc, "checks": checks}
    state = {"files": files}
    monkeypatch.setattr(results, "recorded", lambda name, device_dir="h200": state["files"].get(name)
                        if device_dir == "h200" else None)
    monkeypatch.setattr(results, "newest_anchor", lambda: (anchor, ANCHOR))
    return state


def _tc_cells(table: str) -> dict:
    lines = [line.strip("|").split("|") for line in table.strip().splitlines()]
    head = [c.strip() for c in lines[0]]
    return {r[0].strip(): dict(zip(head, (c.strip() for c in r))) for r in lines[2:]}


def test_measured_flashkda_rows_carry_the_run(recorded):
    rows = results.measured_flashkda_rows()
    assert len(rows) == 1 and rows[0]["stage"] == "FlashKDA (measured)"
    assert rows[0]["date"].startswith("2099-01-02") and rows[0]["commit"] == "abc123"


def test_anchor_fills_in_only_where_flashkda_was_not_measured(recorded):
    fk = [r for r in results.anchor_rows() if r["stage"].startswith("FlashKDA")]
    assert [bench.shape_label(r) for r in fk] == [bench.shape_label(SHAPE_B)]
    assert fk[0]["stage"] == "FlashKDA (anchor h200-2099-01-01)"
    both = {bench.shape_label(r): r for r in results.flashkda_rows()}
    assert both[bench.shape_label(SHAPE_A)]["stage"] == "FlashKDA (measured)"
    assert bench.best_ms(both[bench.shape_label(SHAPE_A)]) == 0.111
    assert bench.best_ms(both[bench.shape_label(SHAPE_B)]) == 0.851


def test_report_tables_prefer_the_measured_flashkda(recorded):
    cells = _tc_cells(report.tc_markdown())
    col = "FlashKDA (measured; anchor h200-2099-01-01 where marked)"
    assert cells[bench.shape_label(SHAPE_A)][col] == "0.111"
    assert cells[bench.shape_label(SHAPE_B)][col] == "0.851 (anchor)"
    row = report._flashkda_ref_row(SHAPE_A)
    assert row["stage"] == "FlashKDA (measured)" and row["fwd_ms"] == 0.111 and row["err_ref"] == 6.1e-3
    assert "2099-01-02" in row["where"] and "abc123" in row["where"]
    assert "| FlashKDA (measured) | 6.1e-03 (o), 4.9e-03 (state) |" in report.correctness_markdown()
    stage = report.stage_measured_markdown("07_movm_register")
    assert "FlashKDA ms (measured; anchor h200-2099-01-01 where marked)" in stage and "0.851 (anchor)" in stage


def test_report_falls_back_to_the_anchor(recorded):
    recorded["files"] = {"tc_stages": {**recorded["files"]["tc_stages"],
                                       "rows": recorded["files"]["tc_stages"]["rows"][:2]}}
    cells = _tc_cells(report.tc_markdown())
    col = "FlashKDA (anchor h200-2099-01-01)"
    assert cells[bench.shape_label(SHAPE_A)][col] == "0.188" and cells[bench.shape_label(SHAPE_B)][col] == "0.851"
    row = report._flashkda_ref_row(SHAPE_A)
    assert row["stage"] == "FlashKDA (anchor h200-2099-01-01)" and row["fwd_ms"] == 0.188
    assert row["err_ref"] == 0.0058 and "anchor" in row["where"]
    assert "FlashKDA" not in report.correctness_markdown()


def test_all_measured_needs_no_anchor(recorded):
    tc = recorded["files"]["tc_stages"]
    tc["rows"][3] = dict(stage="FlashKDA", **SHAPE_B, fwd_ms=0.9, fwd_graph_ms=0.8)
    cells = _tc_cells(report.tc_markdown())
    assert cells[bench.shape_label(SHAPE_B)]["FlashKDA (measured)"] == "0.8"
    assert "anchor" not in report.tc_markdown()


def test_notebook_figure_labels_measured_and_anchor(recorded, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from common import notebook

    monkeypatch.setattr(notebook, "_GATHERED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the recorded figures, also on a GPU
    ax, table = notebook.tc_latency(["07"])
    assert table.loc[bench.shape_label(SHAPE_A), "FlashKDA (measured)"] == 0.111
    assert table.loc[bench.shape_label(SHAPE_B), "FlashKDA (anchor h200-2099-01-01)"] == 0.851
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "FlashKDA (measured)" in labels and "FlashKDA (anchor h200-2099-01-01)" in labels
    import matplotlib.pyplot as plt

    plt.close("all")


# --- gpu_run: FlashKDA's rows join the tensor-core file --------------------------------------------------------------

def test_gpu_run_merges_flashkda_rows(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setenv("OUT", str(tmp_path))
    spec = importlib.util.spec_from_file_location("kdalab_gpu_run", fla_ref.REPO_ROOT / "scripts" / "gpu_run.py")
    gpu_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_run)
    meta = dict(device="d", date="t", commit="c", command="bench stages")
    results.save(tmp_path / "tc.json", [dict(stage="07_movm_register", **SHAPE_A, fwd_ms=0.2)], meta)
    results.save(tmp_path / "fk.json", [dict(stage="FlashKDA", **SHAPE_A, fwd_ms=0.1)], dict(meta, command="fk"))
    gpu_run.merge_flashkda(tmp_path / "tc.json", tmp_path / "fk.json")
    gpu_run.merge_flashkda(tmp_path / "tc.json", tmp_path / "fk.json")  # twice: no duplicate rows
    data = results.load(tmp_path / "tc.json")
    assert [r["stage"] for r in data["rows"]] == ["07_movm_register", "FlashKDA"]
    assert data["meta"]["command"] == "bench stages; FlashKDA: fk"
