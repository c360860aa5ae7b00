"""common/ is a set of layers whose imports go one way (common/layers.py):
every import statement of every common/*.py, also those inside functions, is
checked against the layer table."""

from __future__ import annotations

import ast
from pathlib import Path

from common.layers import LAYER_NAMES, LAYERS, rank

COMMON = Path(__file__).resolve().parent.parent / "common"


def _modules() -> set[str]:
    return {p.stem for p in COMMON.glob("*.py")}


def imports_of(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module of common/) for every import in a file, wherever it stands:
    ``import common.x``, ``from common.x import y``, ``from common import x``,
    ``from . import x``, ``from .x import y``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "common" and (len(parts) > 1 or "__init__" in modules):
                    out.append((node.lineno, parts[1] if len(parts) > 1 else "__init__"))
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                raise AssertionError(f"{path.name}:{node.lineno}: an import from above common/")
            if node.level == 1:
                base = node.module
            elif node.module == "common" or (node.module or "").startswith("common."):
                base = node.module[len("common."):] if "." in node.module else None
            else:
                continue
            if base is None:  # from . import x / from common import x: the package, then x
                if "__init__" in modules:
                    out.append((node.lineno, "__init__"))
                out += [(node.lineno, a.name) for a in node.names if a.name in modules]
            else:
                out.append((node.lineno, base.split(".")[0]))
    return out


def layer_problems(modules: set[str] | None = None, table: dict | None = None,
                   read=lambda m: COMMON / f"{m}.py") -> list[str]:
    """Every breach of the layering, one line each (empty: all well)."""
    modules = _modules() if modules is None else modules
    table = LAYERS if table is None else table
    order = {m: LAYER_NAMES.index(layer) for m, layer in table.items()}
    bad = [f"common/{m}.py is in no layer of common/layers.py" for m in sorted(modules - set(table))]
    bad += [f"common/layers.py names {m}, which is no module of common/" for m in sorted(set(table) - modules)]
    same: dict[str, set] = {}
    for m in sorted(modules & set(table)):
        for line, target in imports_of(read(m), modules):
            if target == m or target == "__init__" and m == "__init__":
                continue
            if target not in table:
                bad.append(f"common/{m}.py:{line}: imports {target}, a module in no layer")
            elif order[target] > order[m]:
                bad.append(f"common/{m}.py:{line}: {m} ({table[m]}) imports {target} ({table[target]}), "
                           "a later layer")
            elif order[target] == order[m]:
                same.setdefault(m, {}).setdefault(target, line)
    # circles among the imports within one layer
    seen, done = set(), set()

    def visit(m, trail):
        if m in trail:
            cyc = trail[trail.index(m):] + [m]
            steps = ", ".join(f"{a} -> {b} (common/{a}.py:{same[a][b]})" for a, b in zip(cyc, cyc[1:]))
            bad.append(f"a circle within the {table[m]} layer: {steps}")
            return
        if m in done:
            return
        for t in sorted(same.get(m, ())):
            visit(t, trail + [m])
        done.add(m)

    for m in sorted(same):
        visit(m, [])
    return bad


def test_imports_go_one_way():
    bad = layer_problems()
    assert not bad, "\n".join(bad)


def test_every_layer_is_named_and_ranked():
    assert set(LAYERS.values()) <= set(LAYER_NAMES)
    assert [rank(m) for m in ("paths", "build", "stages", "checks", "notebook", "cli")] == [0, 1, 2, 3, 4, 5]


def test_the_check_sees_a_wrong_way_import_inside_a_function(tmp_path):
    """A planted breach of each kind is named, with file, line and both modules."""
    files = {
        "paths": "X = 1\n",
        "build": "from .paths import X\ndef f():\n    from common.stages import load\n",  # tools -> ladder
        "stages": "import common.build\n",
        "checks": "from . import bench\n",
        "bench": "def g():\n    from .checks import h\n",  # a circle within measurement
        "extra": "",  # in no layer
    }
    for m, text in files.items():
        (tmp_path / f"{m}.py").write_text(text)
    table = dict(paths="facts", build="tools", stages="ladder", checks="measurement", bench="measurement")
    bad = layer_problems(set(files), table, read=lambda m: tmp_path / f"{m}.py")
    assert "common/build.py:3: build (tools) imports stages (ladder), a later layer" in bad
    assert "common/extra.py is in no layer of common/layers.py" in bad
    assert any(b.startswith("a circle within the measurement layer: bench -> checks (common/bench.py:2)")
               for b in bad), bad
    assert len(bad) == 3, bad
