"""Neighbouring stages diff cleanly: `diff -ru stages/NN stages/NN+1` shows the
later stage's ideas, not churn. Shared helpers live in common/include/, names
come from SPEC (the build's KDA_STAGE_NAME), file lists keep one order."""

import re
import shutil

import pytest

from common.paths import STAGES_DIR
from common.stages import STAGE_DIRS, load_stage, neighbour_diff, stage_ids

# Helpers that never change between stages: defined once in common/include/.
SHARED_HELPERS = {
    "check_tensor": r"\bvoid\s+check_tensor\s*\(",
    "check_shape": r"\bvoid\s+check_shape\s*\(",
    "present": r"\bbool\s+present\s*\(",
    "warp_sum": r"\bfloat\s+warp_sum\s*\(",
    "sigmoid_f": r"\bfloat\s+sigmoid_f\s*\(",
    "softplus_f": r"\bfloat\s+softplus_f\s*\(",
    "allow_smem": r"\bcudaError_t\s+allow_smem\s*\(",
}
CUDA_STAGES = [s for s in stage_ids() if any(f.endswith(".cu") for f in getattr(load_stage(s), "SOURCES", ()))]


def churn(stage_dir) -> list[str]:
    """What in a CUDA stage directory would make its neighbour diff show churn."""
    found = []
    for path in sorted(stage_dir.glob("*")):
        if path.suffix not in (".cu", ".cpp", ".h", ".cuh"):
            continue
        text = path.read_text()
        for name, pat in SHARED_HELPERS.items():
            if re.search(pat, text):
                found.append(f"{path.name}: defines {name} (use common/include/)")
        for m in re.finditer(r'"[^"\n]*\bstage \d\d\b[^"\n]*"', text):
            found.append(f"{path.name}: stage number in a string {m.group(0)} (use KDA_STAGE)")
        for m in re.finditer(r"\bnamespace\s+kda\d\d\b", text):
            found.append(f"{path.name}: stage-numbered {m.group(0)} (use kda_stage)")
    return found


@pytest.mark.parametrize("sid", CUDA_STAGES)
def test_no_churn_in_stage(sid):
    assert churn(STAGES_DIR / STAGE_DIRS[sid]) == []


def test_churn_catches_planted_copies(tmp_path):
    """Negative control: a stage copy with a helper pasted back, a hand-written
    stage string and a numbered namespace is flagged three times."""
    src = STAGES_DIR / STAGE_DIRS["05"]
    dst = tmp_path / "05_copy"
    shutil.copytree(src, dst)
    b = dst / "binding.cpp"
    b.write_text(b.read_text() + '\nbool present(const OptTensor& t) { return t.has_value(); }\n'
                 'void f() { TORCH_CHECK(false, "stage 05 supports only K = 64"); }\n')
    k = dst / "kda.cu"
    k.write_text(k.read_text().replace("namespace kda_stage", "namespace kda05", 1))
    found = churn(dst)
    assert len(found) == 3, found


def test_sources_in_one_order():
    orders = {sid: getattr(load_stage(sid), "SOURCES", None) for sid in CUDA_STAGES}
    assert len({tuple(v) for v in orders.values()}) == 1, orders


@pytest.mark.parametrize("sid", [s for s in stage_ids() if s != "00"])
def test_neighbour_diff_is_counted(sid):
    rows = neighbour_diff(sid)
    assert rows, f"stage {sid} is identical to the previous one?"
    assert all(r["added"] >= 0 and r["removed"] >= 0 for r in rows)
    assert not any(r["file"] == "README.md" for r in rows)


def test_neighbour_diff_counts_a_change(tmp_path, monkeypatch):
    """Negative control: copies of 06 and 07 whose kda.cu differ by one added
    and one changed line count +2 / -1 there, and nothing in identical files."""
    import common.stages as st

    for sid in ("06", "07"):
        shutil.copytree(STAGES_DIR / STAGE_DIRS["06"], tmp_path / STAGE_DIRS[sid])
    k = tmp_path / STAGE_DIRS["07"] / "kda.cu"
    lines = k.read_text().splitlines()
    lines[0] = lines[0] + " (changed)"
    k.write_text("\n".join(lines + ["// one more line"]) + "\n")
    monkeypatch.setattr(st, "STAGES_DIR", tmp_path)
    rows = {r["file"]: r for r in st.neighbour_diff("07")}
    assert list(rows) == ["kda.cu"]
    assert (rows["kda.cu"]["added"], rows["kda.cu"]["removed"]) == (2, 1)


SWITCHED = """a
#ifndef KDA_NO_X
b
#else
c
#endif
#ifdef KDA_PROFILE
p
#ifdef KDA_NO_X
q
#endif
#endif
#if defined(KDA_NO_X) && defined(KDA_NO_Y)
#error no
#elif defined(KDA_NO_Y)
y
#else
d
#endif
#if !defined(KDA_NO_X) || defined(OTHER)
o
#endif
"""


def test_strip_ablations_keeps_the_default_build():
    from common.stages import strip_ablations

    out = strip_ablations(SWITCHED, ["KDA_NO_X", "KDA_NO_Y"]).splitlines()
    # the default branches stay, the switches' code and directives go; other macros' conditionals stay
    assert out == ["a", "b", "#ifdef KDA_PROFILE", "p", "#endif", "d",
                   "#if !defined(KDA_NO_X) || defined(OTHER)", "o", "#endif"]


def test_strip_ablations_negative_controls():
    """With no switches named, nothing is resolved; unbalanced input is refused."""
    from common.stages import strip_ablations

    assert strip_ablations(SWITCHED, []) == SWITCHED
    with pytest.raises(ValueError, match="unbalanced"):
        strip_ablations("#ifndef KDA_NO_X\nb\n", ["KDA_NO_X"])


@pytest.mark.parametrize("sid", ["04", "05", "06"])
def test_lesson_source_has_no_switched_code(sid):
    from common.stages import lesson_source

    defines = [a.define for a in load_stage(sid).ABLATIONS]
    for name in load_stage(sid).SOURCES:
        code = [line for line in lesson_source(sid, name) if not line.lstrip().startswith("//")]
        assert not [line for line in code if any(d in line.split("//")[0] for d in defines)], name


def test_kdalab_diff_is_the_lesson(capsys):
    from common.cli import main

    assert main(["diff", "06", "07"]) == 0
    out = capsys.readouterr().out
    assert "+++ stages/07_movm_register/kda.cu" in out
    # no directive of an ablation switch (06 has five) reaches the lesson's diff
    assert not [line for line in out.splitlines() if line[1:].lstrip().startswith("#") and "KDA_NO_" in line]
