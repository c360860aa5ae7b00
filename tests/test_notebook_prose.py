"""Each stage notebook reads as a chapter: at most 700 words of markdown prose.

The count: the notebook's markdown cells joined, ``` fenced blocks dropped, lines starting with '|' (tables)
dropped, the rest split on whitespace.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LIMIT = 700

STAGES = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def prose_words(nb: dict) -> int:
    """Words of the notebook's markdown prose, tables and fenced code blocks aside."""
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = "\n".join(line for line in text.split("\n") if not line.lstrip().startswith("|"))
    return len(text.split())


def words_of(stage: str) -> int:
    return prose_words(json.loads((NOTEBOOKS / f"{stage}.ipynb").read_text()))


def test_the_stage_notebooks_are_found():
    assert "00_naive" in STAGES and len(STAGES) >= 10


@pytest.mark.parametrize("stage", STAGES)
def test_stage_notebook_prose_within_limit(stage):
    n = words_of(stage)
    assert n <= LIMIT, f"{stage}: {n} words of markdown prose, more than {LIMIT}"


def test_the_count_drops_tables_and_fenced_blocks():
    nb = {"cells": [{"cell_type": "markdown", "source": ["one two\n", "| a | b |\n", "```\nx y z\n```\nthree"]},
                    {"cell_type": "code", "source": ["not counted"]}]}
    assert prose_words(nb) == 3


TC_CHAPTERS = [s for s in STAGES if int(s[:2]) >= 5]  # the tensor-core chapters (issue 37)


def idea_picture(nb: dict) -> str | None:
    """What shows the chapter's idea before its build: a fenced diagram in a markdown cell, or a code cell that
    draws one (``plot_...``); None if the chapter reaches ``## Build`` without either."""
    for c in nb["cells"]:
        s = "".join(c["source"])
        if c["cell_type"] == "markdown":
            if s.lstrip().startswith("## Build"):
                return None
            if re.search(r"```\n.+?```", s, flags=re.S):
                return "a fenced diagram"
        elif re.search(r"\bplot_\w+\(", s):
            return "a drawn figure"
    return None


@pytest.mark.parametrize("stage", TC_CHAPTERS)
def test_every_tensor_core_chapter_pictures_its_idea_before_its_build(stage):
    nb = json.loads((NOTEBOOKS / f"{stage}.ipynb").read_text())
    assert idea_picture(nb), f"{stage}: no picture of the idea (a fenced diagram or a plot_ call) before '## Build'"


def test_the_picture_check_finds_a_chapter_without_one():
    """Planted: chapter 12 with its diagram taken out fails; a diagram after the build does not count."""
    nb = json.loads((NOTEBOOKS / "12_softplus.ipynb").read_text())
    assert idea_picture(nb) == "a fenced diagram"
    for c in nb["cells"]:
        if c["cell_type"] == "markdown":
            c["source"] = [re.sub(r"```.*?```", "", "".join(c["source"]), flags=re.S)]
    assert idea_picture(nb) is None
    nb["cells"].append({"cell_type": "markdown", "source": ["```\na picture too late\n```"]})
    assert idea_picture(nb) is None
