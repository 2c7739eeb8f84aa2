"""Which fsdp2-compat patch (if any) removes a hazard, from the catalogue's model types."""

from .findings import NO_PATCH, ROOT
from .ownership import parameter_owners
from .plans import UPSTREAM_PLANS, plan_modules


class Coverage:
    """Which fsdp2-compat patch (if any) removes a hazard of ``plan`` on ``model``.

    The patch named for the model is the one ``registry.for_model_type`` lists
    for ``model.config.model_type``; nothing is guessed from display names.
    """

    def __init__(self, model, plan, units, owners):
        self.model = model
        self.plan = plan
        self.units = units
        self.owners = owners
        self._fixed_owners = None
        self.model_type = getattr(getattr(model, "config", None), "model_type", None)

    def _listed(self):
        from fsdp2_compat import registry

        return registry.for_model_type(self.model_type) if self.model_type else None

    def _fused_target(self):
        from fsdp2_compat import registry

        fwd = type(self.model).__dict__.get("forward")
        if fwd is None:
            return None, None
        mod, attr = getattr(fwd, "__module__", None), getattr(fwd, "__name__", None)
        found = [(p, t) for p in registry.PATCHES for t in p.targets if t.module == mod and t.attr == attr]
        if not found:
            return None, None
        # Several patches may carry the target (glm4v also covers dense_common
        # for GLM-4.5V): name the one listed for this model, else the most specific.
        listed = self._listed()
        p, t = next(((p, t) for p, t in found if p is listed), None) or min(found, key=lambda pt: len(pt[0].targets))
        return p.name, t

    def _fixed(self):
        if self._fixed_owners is None:
            fixed_plan = "fixed-verl" if self.plan == "verl" else "fixed"
            self._fixed_owners = parameter_owners(self.model, plan_modules(self.model, fixed_plan))
        return self._fixed_owners

    def _wrap_patch(self):
        """(the selection-fixing patch listed for this model or None, every selection-fixing patch name)."""
        from fsdp2_compat import registry

        names = [p.name for p in registry.PATCHES if registry.fixes_selection(p)]
        listed = self._listed()
        return (listed.name if listed is not None and listed.name in names else None), names

    def advice(self, read, pname, owner):
        """``(patch name or None, advice)`` for one raw read of ``pname`` owned by unit ``owner``."""
        from fsdp2_compat.core import guards

        out = getattr(self.model, "get_output_embeddings", lambda: None)()
        out_w = getattr(out, "weight", None) if out is not None else None
        p = self.owners[read.pid][0]
        if read.reader == ROOT and out_w is p:
            name, target = self._fused_target()
            if name is not None:
                version = guards.installed_version(target.dist)
                note = ""
                if version is not None and not guards.in_range(version, target.versions):
                    note = " (but it targets %s %s; installed: %s)" % (target.dist, target.versions, version)
                return name, "apply patch '%s': it unshards %s through FSDP before %s.%s reads it%s" % (
                    name, owner or "<root>", target.module.rpartition(".")[2], target.attr, note)
        if self.plan in UPSTREAM_PLANS:  # the plans the wrap-selection patches change
            fixed_owner = self._fixed()[read.pid][2]
            if fixed_owner in read.active:
                name, all_names = self._wrap_patch()
                where = "the root unit" if fixed_owner == ROOT else "unit " + fixed_owner
                if name is not None:
                    return name, "apply patch '%s': its wrap-selection fix keeps %s in %s" % (name, pname, where)
                return None, ("the wrap-selection fix keeps %s in %s, but no patch is listed for model type %r: "
                              "any of %s applies it" % (pname, where, self.model_type, ", ".join(all_names)))
        return None, "%s (%s), or keep %s out of a unit of its own" % (NO_PATCH, read.reader or "<root>", owner)
