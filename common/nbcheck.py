"""What a reader sees in a notebook: every cell that draws shows an image.

- :func:`missing_figures` lists the cells of a notebook (executed or committed)
  that call a figure function (common.notebook.FIGURES, or any plot_* of
  common.plotting) but show no image.
- :func:`execute` runs a notebook with nbclient, timing it, and returns the
  executed notebook.
- As a pytest plugin (registered by the checkout's conftest.py) it makes
  every nbval cell that draws fail when it produced no image, which nbval's
  ``--nbval-lax`` would never look at, and starts each notebook's kernel on the
  checkout the notebook belongs to (:func:`kernel_env`).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")


def _figure_call():
    from .notebook import FIGURES

    names = "|".join(sorted(FIGURES))
    return re.compile(rf"(?:\bnb\.(?:{names})|\bplot_\w+)\(")


def draws(source: str) -> bool:
    """Does a code cell call a function that draws? (Comments don't count.)"""
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    return bool(_figure_call().search(code))


def has_image(outputs) -> bool:
    return any(any(t in (o.get("data") or {}) for t in IMAGE_TYPES) for o in outputs or [])


def figure_problem(source: str, outputs) -> str | None:
    """Why a cell that draws does not show its figure, or None."""
    if draws(source) and not has_image(outputs):
        first = source.strip().splitlines()[0] if source.strip() else ""
        return f"cell `{first}` draws a figure but shows no image"
    return None


def missing_figures(nb) -> list[str]:
    """Problems of a notebook (an nbformat node or a dict): cells that draw
    without an image."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        why = figure_problem("".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"],
                             cell.get("outputs"))
        if why:
            out.append(f"cell {i}: {why}")
    return out


def errors(nb) -> list[str]:
    """Error outputs and unexecuted code cells of a notebook."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if cell.get("execution_count") is None:
            out.append(f"cell {i} was not executed")
        for o in cell.get("outputs") or []:
            if o.get("output_type") == "error":
                out.append(f"cell {i}: {o.get('ename')}: {o.get('evalue')}")
    return out


def kernel_env(path, base=None) -> dict:
    """The environment of a kernel that runs the notebook ``path``: the notebook named
    (common.notebook.NOTEBOOK_ENV: its chapter's check cell checks that stage) and its checkout first on
    PYTHONPATH, so that the kernel imports the tree under test, whatever the virtual environment's
    editable install points to."""
    from .notebook import NOTEBOOK_ENV
    from .paths import checkout_of

    env = dict(os.environ if base is None else base)
    env[NOTEBOOK_ENV] = str(Path(path).resolve())
    root = checkout_of(path)
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if x and Path(x).resolve() != root])
    return env


def execute(path, *, timeout: int = 900, cwd=None):
    """Run a notebook top to bottom in a fresh kernel of this Python, on its own checkout
    (:func:`kernel_env`). Returns (executed notebook, seconds)."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    t0 = time.time()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd or path.parent)}}).execute(env=kernel_env(path))
    return nb, time.time() - t0


# ---- pytest plugin: each notebook's kernel on its checkout; cells that draw show an image ----


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    """nbval starts a notebook's kernel when its first cell is set up, with this process's environment:
    for that moment the environment is the notebook's (:func:`kernel_env`), then it is put back."""
    nbfile = getattr(item, "parent", None)
    path = getattr(nbfile, "path", None)
    if path is None or Path(path).suffix != ".ipynb" or getattr(nbfile, "kernel", "n/a") is not None:
        return (yield)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(kernel_env(path, saved))
    try:
        return (yield)
    finally:
        os.environ.clear()
        os.environ.update(saved)



@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    outputs = getattr(item, "test_outputs", None)
    cell = getattr(item, "cell", None)
    if outputs is not None and cell is not None and getattr(cell, "cell_type", "code") == "code":
        why = figure_problem(cell.source, outputs)
        if why:
            raise AssertionError(f"{item.name}: {why} (is the notebook's matplotlib backend inline?)")
    return result
