"""What ptxas gives every CUDA stage's kernels is recorded (scripts/ptxas_record.py, results/cpu/ptxas_*.json)
for the sources as they are: every instantiation, its registers and spill bytes. The notebooks' resources
tables read these records instead of compiling each stage a second time; the instantiations the op launches
with its defaults (the last stage's) spill nothing."""

import json
import re
import sys

import pytest

from common.build import sources_hash
from common.paths import REPO_ROOT, RESULTS_DIR, STAGES_DIR
from common.stages import STAGE_DIRS, last_stage, lesson_source

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import ptxas_record  # noqa: E402

RECORDS = sorted((RESULTS_DIR / "cpu").glob("ptxas_*.json"))


def test_every_cuda_stage_has_a_record():
    want = {RESULTS_DIR / "cpu" / f"ptxas_{STAGE_DIRS[s]}.json" for s in ptxas_record.cuda_stages()}
    assert want == set(RECORDS), "ptxas records missing or left over: python scripts/ptxas_record.py"


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_the_record_is_of_todays_sources_and_the_defaults_spill_nothing(path):
    data = json.loads(path.read_text())
    stage = data["meta"]["stage"]
    assert data["meta"]["sources_hash"] == sources_hash(STAGES_DIR / stage), \
        f"{stage}'s sources changed since {path.name} was recorded: python scripts/ptxas_record.py"
    rows = data["rows"]
    if stage == STAGE_DIRS[last_stage()]:  # the op's kernels: what it launches with its defaults spills nothing
        defaults = [r for r in rows if r["op_default"]]
        assert defaults and all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in defaults), \
            [r["kernel"] for r in defaults if r["spill_stores"] or r["spill_loads"]]
    else:
        assert not any("op_default" in r for r in rows)
    assert all(isinstance(r["registers"], int) and r["registers"] <= 255 for r in rows)
    # every kernel the sources define has its instantiations in the record
    src = "\n".join("\n".join(lesson_source(stage[:2], f.name))  # the default build's code (no ablation branch)
                    for f in (STAGES_DIR / stage).iterdir() if f.suffix in (".cu", ".cuh"))
    kernels = set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)\s*\(", src))
    assert kernels and kernels <= {r["name"] for r in rows}, kernels - {r["name"] for r in rows}


def test_the_defaults_are_the_launchers_defaults():
    """The record's op_default is kda.cu with_prep's two marked cases (the bounded gate's, an unbounded gate's)."""
    kda = (STAGES_DIR / STAGE_DIRS[last_stage()] / "kda.cu").read_text()
    marked = re.findall(r"case KDA_PRODUCTS_(\w+) \* 2 \+ (\d): return f\(Prep<KDA_PRODUCTS_\w+, (true|false)>\{\}\);"
                        r"\s*// (?:the bounded|an unbounded) gate's", kda)
    names = {"FACTORED": 0, "PAIRWISE": 1, "AS_NEEDED": 2}
    assert {(names[p], h == "true") for p, _, h in marked} == ptxas_record.DEFAULT_PREP
    assert ptxas_record.describe("void kda_stage::kda_fused_kernel<128, 128, 8, kda_stage::Prep<2, true> >") == \
        dict(name="kda_fused_kernel", template=[128, 128, 8], products="as needed", u_halves=True, op_default=True)


def test_a_notebook_reads_the_record_and_compiles_only_without_one(monkeypatch, capsys):
    """common.notebook.resources takes the record of today's sources (no compile); a record of other sources
    (or none) sends it to ptxas."""
    from common import notebook, results

    sid = last_stage()
    monkeypatch.setattr(notebook, "launches", lambda s: ([], "not recorded"))
    monkeypatch.setattr(notebook, "resource_usage", lambda *a, **k: pytest.fail("compiled although recorded"))
    df = notebook.resources(sid)
    rec = results.recorded(f"ptxas_{STAGE_DIRS[sid]}", "cpu")
    assert len(df) == len(rec["rows"]) and list(df["registers"]) == [r["registers"] for r in rec["rows"]]
    assert "recorded from these sources" in capsys.readouterr().out
    monkeypatch.setattr(notebook, "sources_hash", lambda d: "other sources")
    monkeypatch.setattr(notebook, "resource_usage", lambda *a, **k: [dict(kernel="k", registers=1, smem_bytes=0,
                                                                         stack_bytes=0, spill_stores=0, spill_loads=0)])
    assert list(notebook.resources(sid)["kernel"]) == ["k"]
