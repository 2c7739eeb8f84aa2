"""Inputs to audit: a tiny family, a config class, or a local config.json shrunk to tiny size.

``build_inputs(args)`` returns ``(model, batch, label, notes)`` for the CLI;
``apply_fused`` installs verl's fused-kernel forward.  Bad input raises
``AuditInputError`` naming the value and what would be valid.
"""

import contextlib
import json

from .findings import AuditInputError, Finding


def _norm(text):
    return "".join(c for c in text.lower() if c.isalnum())


def _families():
    from fsdp2_compat_harness import tiny as tiny_models

    return tiny_models.FAMILIES


def _parse_sets(pairs):
    out = []
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise AuditInputError("--set expects KEY=VALUE (e.g. vision_config.depth=2), got %r" % pair)
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.append((key.strip(), value))
    return out


def _apply_sets(config, sets):
    for key, value in sets:
        obj, parts = config, key.split(".")
        for part in parts[:-1]:
            nxt = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
            if nxt is None:
                raise AuditInputError("--set %s: the config has no %r" % (key, part))
            obj = nxt
        leaf = parts[-1]
        if isinstance(obj, dict):
            obj[leaf] = value
        else:
            if not hasattr(obj, leaf):
                raise AuditInputError("--set %s: %s has no attribute %r (see its to_dict() keys)"
                                      % (key, type(obj).__name__, leaf))
            setattr(obj, leaf, value)


_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "depth", "encoder_layers",
               "decoder_layers", "num_encoder_layers", "num_decoder_layers")
_FIXED = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "out_hidden_size": 32,
    "projector_hidden_size": 32, "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "n_inner": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_attention_heads": 2, "num_heads": 2, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "n_head": 2, "num_key_value_heads": 1, "num_kv_heads": 1, "head_dim": 16,
}
_CAPS = {"num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
         "max_position_embeddings": 4096}


