import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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
