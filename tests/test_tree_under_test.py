"""The tree under test is the one imported: notebooks, tests, scripts and the command line of a checkout
run that checkout's code, whatever virtual environment runs them.

A copy of this checkout shares this virtual environment, whose editable install points here. Each test
plants an error in the copy and runs the copy's notebook, test, script or command the way a user does
(`python -P`: no current directory on sys.path, as a console script starts), and must see the copy's
error. The last tests plant a broken stage and a check cell pointed at another stage in the copy's
chapter 00, which nbval must fail.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.paths import REPO_ROOT, checkout_of

PLANT = "planted in the copy"


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """The checkout's files (tracked and new, not ignored) in a temporary folder."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    dst = tmp_path_factory.mktemp("second-clone") / "kdalab"
    for f in files:
        src = REPO_ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    return dst


class planted:
    """Replace ``old`` by ``new`` in one file of the copy for a ``with`` block."""

    def __init__(self, root: Path, rel: str, old: str, new: str):
        self.path, self.old, self.new = root / rel, old, new

    def __enter__(self):
        self.text = self.path.read_text()
        assert self.text.count(self.old) == 1, f"{self.old!r} is not once in {self.path}"
        self.path.write_text(self.text.replace(self.old, self.new))

    def __exit__(self, *exc):
        self.path.write_text(self.text)


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KDALAB_NOTEBOOK", "KDALAB_CHECKOUT")}
    env.update(PYTHONUNBUFFERED="1", KDALAB_BUILD=str(REPO_ROOT / "build"))  # builds are keyed by their sources
    return env


def _run(copy, *args, timeout=600):
    out = subprocess.run([sys.executable, "-P", *args], cwd=copy, capture_output=True, text=True, env=_env(),
                         timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def _pytest(copy, *args, timeout=600):
    return _run(copy, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args, timeout=timeout)


def test_this_venv_imports_another_checkout_by_default(copy):
    """The premise: from the copy, without its conftest or a script's path setup, `common` is the editable
    install's (another checkout), so each test below shows a mechanism at work."""
    rc, out = _run(copy, "-c", "import common.paths as p; print(p.REPO_ROOT)")
    assert rc == 0 and out.strip() and out.strip() != str(copy), out


def test_a_planted_error_in_the_copy_fails_its_tests(copy):
    rc, out = _pytest(copy, "tests/test_metrics.py")
    assert rc == 0, out[-2000:]
    with planted(copy, "common/metrics.py", "    return num / den\n", "    return 0.0\n"):
        rc, out = _pytest(copy, "tests/test_metrics.py")
    assert rc == 1 and "FAILED" in out, out[-2000:]


def test_a_planted_error_in_the_copy_fails_its_notebook(copy):
    """The kernel nbval starts for a notebook imports the notebook's checkout (common.nbcheck.kernel_env)."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("from common import notebook as nb\n"
                                                                     "nb.environment();")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, copy / "notebooks" / "first_cell.ipynb")
    try:
        rc, out = _pytest(copy, "notebooks/first_cell.ipynb")
        assert rc == 0 and "1 passed" in out, out[-2000:]
        with planted(copy, "common/notebook.py", '    gpu = torch.cuda.get_device_name() if',
                     f'    raise RuntimeError("{PLANT}")\n    gpu = torch.cuda.get_device_name() if'):
            rc, out = _pytest(copy, "notebooks/first_cell.ipynb")
        assert rc == 1 and PLANT in out, out[-2000:]
    finally:
        (copy / "notebooks" / "first_cell.ipynb").unlink()


def test_a_planted_error_in_the_copy_reaches_its_scripts_and_command_line(copy):
    with planted(copy, "common/__init__.py", "\nfrom .paths import", f'\nprint("{PLANT}")\nfrom .paths import'):
        rc, out = _run(copy, "scripts/run_notebooks.py", "no-such-notebook")
        assert PLANT in out, out[-2000:]
        # the installed command line, started inside the copy, moves to the copy's
        rc, out = _run(copy, "-c", "import sys; from common.cli import main; sys.argv = ['kdalab', 'list']; "
                                   "sys.exit(main())")
        assert rc == 0 and PLANT in out and f"running the checkout at {copy}" in out, out[-2000:]


def test_every_script_imports_its_own_checkout():
    """Each script puts its checkout first on sys.path before it imports `common` or `kdalab`."""
    bad = []
    for path in sorted((REPO_ROOT / "scripts").glob("*.py")):
        tree = ast.parse(path.read_text())
        first_insert = first_import = None
        for node in ast.walk(tree):
            line = getattr(node, "lineno", None)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.path.insert":
                if "ROOT" in ast.unparse(node.args[1]) or "parent.parent" in ast.unparse(node.args[1]):
                    first_insert = min(first_insert or line, line)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(m.split(".")[0] in ("common", "kdalab") for m in mods):
                    first_import = min(first_import or line, line)
        if first_import is not None and (first_insert is None or first_insert > first_import):
            bad.append(f"{path.name}: imports common/kdalab at line {first_import} before its sys.path.insert")
    assert not bad, "\n".join(bad)


def test_the_checkout_of_a_path():
    assert checkout_of(REPO_ROOT / "notebooks" / "00_naive.ipynb") == REPO_ROOT
    assert checkout_of(REPO_ROOT) == REPO_ROOT and checkout_of(Path("/")) is None


# ---- the chapter's check cell, in the copy -----------------------------------------------------------


def _chapter00(copy, *args):
    return _pytest(copy, "notebooks/00_naive.ipynb", *args, timeout=900)


def test_a_planted_bug_in_stage_00_fails_its_notebook(copy):
    """o off by 2x stage 00's tolerance: the chapter's check cell raises, nbval fails on it."""
    with planted(copy, "stages/00_naive/stage.py",
                 "return o.to(c.out_dtype), (S if c.output_final_state else None)",
                 "return (o * (1 + 1.6e-6)).to(c.out_dtype), (S if c.output_final_state else None)"):
        rc, out = _chapter00(copy)
    assert rc == 1 and "CheckFailed" in out and "00_naive (live on cpu)" in out and " o: " in out, out[-3000:]


def test_a_check_cell_pointed_at_another_stage_fails(copy):
    with planted(copy, "notebooks/00_naive.ipynb", 'nb.error_table(\\"00\\")', 'nb.error_table(\\"01\\")'):
        rc, out = _chapter00(copy)
    assert rc == 1 and "00_naive.ipynb checks stage 01" in out, out[-3000:]
