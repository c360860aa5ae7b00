"""pyproject.toml and environment.yml describe the same environment."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _names(reqs):
    return {re.split(r"[<>=!~ \[;]", r.strip(), maxsplit=1)[0].lower().replace("_", "-") for r in reqs if r.strip()}


def test_environment_yml_matches_pyproject():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = _names(proj["dependencies"]) | _names(proj["optional-dependencies"]["dev"])
    text = (ROOT / "environment.yml").read_text().split("- pip:", 1)[1]  # the pip section
    listed = set()
    for line in text.splitlines():
        m = re.match(r"\s*-\s+([A-Za-z0-9_.\-]+)", line)
        if m and m.group(1) not in ("pip", "python"):
            listed.add(m.group(1).lower().replace("_", "-"))
    missing = want - listed
    assert not missing, f"environment.yml lacks {sorted(missing)}"
    extra = listed - want - {"fla-core", "-e"}
    assert not extra, f"environment.yml lists {sorted(extra)} that pyproject.toml does not"
