import os

import pytest
import torch


@pytest.fixture(scope="session")
def cpu_check_rows():
    """``rows(stage_id)``: common.checks.check_case rows of a CPU stage on every CPU check case, computed
    once per session (the per-case tests and the tolerance test read the same rows)."""
    from common import checks

    cache = {}

    def rows(sid, case=None):
        if sid not in cache:
            cache[sid] = {c.id: checks.check_case(sid, c, device="cpu") for c in checks.cpu_cases()}
        return cache[sid][case.id] if case is not None else [r for rs in cache[sid].values() for r in rs]

    return rows


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); run on the H200 with scripts/gpu_run.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (gpu tests skipped)"
    return f"kdalab: torch {torch.__version__}, {gpu}, CUDA_HOME={os.environ.get('CUDA_HOME', '(auto)')}"
