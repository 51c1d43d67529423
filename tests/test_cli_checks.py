"""The CLI on inputs it got wrong: --model files and modules that Python itself imports, a huge
--threads, and a reader that stops reading."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
import torch

from zero_offload import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BUILD = "def build():\n    return torch.nn.Linear(8, 8)\n"  # 72 parameters


@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """sys.path without the working directory (as under the console script), and none of the
    test's own modules left behind for the next test (torch's, imported lazily, must stay)."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    yield
    for name in [n for n in sys.modules if n.startswith("zo_test_") or n == "_zo_user_model"]:
        del sys.modules[name]


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return str(path)


# ---- B1: --model imports as Python would ------------------------------------------------------

def test_model_file_with_a_dataclass_and_postponed_annotations(tmp_path: Path, isolated_imports: None) -> None:
    """The module was not in sys.modules while it ran, so @dataclass failed:
    "AttributeError: 'NoneType' object has no attribute '__dict__'"."""
    path = _write(tmp_path / "dcmodel.py", """\
        from __future__ import annotations
        from dataclasses import dataclass
        import torch

        @dataclass
        class Cfg:
            d: int = 8

        def build():
            return torch.nn.Linear(Cfg().d, Cfg().d)
        """)
    assert cli.count_model_params(f"{path}:build") == (72, 0)


def test_model_file_importing_a_sibling(tmp_path: Path, isolated_imports: None) -> None:
    """Its folder was not on sys.path: "ModuleNotFoundError: No module named ..."; it is there
    only while the model is imported and built."""
    _write(tmp_path / "proj" / "zo_test_sibling_layers.py", "import torch\nclass Blk(torch.nn.Linear):\n    pass\n")
    path = _write(tmp_path / "proj" / "model.py",
                  "from zo_test_sibling_layers import Blk\n\ndef build():\n    return Blk(8, 8)\n")
    path_before = list(sys.path)
    assert cli.count_model_params(f"{path}:build") == (72, 0)
    assert sys.path == path_before


def test_dotted_model_module_under_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         isolated_imports: None) -> None:
    """The console script has no working directory on sys.path: `--model examples.models:gpt_tiny`
    from the repository root failed with "No module named 'examples'"."""
    _write(tmp_path / "zo_test_pkg" / "__init__.py", "")
    _write(tmp_path / "zo_test_pkg" / "models.py", "import torch\n" + _BUILD)
    monkeypatch.chdir(tmp_path)
    assert cli.count_model_params("zo_test_pkg.models:build") == (72, 0)


def test_model_file_that_fails_to_import_is_one_line_and_not_kept(tmp_path: Path, isolated_imports: None) -> None:
    path = _write(tmp_path / "broken.py", "raise RuntimeError('no GPU here')\n")
    with pytest.raises(cli.CLIError, match=r"cannot import .*broken.py: RuntimeError: no GPU here$"):
        cli.count_model_params(f"{path}:build")
    assert cli._USER_MODULE not in sys.modules


# ---- B3: a huge --threads ------------------------------------------------------------------------

@pytest.fixture
def no_huge_set_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.set_num_threads(100000) kills the process (SIGSEGV): fail the test instead."""
    real = torch.set_num_threads

    def guarded(n: int) -> None:
        assert n <= 4096, f"torch.set_num_threads({n}) reached"
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", guarded)


@pytest.mark.parametrize("argv,needle", [
    (["bench-adam", "--params", "1000", "--rounds", "1", "--threads", "100000"],
     "bench-adam: --threads 100000: must be <= 4096"),
    (["bench-step", "--threads", "100000", "--d-model", "16", "--layers", "1", "--tokens", "4", "--steps", "1",
      "--tier", "cpu", "--malloc", "default"],
     "bench-step: --threads 100000: must be <= 4096"),
])
def test_huge_threads_is_refused_before_torch_gets_it(argv: list[str], needle: str, no_huge_set_num_threads: None,
                                                      capsys: pytest.CaptureFixture) -> None:
    """Both passed it to torch.set_num_threads, which segfaulted."""
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and needle in err and len(err.strip().splitlines()) == 1, err


# ---- B10: a reader that stops reading ----------------------------------------------------------

def test_closed_stdout_exits_quietly() -> None:
    """`zero-offload estimate ... | head` ended with "zero-offload: error: [Errno 32] Broken pipe"
    and status 2. Here the pipe's read end is closed before the command writes anything."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "zero_offload.cli", "estimate", "--params", "1000"],
                              cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 1, (proc.returncode, proc.stderr)


@pytest.mark.parametrize("text,count", [("12", 12), ("350k", 350_000), ("1.5M", 1_500_000), ("7B", 7 * 10**9),
                                        ("100_000", 100_000), ("2t", 2 * 10**12)])
def test_parameter_counts_take_the_usual_suffixes(text: str, count: int) -> None:
    """`estimate --params 7B` and `bench-adam --params 1M` were refused as 'invalid int value'."""
    from zero_offload.cli import parse_count

    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["7X", "1.2345k", "", "-3", "1e9"])
def test_a_bad_parameter_count_is_one_line(text: str) -> None:
    import argparse

    from zero_offload.cli import parse_count

    with pytest.raises(argparse.ArgumentTypeError, match="is not a (count|whole number)"):
        parse_count(text)


def test_config_check_names_ignored_deepspeed_keys_in_one_note_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Not Python's two-line warning pointing into runpy."""
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2, "sub_group_size": 1e9}}')
    assert cli.main(["config", "--check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"{path}: OK" in out
    assert err.splitlines() == ["zero-offload: note: DeepSpeed key(s) accepted without effect, as they change nothing "
                                "zero_offload stores or computes: zero_optimization.sub_group_size"]
