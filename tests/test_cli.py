"""The command line a user and a student run."""

import subprocess
import sys

from common.cli import main


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "00_naive" in out and "07_movm_register" in out


def test_check_stage_00(capsys):
    assert main(["check", "00", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "all" in out and "comparisons within" in out


def test_check_unknown_stage():
    import pytest

    with pytest.raises(ValueError, match="unknown stage"):
        main(["check", "42"])


def test_tour_writes_a_report(tmp_path):
    assert main(["tour", "--stages", "00", "--quick", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "tour.md").read_text()
    assert "00_naive" in text and (tmp_path / "latency.png").exists()
    assert (tmp_path / "tour.json").exists()


def test_entry_point_installed():
    out = subprocess.run([sys.executable, "-m", "common.cli", "list"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
