"""The activation tests' shared fixtures: the wheel built from this working tree and a venv it is installed in
(``support.installed_wheel``), once per test module."""

import pytest

from support import installed_wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """``pip wheel`` of a copy of this working tree (the shared build/ folder stays untouched)."""
    return installed_wheel.build_wheel(tmp_path_factory)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed (not editable) and the host packages reachable."""
    return installed_wheel.install(wheel, tmp_path_factory)
