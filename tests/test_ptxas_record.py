"""What ptxas gives the last stage's kernels is recorded (scripts/ptxas_record.py, results/cpu/ptxas_*.json)
for the sources as they are: every instantiation, its registers and spill bytes; those the op launches with
its defaults spill nothing."""

import json
import re
import sys

import pytest

from common.build import sources_hash
from common.paths import REPO_ROOT, RESULTS_DIR, STAGES_DIR
from common.stages import STAGE_DIRS, last_stage

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import ptxas_record  # noqa: E402

RECORDS = sorted((RESULTS_DIR / "cpu").glob("ptxas_*.json"))


def test_the_last_stage_has_a_record():
    assert RESULTS_DIR / "cpu" / f"ptxas_{STAGE_DIRS[last_stage()]}.json" in RECORDS, \
        "no ptxas record of the last stage: python scripts/ptxas_record.py"


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_the_record_is_of_todays_sources_and_the_defaults_spill_nothing(path):
    data = json.loads(path.read_text())
    stage = data["meta"]["stage"]
    assert data["meta"]["sources_hash"] == sources_hash(STAGES_DIR / stage), \
        f"{stage}'s sources changed since {path.name} was recorded: python scripts/ptxas_record.py"
    rows = data["rows"]
    defaults = [r for r in rows if r["op_default"]]
    assert defaults and all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in defaults), \
        [r["kernel"] for r in defaults if r["spill_stores"] or r["spill_loads"]]
    assert all(isinstance(r["registers"], int) and r["registers"] <= 255 for r in rows)
    # every kernel the sources define has its instantiations in the record
    src = "\n".join(f.read_text() for f in (STAGES_DIR / stage).glob("*.cuh"))
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
