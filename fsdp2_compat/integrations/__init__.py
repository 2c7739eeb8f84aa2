"""One declarative module per upstream framework: where each release keeps the code we fix.

Each module holds ``Target`` records (one seam in one release range, with the
fingerprints of the released code) and one ``Integration`` record per
distribution (its package, the module that wraps models, the callers that
import it by name).  ``fsdp2_compat.registry`` bundles the targets into the
patches users name; ``INTEGRATIONS`` below is the one framework -> module map
the tooling and the tests read.

Adding a framework is one module here plus its targets in the registry.
torch itself is an integration too (``torch_fsdp``: fixes inside FSDP2), but
not a framework: it has no ``wrap_module`` (``wrapping()`` lists those that have one);
neither has accelerate (its ``fsdp2_prepare_model`` takes the accelerator, not an
``apply_fsdp2``-style call the wrap-selection tooling makes), nor axolotl and ms-swift (which prepare through it;
ms-swift has no target: ``ms_swift.PATHS`` says what covers each of its paths), nor transformers
(``transformers_media``: the model forwards that skip a vision tower).
"""

from . import (accelerate, areal, axolotl, llamafactory, lmms_engine, ms_swift, skyrl, torch_fsdp, transformers_media,
               trl, verl)

INTEGRATIONS = (verl.INTEGRATION, skyrl.SKYRL_INTEGRATION, skyrl.SKYRL_TRAIN_INTEGRATION, areal.INTEGRATION,
                llamafactory.INTEGRATION, lmms_engine.INTEGRATION, trl.INTEGRATION, accelerate.INTEGRATION,
                axolotl.INTEGRATION, ms_swift.INTEGRATION, torch_fsdp.INTEGRATION, transformers_media.INTEGRATION)

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
