"""The default code reads alone: in every stage, the lines that compile only in
an ablation build (inside `#ifdef KDA_X` of one of its ABLATIONS, or the `#else`
of its `#ifndef`) are at most 10% of its kernel sources. An alternative too long
for that lives in the stage's ablations.cuh (the ablation file, not counted)."""

import re

import pytest

from common.paths import STAGES_DIR
from common.stages import STAGE_DIRS, load_stage, stage_ids

LIMIT = 0.10
SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
_DIRECTIVE = re.compile(r"\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b(.*)")


def ablation_only_lines(text: str, defines) -> int:
    """Lines compiled only when one of ``defines`` is set (directives not counted)."""
    stack, n = [], 0  # per open conditional: "ab" (an ablation's branch), "def" (the default's), None
    for line in text.splitlines():
        m = _DIRECTIVE.match(line)
        if m:
            kw, rest = m.groups()
            named = any(re.search(rf"\b{d}\b", rest) for d in defines)
            if kw == "ifdef":
                stack.append("ab" if named else None)
            elif kw == "ifndef":
                stack.append("def" if named else None)
            elif kw == "if":
                stack.append(("def" if "!" in rest else "ab") if named else None)
            elif kw == "else" and stack and stack[-1]:
                stack[-1] = "def" if stack[-1] == "ab" else "ab"
            elif kw == "elif" and stack and stack[-1]:
                stack[-1] = "ab"
            elif kw == "endif" and stack:
                stack.pop()
            continue
        if "ab" in stack:
            n += 1
    return n


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
