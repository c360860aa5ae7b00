"""The command line a user and a student run."""

import json
import subprocess
import sys

import pytest

from common.cli import EXIT_FAILED, EXIT_USAGE, main
from common.paths import REPO_ROOT


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "00_naive" in out and "07_movm_register" in out


def test_check_stage_00(capsys):
    assert main(["check", "00", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "all" in out and "comparisons within" in out


USER_ERRORS = [
    (["check", "99"], "unknown stage '99'"),
    (["check"], "the following arguments are required: stage"),
    (["tour", "--stages", "99"], "unknown stage '99'"),
    (["tour", "--stages", ","], "--stages needs at least one stage id"),
    (["bench", "--stages", "01", "--shapes", "99", "--out", "x.json"], "--shapes 99: the cpu sweep has 4 shapes"),
    (["bench", "--stages", "01", "--shapes", "a", "--out", "x.json"], "--shapes takes comma-separated indices"),
    (["bench", "--stages", "01", "--chunk", "17", "--out", "x.json"], "--chunk 17: stage 01_cpp takes chunk sizes"),
    (["bench", "--stages", "00", "--chunk", "24", "--out", "x.json"], "--chunk 24: stage 00_naive takes a power of two"),
    (["bench", "--stages", "05", "--gate", "softplus", "--out", "x.json"], "--gate softplus: stage 05_cute_bf16"),
    (["bench", "--stages", "01", "--sweep", "nope", "--out", "x.json"], "invalid choice: 'nope'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv,words", USER_ERRORS, ids=[" ".join(a) for a, _ in USER_ERRORS])
def test_user_errors_print_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == EXIT_USAGE
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdalab: error:") and words in lines[0], out.err
    assert "Traceback" not in out.out + out.err


def test_bench_that_measures_nothing_exits_non_zero(tmp_path, capsys):
    """FLA cannot run without a GPU (or fla-core): the reason is printed, exit 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("FLA may run here")
    out = tmp_path / "b.json"
    assert main(["bench", "--stages", "fla", "--sweep", "fp32-gpu", "--shapes", "0", "--out", str(out)]) == EXIT_FAILED
    text = capsys.readouterr().out
    assert "NOT MEASURED: fla" in text and "nothing was measured" in text
    assert json.loads(out.read_text())["rows"][0]["error"]


def test_bench_measures_a_cpu_stage(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--stages", "00", "--shapes", "0", "--budget", "0.05", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["stage"] == "00_naive" and row["fwd_ms"] > 0 and row["bwd_ms"] > 0


def test_help_does_not_import_torch():
    code = ("import sys\nfrom common.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert "exit codes" in out.stdout


def test_a_build_says_up_to_date_when_nothing_changed(capsys, monkeypatch):
    from common import build
    from common.stages import load_stage

    monkeypatch.setattr(build, "_SAY", [lambda msg: print(msg, flush=True)])  # printed, as outside pytest

    load_stage("01").build()
    build._LOADED.pop(build.extension_name("01_cpp"), None)  # as a new process would
    load_stage("01").build()
    assert "kda_01_cpp: up to date" in capsys.readouterr().out


def test_tour_writes_a_report(tmp_path):
    assert main(["tour", "--stages", "00", "--quick", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "tour.md").read_text()
    assert "00_naive" in text and (tmp_path / "latency_cpu.png").exists() and (tmp_path / "profile_cpu.png").exists()
    assert (tmp_path / "tour.json").exists()


def test_entry_point_installed():
    out = subprocess.run([sys.executable, "-m", "common.cli", "list"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
