"""Models built without weights, made ready for load_offloaded: `empty_model`
(parameters on meta, buffers computed for real), buffers left on meta recomputed
from the config of the module that owns them, the ties a model declares, and
the dtypes `load_offloaded(dtype=)` gives: as `from_pretrained(dtype=)` gives them
for a model that declares modules to keep in fp32, else as `model.to(dtype)` makes
them (with a warning where `from_pretrained` would keep a buffer in fp32)."""
from __future__ import annotations

import contextlib
import inspect
import logging
import re
import threading
import weakref

import torch
from torch import nn

log = logging.getLogger("layerwise")


_EMPTY = threading.local()  # per thread: {id(host param): (weak ref, meta twin)} while empty_model runs
_EMPTY_LOCK = threading.Lock()
_EMPTY_USERS = [0, None]  # threads inside empty_model, the original register_parameter


def _register_parameter(module, name, param):
    _EMPTY_USERS[1](module, name, param)
    made = getattr(_EMPTY, "made", None)
    if made is None:  # another thread, not building an empty model: untouched
        return
    p = module._parameters.get(name)
    if p is None or p.is_meta:  # a meta one registered again (a tie): kept, so the tie holds
        return
    ref, meta = made.get(id(p), (None, None))
    if ref is None or ref() is not p:  # (a dead one's id may have been reused)
        meta = type(p)(p.to("meta"), requires_grad=p.requires_grad)
        meta.__dict__.update(p.__dict__)
        made[id(p)] = (weakref.ref(p), meta)
    module._parameters[name] = meta


@contextlib.contextmanager
def _parameters_on_meta():
    """While active in this thread, every parameter a module registers moves to the
    meta device (the same Python object under every name it is registered by, so
    weights tied in __init__ stay tied); buffers are left where their code puts
    them. Other threads building modules meanwhile are not affected: the patched
    register_parameter acts only in a thread that is inside empty_model."""
    with _EMPTY_LOCK:
        if _EMPTY_USERS[0] == 0:
            _EMPTY_USERS[1] = nn.Module.register_parameter
            nn.Module.register_parameter = _register_parameter
        _EMPTY_USERS[0] += 1
    outer = getattr(_EMPTY, "made", None)
    _EMPTY.made = outer if outer is not None else {}
    try:
        yield
    finally:
        _EMPTY.made = outer
        with _EMPTY_LOCK:
            _EMPTY_USERS[0] -= 1
            if _EMPTY_USERS[0] == 0:
                nn.Module.register_parameter = _EMPTY_USERS[1]


def empty_model(factory, *args, **kwargs):
    """`factory(*args, **kwargs)` (a model class, a `from_config`, any callable) with
    every parameter on the meta device and every buffer computed for real: what
    `load_offloaded` needs for a model whose buffers (RoPE tables, say) are computed
    in `__init__` and not saved in checkpoints. Like
    `accelerate.init_empty_weights()`, but weights tied in `__init__` stay tied."""
    with _parameters_on_meta():
        return factory(*args, **kwargs)


def _config_factory(mod: nn.Module):
    """A way to build a fresh `mod` from its config, or None: a diffusers model
    (`from_config`) or a module whose only required argument is `config`
    (transformers models, and their rotary embeddings)."""
    config = getattr(mod, "config", None)
    if config is None or isinstance(config, (int, float, str, bool)):
        return None
    cls = type(mod)
    if callable(getattr(cls, "from_config", None)) and hasattr(cls, "register_to_config"):  # diffusers
        return lambda: cls.from_config(config)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    rest_optional = all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params[1:])
    if params and params[0].name == "config" and rest_optional:
        return lambda: cls(config)
    return None


def _settings(mod: nn.Module) -> dict:
    """A module's plain settings (numbers, strings, flags and tuples of them): what
    its constructor arguments left behind."""
    plain = (int, float, str, bool, type(None))
    return {k: v for k, v in vars(mod).items() if not k.startswith("_") and k != "training"
            and (isinstance(v, plain) or (isinstance(v, (tuple, list)) and all(isinstance(x, plain) for x in v)))}


def _built_differently(mod: nn.Module, twin: nn.Module, rel: str) -> str | None:
    """The first setting in which `twin` (rebuilt from the config) differs from `mod`,
    on the rebuilt module or the module that owns buffer `rel`, else None."""
    owner = rel.rpartition(".")[0]
    pairs = [(type(mod).__name__, mod, twin)]
    if owner:
        pairs.append((owner, mod.get_submodule(owner), twin.get_submodule(owner)))
    for where, a, b in pairs:
        sa, sb = _settings(a), _settings(b)
        for k in sorted(set(sa) | set(sb)):
            if sa.get(k) != sb.get(k):
                return f"{where}.{k} ({sa.get(k)!r} vs {sb.get(k)!r})"
    return None


