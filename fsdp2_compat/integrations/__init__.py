"""One declarative module per upstream distribution: where each release keeps the code a fix goes into.

Each module holds data only: one ``Integration`` record per distribution (its
package, the module that wraps models, the callers that import a target by
name) and its ``TARGETS``, each one fix (``fsdp2_compat.fixes``) in one
release range with the fingerprints of the released code.  The mechanisms'
code is in ``fsdp2_compat.fixes``; ``fsdp2_compat.registry`` joins the
targets with the fixes each patch lists.  ``INTEGRATIONS`` below is the one
framework -> module map the harness and the tests read.

Adding a framework is one module here, listed below.
torch itself is an integration too (``torch_fsdp``: fixes inside FSDP2), but
not a framework: it has no ``wrap_module`` (``wrapping()`` lists those that have one);
neither has accelerate (its ``fsdp2_prepare_model`` takes the accelerator, not an
``apply_fsdp2``-style call the wrap-selection harness makes), nor axolotl and ms-swift (which prepare through it;
ms-swift has no target: ``ms_swift.PATHS`` says what covers each of its paths), nor transformers
(``transformers_media``, ``transformers_moe``: the model code a patch wraps; ``transformers_fsdp``: its native FSDP2).
"""

from . import (accelerate, areal, axolotl, llamafactory, lmms_engine, ms_swift, skyrl, torch_fsdp, transformers_fsdp,
               transformers_media, transformers_moe, trl, verl)

INTEGRATIONS = (verl.INTEGRATION, skyrl.SKYRL_INTEGRATION, skyrl.SKYRL_TRAIN_INTEGRATION, areal.INTEGRATION,
                llamafactory.INTEGRATION, lmms_engine.INTEGRATION, trl.INTEGRATION, accelerate.INTEGRATION,
                axolotl.INTEGRATION, ms_swift.INTEGRATION, torch_fsdp.INTEGRATION, transformers_fsdp.INTEGRATION)

_BY_DIST = {i.dist: i for i in INTEGRATIONS}


def get(dist):
    """The ``Integration`` of distribution ``dist`` (``KeyError`` names the known ones)."""
    try:
        return _BY_DIST[dist]
    except KeyError:
        raise KeyError("no integration for %r; known: %s" % (dist, ", ".join(_BY_DIST))) from None


def dists():
    return tuple(_BY_DIST)


def wrapping():
    """The integrations that wrap models themselves (an ``apply_fsdp2`` in ``wrap_module``)."""
    return tuple(i for i in INTEGRATIONS if i.wrap_module is not None)


# The order targets are listed in (and so each fix's targets within a patch): the libraries every stack trains
# on, then the frameworks.
_TARGET_MODULES = (torch_fsdp, transformers_media, transformers_moe, transformers_fsdp, accelerate, verl, skyrl, areal, llamafactory,
                   lmms_engine, trl, axolotl)


def targets():
    """Every ``Target`` of every integration, each naming its fix."""
    return tuple(t for module in _TARGET_MODULES for t in module.TARGETS)
