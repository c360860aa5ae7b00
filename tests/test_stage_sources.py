"""The default code reads alone: in every stage, the lines that compile only in
an ablation build (inside `#ifdef KDA_X` of one of its ABLATIONS, or the `#else`
of its `#ifndef`) are at most 10% of its kernel sources. An alternative too long
for that lives in the stage's ablations.cuh (the ablation file, not counted)."""

import re

import pytest

from common.paths import STAGES_DIR
from common.stages import STAGE_DIRS, load_stage, stage_ids, strip_ablations

LIMIT = 0.10
SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
_DIRECTIVE = re.compile(r"\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b")


def ablation_only_lines(text: str, defines) -> int:
    """Lines compiled only when one of ``defines`` is set: the code lines that the
    default build's view (common.stages.strip_ablations) leaves out."""
    code = lambda t: sum(1 for line in t.splitlines() if not _DIRECTIVE.match(line))  # noqa: E731
    return code(text) - code(strip_ablations(text, defines))


def kernel_sources(sid):
    d = STAGES_DIR / STAGE_DIRS[sid]
    return [f for f in sorted(d.iterdir()) if f.suffix in SUFFIXES and not f.name.startswith("ablations")]


STAGES = [s for s in stage_ids() if getattr(load_stage(s), "ABLATIONS", ())]


@pytest.mark.parametrize("sid", STAGES)
def test_ablation_only_code_is_at_most_a_tenth_of_the_kernel_sources(sid):
    defines = [a.define for a in load_stage(sid).ABLATIONS]
    files = kernel_sources(sid)
    only = sum(ablation_only_lines(f.read_text(), defines) for f in files)
    total = sum(len(f.read_text().splitlines()) for f in files)
    assert only <= LIMIT * total, f"stage {sid}: {only} of {total} kernel-source lines compile only in ablation builds"


def test_the_count_sees_both_branches():
    text = "a\n#ifdef KDA_X\nb\nc\n#else\nd\n#endif\n#ifndef KDA_X\ne\n#else\nf\n#endif\n#ifdef KDA_PROFILE\ng\n#endif\n"
    assert ablation_only_lines(text, ["KDA_X"]) == 3  # b, c and f; not the default's d and e, not the profile's g
    planted = "x\n" * 80 + "#ifdef KDA_X\n" + "y\n" * 20 + "#endif\n"
    assert ablation_only_lines(planted, ["KDA_X"]) > LIMIT * len(planted.splitlines())
