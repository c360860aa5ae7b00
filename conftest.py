"""pytest's view of the checkout: this tree first on sys.path (whatever the virtual environment's editable
install points to), and the notebook plugin (common.nbcheck: each notebook's kernel on this tree, every
cell that draws shows its figure)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))
for name in [m for m in sys.modules if m == "common" or m.startswith("common.")]:
    file = getattr(sys.modules[name], "__file__", None)
    if file and ROOT not in Path(file).resolve().parents:
        raise ImportError(f"`{name}` was imported from {sys.modules[name].__file__} before this checkout's "
                          f"conftest ran ({ROOT}): run pytest from this checkout without `-p common...`")

pytest_plugins = ("common.nbcheck",)
