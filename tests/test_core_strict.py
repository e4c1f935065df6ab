"""STRICT holds whatever the import order: a bad switch or knob value stops ``import megatron``
with one clear message, while ``import torch`` alone never fails because of us.

Each case is a fresh interpreter with the installed plugins and a stand-in ``megatron`` package
first on PYTHONPATH that imports torch from inside its own import, as megatron does (the
torch.backends entry point then runs while megatron is already importing: the order that used to
lose STRICT). The stand-in keeps each case at the cost of ``import torch``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = [
    ("TITAN_PLUGINS", "maybe", "not a switch value; accepted: 1 or 0"),
    ("TITAN_PLUGINS_ONLY", "nonexistent", "not an installed plugin (installed: "),
    ("TITAN_FP8_BLOCKWISE", "nah", "not a switch value; accepted: 1 or 0"),
    ("TITAN_PLUGINS_PICK", "oops", "'oops' is not name=distribution"),
]


@pytest.fixture(scope="module")
def fake_megatron(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_megatron")
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("import torch\nimport megatron.core\n")
    (core / "__init__.py").write_text("from megatron.core import sub\n")
    (core / "sub.py").write_text("X = 1\n")
    return root


def run(code: str, env: dict[str, str], fake_megatron) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_") and k != "PYTHONPATH"}
    full.update(env, PYTHONPATH=str(fake_megatron))
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("var", "value", "message", "code"),
    [(*case, "import megatron.core") for case in CASES]
    + [(*CASES[2], "import torch; import megatron.core")],  # the other order
)
def test_bad_value_under_strict_stops_megatron_import(fake_megatron, var, value, message, code):
    done = run(code, {"TITAN_PLUGINS_STRICT": "1", var: value}, fake_megatron)
    assert done.returncode != 0
    assert (
        "SettingError" in done.stderr
        and f"{var}='{value}'" in done.stderr
        or (var == "TITAN_PLUGINS_ONLY" and "TITAN_PLUGINS_ONLY names nonexistent" in done.stderr)
    )
    assert message in done.stderr and "TITAN_PLUGINS_STRICT=1" in done.stderr


def test_import_torch_alone_never_fails(fake_megatron):
    env = {"TITAN_PLUGINS_STRICT": "1", "TITAN_PLUGINS": "maybe", "TITAN_FP8_BLOCKWISE": "nah"}
    done = run("import torch", env, fake_megatron)
    assert done.returncode == 0, done.stderr


def test_malformed_strict_value_is_strict(fake_megatron):
    done = run("import megatron.core", {"TITAN_PLUGINS_STRICT": "maybe"}, fake_megatron)
    assert done.returncode != 0 and "TITAN_PLUGINS_STRICT='maybe'" in done.stderr


def test_without_strict_one_warning_and_the_import_works(fake_megatron):
    done = run("import megatron.core", {"TITAN_FP8_BLOCKWISE": "nah"}, fake_megatron)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("TITAN_FP8_BLOCKWISE='nah'") == 1
    assert "(default 1 used)" in done.stderr  # what applies instead, not a vague "ignored"


HUGE = "9" * 401  # parse_bytes turned it into inf, and int(inf) raised OverflowError


def test_a_huge_byte_size_under_strict_stops_megatron_import_naming_the_knob(fake_megatron):
    env = {"TITAN_PLUGINS_STRICT": "1", "TITAN_REWIND_MAX_HOST_BYTES": HUGE}
    assert run("import torch", env, fake_megatron).returncode == 0
    done = run("import megatron.core", env, fake_megatron)
    assert done.returncode != 0
    assert "SettingError: TITAN_REWIND_MAX_HOST_BYTES='99999" in done.stderr
    assert "(401 characters): too large" in done.stderr and "OverflowError" not in done.stderr


def test_a_huge_byte_size_without_strict_warns_once_and_every_plugin_loads(fake_megatron):
    code = (
        "import megatron.core\n"
        "from titan_plugins import activation\n"
        "state = activation.current()\n"
        "print(state.state, sorted(r.state for r in state.manager.records.values()))"
    )
    done = run(code, {"TITAN_PLUGINS_MAX_HOST_BYTES": HUGE}, fake_megatron)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "active" and "disabled" not in done.stdout
    assert done.stderr.count("TITAN_PLUGINS_MAX_HOST_BYTES='99999") == 1
    assert "activation failed" not in done.stderr and "default auto" in done.stderr


def test_a_misspelled_switch_stops_megatron_import_under_strict_naming_the_real_one(fake_megatron):
    env = {"TITAN_PLUGINS_STRICT": "1", "TITAN_FP8_BLOCKWIS": "0"}
    done = run("import megatron.core", env, fake_megatron)
    assert done.returncode != 0
    assert (
        "SettingError: TITAN_FP8_BLOCKWIS is set but no installed plugin declares it, nor the "
        "core: did you mean TITAN_FP8_BLOCKWISE? (or unset it) (TITAN_PLUGINS_STRICT=1"
    ) in done.stderr


def test_a_misspelled_switch_without_strict_warns_and_leaves_the_plugin_on(fake_megatron):
    code = (
        "import megatron.core\n"
        "from titan_plugins import activation\n"
        "print(activation.current().manager.records['fp8_blockwise'].state)"
    )
    done = run(code, {"TITAN_FP8_BLOCKWIS": "0"}, fake_megatron)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["enabled"]  # what the warning says: the typo is ignored
    assert done.stderr.count("TITAN_FP8_BLOCKWIS is set but no installed plugin declares") == 1


def test_a_strict_value_that_is_not_a_boolean_is_named_as_such(fake_megatron):
    done = run("import megatron.core", {"TITAN_PLUGINS_STRICT": "garbage"}, fake_megatron)
    assert done.returncode != 0
    assert (
        "SettingError: TITAN_PLUGINS_STRICT='garbage' is not a boolean (accepted: " in done.stderr
    )
    assert "TITAN_PLUGINS_STRICT=1" not in done.stderr