def _shrink(d, top=True):
    """Tiny dimensions for a config dict (and its sub-config dicts), in place."""
    old_layers = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    new_layers = None
    for k in _LAYER_KEYS:
        if isinstance(d.get(k), int) and d[k] > 2:
            d[k] = 2
            new_layers = 2
    for k, v in list(d.items()):
        if new_layers and isinstance(v, dict) and v and all(str(i).isdigit() for i in v):
            d[k] = {i: x for i, x in v.items() if int(i) < new_layers}  # per-layer overrides by index
        elif isinstance(v, dict) and k.endswith("_config"):
            _shrink(v, top=False)
        elif k in _FIXED and isinstance(v, int) and v > 0:
            d[k] = _FIXED[k]
        elif k in _CAPS and isinstance(v, int):
            d[k] = min(v, _CAPS[k])
        elif new_layers and isinstance(v, list) and len(v) == old_layers:
            d[k] = v[:new_layers]  # per-layer lists (layer_types, ...)
    if isinstance(d.get("vocab_size"), int):
        ids = []
        for k, v in d.items():
            if k.endswith(("_token_id", "_token_index", "_token_ids")):
                ids += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int)]
        d["vocab_size"] = max([256] + [i + 1 for i in ids])
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
            factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
            freqs = max(len(rope["mrope_section"]), int(16 * factor) // 2)
            sec, total = rope["mrope_section"], sum(rope["mrope_section"]) or 1
            new = [max(1, round(s * freqs / total)) for s in sec]
            new[-1] += freqs - sum(new)
            rope["mrope_section"] = new
    return d


def _deep_merge(base, over):
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v
    return base


def _family_of_config_class(name):
    from fsdp2_compat_harness import tiny as tiny_models

    for family, (_, cfg_cls) in tiny_models.CLASSES.items():
        if cfg_cls == name:
            return family
    return None


def _config_class(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for key in (model_type, model_type.replace("-", "_"), model_type.replace("_", "-")):
        try:
            return CONFIG_MAPPING[key]
        except KeyError:
            continue
    return None


def _family_of_model_type(model_type):
    import transformers

    from fsdp2_compat_harness import tiny as tiny_models

    for family, (_, cfg_cls) in tiny_models.CLASSES.items():
        cls = getattr(transformers, cfg_cls, None)
        if cls is not None and _norm(getattr(cls, "model_type", "") or "") == _norm(model_type):
            return family
    return None


def _text_batch(model):
    import torch

    vocab = getattr(model.get_input_embeddings(), "num_embeddings", 256)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(4, min(vocab, 240)), (2, 12), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _build_generic(config):
    import torch
    import transformers

    archs = getattr(config, "architectures", None) or []
    classes = [getattr(transformers, a, None) for a in archs]
    errors = []
    for cls in [c for c in classes if c is not None]:
        try:
            with torch.random.fork_rng(devices=[]):  # the same weights every build (--batches rebuilds it)
                torch.manual_seed(0)
                return cls(config)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append("%s: %s" % (cls.__name__, exc))
    for auto in ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModel"):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return cls.from_config(config)
        except Exception as exc:  # noqa: BLE001
            errors.append("%s: %s" % (auto, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
    raise AuditInputError("could not build a model from this config: " + "; ".join(errors))


def build_inputs(args):
    """(model, batch, label, notes) for parsed CLI arguments."""
    import transformers

    from fsdp2_compat_harness import tiny as tiny_models

    sets = _parse_sets(args.set)
    notes = []
    if args.model:
        if args.model not in tiny_models.FAMILIES:
            raise AuditInputError("unknown --model %r; valid families: %s" % (args.model, ", ".join(tiny_models.FAMILIES)))
        why = tiny_models.unavailable(args.model)
        if why is not None:
            raise AuditInputError("--model %s: %s" % (args.model, why))
        if sets:
            config = tiny_models.quiet(tiny_models.tiny_config, args.model, args.tie)
            _apply_sets(config, sets)
            model = _instantiate(getattr(transformers, tiny_models.CLASSES[args.model][0]), config)
        else:
            model = tiny_models.build(args.model, tie=args.tie)
        return model, tiny_models.make_batch(args.model, model, seed=0), args.model, notes
    if args.config:
        cfg_cls = getattr(transformers, args.config, None)
        if cfg_cls is None or not isinstance(cfg_cls, type) or not hasattr(cfg_cls, "model_type"):
            raise AuditInputError("--config %r is not a configuration class of transformers %s (e.g. Glm4vConfig, "
                                  "Qwen2Config)" % (args.config, transformers.__version__))
        family = _family_of_config_class(args.config)
        if family is not None and tiny_models.unavailable(family) is None:
            config = tiny_models.quiet(tiny_models.tiny_config, family, args.tie)
            _apply_sets(config, sets)
            model = _instantiate(getattr(transformers, tiny_models.CLASSES[family][0]), config)
            return model, tiny_models.make_batch(family, model, seed=0), args.config, notes
        try:
            config = tiny_models.quiet(cfg_cls.from_dict, _shrink(cfg_cls().to_dict()))
        except Exception as exc:  # noqa: BLE001 - the class's own validation
            raise AuditInputError("--config %s: its default config, shrunk to tiny size, does not build (%s: %s); "
                                  "use --config-json with a config.json that does" % (
                                      args.config, type(exc).__name__, _first(exc))) from None
        _apply_sets(config, sets)
        return _generic(config, args.config, notes)
    return _from_json(args.config_json, sets, args.tie, notes)


def _first(exc):
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _instantiate(cls, config):
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
    return model.to(dtype=torch.float32, device="cpu").train()


def _generic(config, label, notes):
    import torch

    model = _build_generic(config).to(dtype=torch.float32, device="cpu").train()
    notes.append(Finding(
        "text-only",
        "no tiny batch is known for model type %r: the audit ran a text-only batch, so vision/audio "
        "towers were not exercised (their hazards are not seen)" % config.model_type))
    return model, _text_batch(model), label, notes


def _from_json(path, sets, tie, notes):
    import transformers

    from fsdp2_compat_harness import tiny as tiny_models

    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise AuditInputError("--config-json %s: %s" % (path, exc)) from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise AuditInputError("--config-json %s has no model_type" % path)
    family = _family_of_model_type(model_type)
    cfg_cls = getattr(transformers, tiny_models.CLASSES[family][1]) if family else _config_class(model_type)
    if cfg_cls is None:
        raise AuditInputError("--config-json %s: model_type %r is unknown to transformers %s"
                              % (path, model_type, transformers.__version__))
    d = _shrink(dict(raw))
    if family is not None and tiny_models.unavailable(family) is None:
        # Geometry, token ids and rotary settings of the tiny family (the batch depends on them);
        # everything else (flags, tying, optional heads) as in the file.
        tiny = tiny_models.quiet(tiny_models.tiny_config, family, False)
        tiny_d = tiny.to_diff_dict()
        for sub in [d] + [v for v in d.values() if isinstance(v, dict)]:
            sub_tiny = tiny_d if sub is d else next((tiny_d.get(k) for k, v in d.items() if v is sub), None)
            if isinstance(sub_tiny, dict) and any(k in sub_tiny for k in ("rope_parameters", "rope_scaling", "rope_theta")):
                for k in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"):
                    sub.pop(k, None)
        # Tying stays as the file (or, where it is silent, the config class default) says.
        for sub in [tiny_d] + [v for v in tiny_d.values() if isinstance(v, dict)]:
            sub.pop("tie_word_embeddings", None)
        _deep_merge(d, tiny_d)
        if tie:
            for sub in [d] + [v for k, v in d.items() if k == "text_config" and isinstance(v, dict)]:
                sub["tie_word_embeddings"] = True
        d.pop("architectures", None)
        config = tiny_models.quiet(cfg_cls.from_dict, d)
        _apply_sets(config, sets)
        try:
            model = _instantiate(getattr(transformers, tiny_models.CLASSES[family][0]), config)
            batch = tiny_models.make_batch(family, model, seed=0)
        except Exception as exc:  # noqa: BLE001
            raise AuditInputError("--config-json %s: the shrunk %s config did not build (%s: %s); fix it with "
                                  "--set or use --model %s" % (path, model_type, type(exc).__name__, exc, family)) from None
        return model, batch, "%s (%s, shrunk)" % (path, model_type), notes
    config = tiny_models.quiet(cfg_cls.from_dict, d)
    _apply_sets(config, sets)
    try:
        return _generic(config, "%s (%s, shrunk)" % (path, model_type), notes)
    except AuditInputError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise AuditInputError("--config-json %s: the shrunk config did not build (%s: %s); fix it with --set"
                              % (path, type(exc).__name__, exc)) from None


def apply_fused(model):
    """verl's fused-kernel forward on ``model`` (torch backend), as verl's workers install it.

    verl's ``apply_monkey_patch`` assigns forwards on the model *classes*
    (process-wide): a process that audits the fused forward should not audit
    unfused forwards of the same classes afterwards.
    """
    from fsdp2_compat.core import guards

    if guards.installed_version("verl") is None:
        raise AuditInputError("--fused needs verl installed (it runs verl's own fused-kernel forward)")
    import io

    from verl.models.transformers.monkey_patch import apply_monkey_patch

    with contextlib.redirect_stdout(io.StringIO()):  # verl prints what it patches
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
