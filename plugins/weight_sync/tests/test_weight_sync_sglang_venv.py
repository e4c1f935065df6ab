"""The benchmark prepares the SGLang venv itself where the checkout has none (it ran
``./scripts/sglang_env.sh`` nowhere and stopped with 'needs the SGLang venv'); the decision is
tested with a fake script runner: the real script takes minutes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from titan_weight_sync import cpu_engine

pytestmark = pytest.mark.line_independent

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture()
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout with the script and no SGLang venv."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "sglang_env.sh").write_text("#!/bin/sh\n")
    monkeypatch.setattr(cpu_engine, "REPO", tmp_path)
    monkeypatch.delenv("TITAN_SGLANG_PYTHON", raising=False)
    monkeypatch.setenv("SGLANG_RELEASE", "0.5.15.post1")  # a shell's choice the run must drop
    return tmp_path


def _make_venv(root: Path) -> Path:
    python = root / ".venv-sglang" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return python


def test_a_missing_venv_is_prepared_saying_so(checkout: Path) -> None:
    runs: list[dict[str, Any]] = []
    said: list[str] = []

    def run(args: list[str], **options: Any) -> subprocess.CompletedProcess:
        runs.append({"args": args, **options})
        _make_venv(checkout)
        return subprocess.CompletedProcess(args, 0)

    assert cpu_engine.prepare_sglang_python(run, said.append) == str(_python(checkout))
    assert [r["args"] for r in runs] == [[str(checkout / "scripts" / "sglang_env.sh")]]
    assert runs[0]["cwd"] == str(checkout) and "SGLANG_RELEASE" not in runs[0]["env"]
    assert said == [
        f"no SGLang venv yet: preparing {checkout / '.venv-sglang'} with cd {checkout} && "
        "./scripts/sglang_env.sh (minutes, once)"
    ]


def _python(root: Path) -> Path:
    return root / ".venv-sglang" / "bin" / "python"


def test_a_present_venv_is_used_as_it_is(checkout: Path) -> None:
    python = _make_venv(checkout)
    said: list[str] = []
    assert cpu_engine.prepare_sglang_python(_no_run, said.append) == str(python)
    assert said == []


def _no_run(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    raise AssertionError("the script must not run")


def test_a_failed_preparation_says_the_exact_command(checkout: Path) -> None:
    said: list[str] = []
    failed = cpu_engine.prepare_sglang_python(
        lambda args, **kw: subprocess.CompletedProcess(args, 2), said.append
    )
    assert failed is None
    assert said[-1] == (
        f"preparing the SGLang venv failed (exit 2); run cd {checkout} && ./scripts/sglang_env.sh"
    )


def test_a_named_interpreter_that_is_missing_is_not_overridden(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TITAN_SGLANG_PYTHON", "/no/such/python")
    said: list[str] = []
    assert cpu_engine.prepare_sglang_python(_no_run, said.append) is None
    assert said == [
        f"TITAN_SGLANG_PYTHON='/no/such/python' is not an interpreter here: fix it, or unset it "
        f"and run cd {checkout} && ./scripts/sglang_env.sh"
    ]


def test_outside_a_checkout_the_variable_is_named(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(cpu_engine, "REPO", tmp_path)
    monkeypatch.delenv("TITAN_SGLANG_PYTHON", raising=False)
    said: list[str] = []
    assert cpu_engine.prepare_sglang_python(_no_run, said.append) is None
    assert said == ["no SGLang venv: set TITAN_SGLANG_PYTHON to the python of an SGLang venv"]


def test_the_benchmark_stops_only_when_no_venv_could_be_prepared(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its loadguard
    spec = importlib.util.spec_from_file_location(
        "_weight_sync_benchmark", BENCHMARKS / "weight_sync.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    asked: list[Any] = []

    def prepare(say: Any) -> None:
        asked.append(say)
        say("no SGLang venv: set TITAN_SGLANG_PYTHON to the python of an SGLang venv")

    monkeypatch.setattr(bench, "prepare_sglang_python", prepare)
    monkeypatch.setattr(sys, "argv", ["weight_sync.py", "--mb", "64"])
    assert bench.main() == 2 and len(asked) == 1
    assert capsys.readouterr().err == (
        "no SGLang venv: set TITAN_SGLANG_PYTHON to the python of an SGLang venv\n"
    )
