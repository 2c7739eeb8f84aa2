"""Build step that pyproject.toml cannot express: ship the start-up ``.pth``.

A ``.pth`` file only runs when it sits at the root of site-packages, i.e. at
the root of the wheel (purelib).  ``data-files`` would put it under the
environment prefix instead, so ``build_py`` writes it into ``build_lib``.
Its name and its one line live in ``fsdp2_compat/core/config.py`` (``PTH_NAME``,
``PTH_LINE``), read here by running that stdlib-only file on its own
(``runpy.run_path``), so nothing of the package is imported.

Editable installs (``pip install -e .``) do not get the file, on purpose and
by necessity: setuptools' default editable strategy installs a finder for the
package and drops other ``build_lib`` outputs, and its strict mode links files
into a folder that is on ``sys.path`` but is no site directory, where a
``.pth`` is never run.  There the verl plugin, ``VERL_USE_EXTERNAL_MODULES``,
the Ray helper and ``import fsdp2_compat.auto`` still work; see docs/enable.md.
"""

import os
import runpy

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _bootstrap_constants():
    found = runpy.run_path(os.path.join(HERE, "fsdp2_compat", "core", "config.py"))
    return found["PTH_NAME"], found["PTH_LINE"]


class build_py_with_pth(build_py):
    """``build_py`` that also writes the bootstrap ``.pth`` at the root of ``build_lib``."""

    def _pth_path(self):
        return os.path.join(self.build_lib, _bootstrap_constants()[0])

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        name, line = _bootstrap_constants()
        if "\n" in line or not line.startswith("import "):
            raise RuntimeError("%s must be one line starting with 'import '" % name)
        os.makedirs(self.build_lib, exist_ok=True)
        with open(self._pth_path(), "w", encoding="ascii") as f:
            f.write(line + "\n")

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(self._pth_path())
        return outputs


setup(cmdclass={"build_py": build_py_with_pth})