def recompute_buffers(model: nn.Module, wanted: dict, as_computed: bool = False) -> tuple[dict, dict]:
    """Values for buffers no checkpoint holds ({full name: buffer, on meta or cast}):
    each is taken from a fresh copy of the nearest module on its path that can be
    rebuilt from its config (built with parameters on meta, so it costs no weights),
    in the buffer's dtype, or with `as_computed` in the dtype the copy computes it in.
    Returns ({name: host tensor}, {name: why it could not be recomputed})."""
    modules = dict(model.named_modules())
    twins: dict[str, object] = {}
    values, why = {}, {}
    for full, meta in wanted.items():
        prefix = full.rpartition(".")[0]
        reasons = []
        while True:
            mod = modules[prefix]
            make = _config_factory(mod)
            if make is not None:
                if prefix not in twins:
                    try:
                        with torch.device("cpu"):
                            twins[prefix] = empty_model(make)
                    except Exception as e:  # noqa: BLE001  (any failure: the buffer is unrecoverable)
                        twins[prefix] = e
                twin = twins[prefix]
                rel = full[len(prefix) + 1:] if prefix else full
                what = f"{type(mod).__name__}(config)"
                if isinstance(twin, Exception):
                    reasons.append(f"building {what} failed: {type(twin).__name__}: {twin}")
                else:
                    try:
                        t = twin.get_buffer(rel)
                    except AttributeError:
                        t = None
                    if t is None or t.is_meta:
                        reasons.append(f"{what} has no buffer {rel!r} with values")
                    elif tuple(t.shape) != tuple(meta.shape):
                        reasons.append(f"{what} computes {rel!r} with shape {list(t.shape)}, not "
                                       f"{list(meta.shape)}")
                    elif (diff := _built_differently(mod, twin, rel)) is not None:
                        reasons.append(f"the model's {diff} differs from what {what} gives, so it was built with "
                                       "other arguments and the value would be a guess")
                    else:
                        values[full] = (t if as_computed else t.to(meta.dtype), what)
                        break
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
        if full not in values:
            owner = type(modules[full.rpartition(".")[0]]).__name__
            why[full] = "; ".join(reasons) or f"neither {owner} nor a module above it has a config to rebuild it from"
    return values, why


