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
