"""KDA Lab shared Python: inputs, the fp64 reference, checks, building, timing,
results and plots. Written once here and used by every stage, test, notebook
and the ``kdalab`` command line."""

from .paths import REPO_ROOT, STAGES_DIR, RESULTS_DIR, REPORTS_DIR, BUILD_DIR  # noqa: F401