# ------------------------------------------------------------ tied weights
def _declared_ties(model: nn.Module) -> list[tuple[str, str]]:
    """(target, source) parameter names that the model says share one tensor: the
    tied weights of a transformers model, as its config has them now."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)  # transformers >= 5
    if callable(expand):
        try:
            return list(expand(all_submodels=True).items())
        except Exception:  # noqa: BLE001  (a mapping it cannot expand: fall back on what post_init found)
            ties = getattr(model, "all_tied_weights_keys", None)
            return list(ties.items()) if isinstance(ties, dict) else []
    config = getattr(model, "config", None)  # transformers 4: word embeddings, when the config ties them
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    if not getattr(config, "tie_word_embeddings", False) or not callable(get_out) or not callable(get_in):
        return []
    try:
        out, inp = get_out(), get_in()
    except Exception:  # noqa: BLE001
        return []
    where = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    if out is None or inp is None or id(out) not in where or id(inp) not in where:
        return []
    return [(f"{where[id(out)]}.weight".lstrip("."), f"{where[id(inp)]}.weight".lstrip("."))]


def tie_declared(model: nn.Module) -> bool:
    """Tie the weights the model declares tied but holds as separate parameters (as a
    model built under accelerate.init_empty_weights does): model.tie_weights(), then
    by hand whatever that left. True if anything changed."""
    def param(name):
        try:
            return model.get_parameter(name)
        except AttributeError:
            return None

    loose = [(t, s) for t, s in _declared_ties(model)
             if param(t) is not None and param(s) is not None and param(t) is not param(s)]
    if not loose:
        return False
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    for target, source in loose:
        if param(target) is not param(source):
            mod_name, _, attr = target.rpartition(".")
            model.get_submodule(mod_name)._parameters[attr] = param(source)
    log.info("layerwise: %s declares tied weights that are separate parameters (%s): tied them%s before loading",
             type(model).__name__, ", ".join(f"{t} -> {s}" for t, s in loose),
             " with model.tie_weights()" if callable(tie) else "")
    return True


def from_pretrained_rule(model: nn.Module, dtype: torch.dtype):
    """For a model that declares modules to keep in fp32 (`_keep_in_fp32_modules`,
    transformers' `_keep_in_fp32_modules_strict`): what `from_pretrained(path, dtype)`
    of its library keeps in fp32, as a predicate on a tensor's state-dict name. None
    for any other model (`dtype=` is then `model.to(dtype)`).

    The rules as diffusers 0.42 and transformers 5 apply them. diffusers (ModelMixin):
    the class's `_keep_in_fp32_modules`, for any dtype; a name is kept when one of
    them is one of its dot-separated parts (`"norm2" in "blocks.0.norm2.weight".split(".")`).
    transformers (PreTrainedModel): the model's `_keep_in_fp32_modules` (its
    submodels' gathered by post_init) in fp16 only, its `_keep_in_fp32_modules_strict`
    in fp16 and bf16; each is a pattern (`*` any text) searched anywhere in the name
    (`"gate.weight"` keeps `mlp.gate.weight`)."""
    for cls in type(model).__mro__:
        library = cls.__module__.partition(".")[0]
        if cls.__name__ == "ModelMixin" and library == "diffusers":
            names = getattr(type(model), "_keep_in_fp32_modules", None)
            if not names:
                return None
            names = [names] if isinstance(names, str) else list(names)
            return lambda key: any(n in key.split(".") for n in names)
        if cls.__name__ == "PreTrainedModel" and library == "transformers":
            loose = list(getattr(model, "_keep_in_fp32_modules", None) or ())
            strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
            if not loose and not strict:
                return None
            patterns = (loose if dtype == torch.float16 else []) + \
                       (strict if dtype in (torch.float16, torch.bfloat16) else [])
            if not patterns:
                return lambda key: False
            found = re.compile("|".join(p.replace("*", ".*") for p in patterns))
            return lambda key: found.search(key) is not None
    return None


def dtype_at_load(dtype: torch.dtype, keep):
    """The dtype `load_offloaded(dtype=)` gives a parameter or a checkpoint buffer:
    (tensor, its full names) -> dtype. Floating-point ones take `dtype`, except those
    `keep` (from_pretrained_rule) keeps in fp32 under any of their names; others keep theirs."""
    def want(t: torch.Tensor, names) -> torch.dtype:
        if not t.is_floating_point():
            return t.dtype
        return torch.float32 if keep is not None and any(keep(n) for n in names) else dtype
    return want


def retype(model: nn.Module, dtype: torch.dtype, keep=None) -> bool:
    """Give every floating-point parameter whose dtype at load (dtype_at_load) is not
    its own a fresh meta parameter of that dtype (same shape and strides), under every
    name it has. True if any changed."""
    want = dtype_at_load(dtype, keep)
    names: dict[int, list[str]] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{prefix}.{attr}" if prefix else attr)
    new: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is None or want(p, names[id(p)]) == p.dtype:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty_like(p, dtype=want(p, names[id(p)]), device="meta"),
                                          requires_grad=p.requires_grad)
            mod._parameters[attr] = new[id(p)]
    return bool(new)


def _unlike_from_pretrained(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """The fp32 buffers the model computed (non-persistent: RoPE `inv_freq`) that
    `dtype=` casts, as model.to(dtype) would, where `from_pretrained(dtype=...)`
    leaves them as computed."""
    if dtype == torch.float32:
        return []
    return [f"{n}.{attr}" if n else attr for n, mod in model.named_modules() for attr, b in mod._buffers.items()
            if b is not None and attr in mod._non_persistent_buffers_set and b.dtype == torch.float32]


def warn_unlike_from_pretrained(model: nn.Module, dtype: torch.dtype) -> None:
    """For a model without fp32 modules to keep (from_pretrained_rule is None), where
    `dtype=` is model.to(dtype): a WARNING naming the fp32 buffers it casts."""
    buffers = _unlike_from_pretrained(model, dtype)
    if not buffers:
        return
    listed = ", ".join(buffers[:8]) + (f" (and {len(buffers) - 8} more)" if len(buffers) > 8 else "")
    log.warning(
        "layerwise: load_offloaded(dtype=%s) casts the fp32 buffers the model computes (%s) to %s, as "
        "model.to(%s) would, where from_pretrained(dtype=%s) keeps them in fp32; outputs will differ. To match "
        "from_pretrained, build the model in that dtype (transformers: from_config(config, dtype=%s)) from a "
        "checkpoint stored in it, and leave dtype= out (docs/loading.md)",
        dtype, listed, dtype, dtype, dtype, dtype)
