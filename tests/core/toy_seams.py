"""Seams for the toy distribution of ``conftest.py`` (our code, as every seam is)."""


def seam(module, attr):
    original = module.__dict__[attr]

    def select(model, layers):
        return ["patched"] + original(model, layers)[1:]

    return {attr: select}


def seam_and_helper(module, attr):
    out = seam(module, attr)
    out["helper"] = lambda: "patched helper"
    return out


def seam_that_names_a_missing_global(module, attr):
    out = seam(module, attr)
    out["no_such_global"] = lambda: None
    return out


def method_seam(module, attr):
    cls_name, _, name = attr.partition(".")
    original = getattr(module, cls_name).__dict__[name]

    def prepare(self, x):
        return ("patched",) + original(self, x)[1:]

    return {attr: prepare}


def broken_seam(module, attr):
    raise RuntimeError("a seam with a bug")


def seam_not_needed_here(module, attr):
    from fsdp2_compat.core.guards import NotNeeded

    raise NotNeeded("this environment already does what the seam adapts")
