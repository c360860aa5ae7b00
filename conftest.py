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


def pytest_configure(config):
    """A CUDA stage's first build takes minutes: its progress lines reach the terminal past pytest's output
    capture (``kdalab ...: still compiling (N s)``), so a cold run never looks like a hang."""
    from common import build

    plain = build.set_progress(None)

    def say(line):
        tr = config.pluginmanager.get_plugin("terminalreporter")  # registered after this hook runs
        capman = config.pluginmanager.get_plugin("capturemanager")
        if tr is None or capman is None:
            return plain(line)
        with capman.global_and_fixture_disabled():
            tr.ensure_newline()
            tr.write_line(line)

    build.set_progress(say)
