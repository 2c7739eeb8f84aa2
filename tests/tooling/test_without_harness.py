"""The runtime alone (the bare set, a user with the wheel only): ``check`` and ``audit`` say how to get the harness.

``check`` and ``audit`` run the bugs and the fixes on tiny models: the harness
(``harness/``, ``fsdp2_compat_harness``), a distribution a training process
never loads.  Where it is absent, either command prints how to install it and
exits 2, whatever else was asked; ``status``, ``doctor`` and ``list`` do not
need it.
"""

import importlib.util

import pytest

from fsdp2_compat import cli

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ()


@pytest.mark.parametrize("argv", [["check"], ["check", "--json", "--families", "glm4v"],
                                  ["audit", "--model", "glm4v", "--plan", "verl"], ["audit"]])
def test_check_and_audit_say_how_to_install_the_harness(argv, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_harness_installed", lambda: False)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "fsdp2-compat %s needs the harness" % argv[0] in err and "pip install ./harness" in err, err


def test_list_and_doctor_need_no_harness(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_harness_installed", lambda: False)
    assert cli.main(["list"]) == 0 and "glm4v" in capsys.readouterr().out
    assert cli.main(["doctor", "--model-type", "glm4v"]) == 0 and "FSDP2_COMPAT_PATCHES=glm4v" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("fsdp2_compat_harness") is not None,
                    reason="the harness is installed here (the bare set has none)")
def test_where_the_harness_is_not_installed_the_command_says_so(python):
    proc = python("import sys; from fsdp2_compat.cli import main; sys.exit(main(['check']))", check=False)
    assert proc.returncode == 2 and "pip install ./harness" in proc.stderr, proc.stdout + proc.stderr
