"""Quantized wrapper tensors as the plain tensors they hold.

torchao (`Int8Tensor`, `Float8Tensor`, `IntxUnpackedToInt8Tensor`, ...) and
optimum-quanto (`WeightQBytesTensor`, `TinyGemmWeightQBitsTensor`, ...) store a
quantized weight as a tensor subclass with no storage of its own: a wrapper
whose `__tensor_flatten__` names the plain tensors it computes from (int8 / fp8
/ packed uint8 data, scales, zero points), possibly through another wrapper
(quanto's packed int4 data). The plan streams those leaves like plain
parameters (each in its dtype's segment); `Structure` is what binding needs to
build the wrapper again over other tensors of the same form (slot views,
placeholders, tensors of its own on removal) with `__tensor_unflatten__`, and
what a state dict's wrapper must match to be loaded.

[Note: swap, not setattr] A library's own methods rebuild the wrapper from its
leaves (`model.to` does, through `__tensor_unflatten__`-like constructors), and
its outer size, dtype and device come from the leaves it was built over. Setting
a leaf attribute would leave those stale (a wrapper rebuilt over a (1,)
placeholder by `model.to` says (1,) forever); so each change of a parameter's
leaves builds a new wrapper over them and swaps it into the same Parameter
object (torch.utils.swap_tensors), once per parameter per change: the hooks
never do it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

Path = tuple  # attribute names from the wrapper down to a plain leaf: ("_data", "_data")


def is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def is_wrapper(t) -> bool:
    """A tensor subclass that flattens into inner tensors (not a DTensor: the plan
    streams a DTensor's local shard)."""
    return (isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, nn.Parameter)
            and callable(getattr(type(t), "__tensor_flatten__", None)) and not is_dtensor(t))


def library_type(t) -> str:
    cls = type(t)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class Leaf:
    path: Path
    dtype: torch.dtype
    shape: tuple
    stride: tuple


@dataclass(frozen=True)
class Structure:
    """A wrapper's form: its type, flatten context, outer size and stride, and for
    each inner tensor name either a Structure (a nested wrapper) or a Leaf."""

    cls: type
    ctx: object
    size: tuple
    stride: tuple
    inner: tuple  # ((name, Structure | Leaf), ...)

    def leaves(self) -> list[Leaf]:
        out = []
        for _, child in self.inner:
            out.extend(child.leaves() if isinstance(child, Structure) else [child])
        return out

    def mismatch(self, other: "Structure", where: str = "") -> str | None:
        """What differs between two forms (None: a value of `other`'s form can be
        copied leaf by leaf into one of this form)."""
        name = where or "the wrapper"
        if other.cls is not self.cls:
            return f"{name} is a {other.cls.__qualname__}, the model's is a {self.cls.__qualname__}"
        if _sequences_as_lists(other.ctx) != _sequences_as_lists(self.ctx):  # (JSON gives tuples back as lists)
            return f"{name} has flatten context {other.ctx!r}, the model's has {self.ctx!r}"
        if tuple(other.size) != tuple(self.size):
            return f"{name} has shape {list(other.size)}, the model's has {list(self.size)}"
        mine, theirs = dict(self.inner), dict(other.inner)
        if mine.keys() != theirs.keys():
            return f"{name} holds inner tensors {sorted(theirs)}, the model's holds {sorted(mine)}"
        for key, a in mine.items():
            b = theirs[key]
            sub = f"{where}.{key}" if where else key
            if isinstance(a, Structure) != isinstance(b, Structure):
                return f"{sub} is {'a wrapper' if isinstance(b, Structure) else 'plain'} in the state dict only"
            if isinstance(a, Structure):
                why = a.mismatch(b, sub)
                if why:
                    return why
            elif (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
                return f"{sub} is {b.dtype}{list(b.shape)} in the state dict, {a.dtype}{list(a.shape)} in the model"
        return None


def _sequences_as_lists(value):
    """`value` with every tuple a list, in dicts and lists too: a flatten context read
    back from JSON (torchao's safetensors form) says [1, 256] for the (1, 256) it saved."""
    if isinstance(value, (list, tuple)):
        return [_sequences_as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _sequences_as_lists(v) for k, v in value.items()}
    return value


def structure(t: torch.Tensor, prefix: Path = ()) -> Structure:
    names, ctx = t.__tensor_flatten__()
    inner = []
    for name in names:
        child = getattr(t, name)
        path = prefix + (name,)
        if is_wrapper(child):
            inner.append((name, structure(child, path)))
        else:
            inner.append((name, Leaf(path, child.dtype, tuple(child.shape), tuple(child.stride()))))
    return Structure(type(t), ctx, tuple(t.shape), tuple(t.stride()), tuple(inner))


def leaf_tensors(t: torch.Tensor, prefix: Path = ()) -> dict:
    """{path: plain inner tensor}, recursively."""
    out = {}
    for name in t.__tensor_flatten__()[0]:
        child = getattr(t, name)
        if is_wrapper(child):
            out.update(leaf_tensors(child, prefix + (name,)))
        else:
            out[prefix + (name,)] = child
    return out


def leaf(t: torch.Tensor, path: Path) -> torch.Tensor:
    for name in path:
        t = getattr(t, name)
    return t


def rebuild(form: Structure, tensors: dict) -> torch.Tensor:
    """A new wrapper of `form` over `tensors` ({path: plain tensor} for every leaf)."""
    inner = {name: rebuild(child, tensors) if isinstance(child, Structure) else tensors[child.path]
             for name, child in form.inner}
    return form.cls.__tensor_unflatten__(inner, form.ctx, form.size, form.stride)


def rebind(param: torch.Tensor, form: Structure, tensors: dict) -> None:
    """Point the wrapper parameter `param` (the same Python object) at `tensors`: a
    wrapper rebuilt over them is swapped in (module doc, [Note: swap, not
    setattr]); attributes of `param` that the rebuilt wrapper does not set
    (`_is_param`, a library's or the user's own) are kept."""
    torch.utils.swap_tensors(param, rebuilt(param, form, tensors))


def swap_refused(param: torch.Tensor) -> str | None:
    """Why torch.utils.swap_tensors would refuse to swap into `param` (its own
    checks, made before anything changes), or None."""
    refs = weakref.getweakrefs(param)
    if refs:
        return f"it is referenced weakly ({refs[0]!r})"
    count = param._use_count()
    if count > 2 or (count == 2 and not param.is_leaf):
        return f"its tensor is referenced {count - 1} more time(s) from outside Python (an autograd graph, say)"
    return None


def rebuilt(param: torch.Tensor, form: Structure, tensors: dict) -> torch.Tensor:
    """What `rebind` swaps into `param`, built and nothing changed: the library's
    `__tensor_unflatten__` runs here (it may raise), so that a transaction can build
    every wrapper first and then only swap (torch.utils.swap_tensors)."""
    new = rebuild(form, tensors)
    for key, value in param.__dict__.items():
        if key not in new.__dict__:
            new.__dict__[key] = value
    if new.requires_grad != param.requires_grad:
        new.requires_grad_(param.requires_grad)
    return new


def check_rebindable(name: str, param: torch.Tensor, form: Structure) -> None:
    """Refuse (before anything changes) a wrapper parameter that cannot be rebuilt
    over other tensors: its unflatten must give back a wrapper of the same form
    over the very tensors it was given."""
    what = f"parameter {name!r} is a {library_type(param)} (a quantized wrapper tensor)"
    current = leaf_tensors(param)
    try:
        probe = rebuild(form, current)
        same = type(probe) is type(param) and all(
            leaf(probe, path) is t or leaf(probe, path).data_ptr() == t.data_ptr() for path, t in current.items())
    except Exception as err:  # noqa: BLE001 - the library's own error, reported with the remedy
        raise ValueError(
            f"{what} that layerwise cannot rebuild over its streamed bytes: {type(param).__qualname__}."
            f"__tensor_unflatten__ failed with {type(err).__name__}: {err}. Keep that module out of the "
            "streamed groups, or dequantize it first. The model is unchanged."
        ) from None
    if weakref.getweakrefcount(param):
        raise ValueError(
            f"{what} that is referenced weakly ({weakref.getweakrefs(param)[0]!r}): torch cannot swap a new "
            "wrapper into a weakly referenced tensor, so layerwise cannot rebind it to its streamed bytes. Drop "
            "the weak reference, or keep that module out of the streamed groups. The model is unchanged."
        )
    if not same:
        raise ValueError(
            f"{what} whose __tensor_unflatten__ does not rebuild it over the inner tensors it is given; "
            "layerwise cannot stream it. Keep that module out of the streamed groups, or dequantize it first. "
            "The model is unchanged."
        )


# ---------------------------------------------------------- quantized checkpoints
def checkpoint_forms(metadatas) -> dict:
    """{parameter name: the JSON form torchao saved it with}, over the `__metadata__` of
    every file of a checkpoint (each shard lists its own tensors)."""
    out = {}
    for metadata in metadatas:
        out.update(_torchao_forms(metadata))
    return out


def _torchao_forms(metadata: dict) -> dict:
    """{parameter name: its JSON form} where `metadata` is a torchao safetensors header's
    (torchao.prototype.safetensors.flatten_tensor_state_dict, which transformers'
    save_pretrained of a torchao model uses): `tensor_names` lists every tensor and each
    has a JSON `_type` (a wrapper class, or "Tensor")."""
    import json

    try:
        names = json.loads(metadata.get("tensor_names", "null"))
    except (TypeError, ValueError):
        return {}
    if not isinstance(names, list):
        return {}
    out = {}
    for name in names:
        try:
            form = json.loads(metadata.get(name, "null"))
        except (TypeError, ValueError):
            continue
        if isinstance(form, dict) and form.get("_type") not in (None, "Tensor"):
            out[name] = form
    return out


def checkpoint_leaf_keys(name: str, param, form: Structure, stored: dict, forms: dict) -> dict:
    """{leaf path: checkpoint key} for the wrapper parameter `name` of a model built on
    meta and quantized like the checkpoint, each key holding exactly the leaf's dtype
    and shape. Two layouts are read: torchao's safetensors (`<module>._<attr>_<inner>`,
    the wrapper's form in the metadata, which must rebuild a wrapper of the model's
    form: type, flatten context, shapes) and a state dict whose keys are the inner
    tensors' own (`<name>.<inner>`: optimum-quanto's qint8 / qfloat8). Anything else
    is a ValueError naming the parameter, its library type, what the checkpoint holds
    and what to do; `stored`: {key: a header entry with dtype and shape}, `forms`:
    checkpoint_forms of the checkpoint's files."""
    what = f"load_offloaded: parameter {name!r} is a {library_type(param)} (a quantized wrapper tensor)"
    remedy = (" Save the checkpoint from a model quantized the same way (torchao: flatten_tensor_state_dict, "
              "as transformers' save_pretrained writes it; quanto: its state_dict), or load it into a model "
              "built with its weights (the library's own loader) and call layerwise.configure_layerwise_offload. "
              "The model is unchanged.")
    cls = type(param)
    if cls.__module__.startswith("optimum.quanto") and cls.__name__ == "WeightQBitsTensor":
        raise ValueError(
            f"{what}: optimum-quanto chooses its int4 layout from the device the weights are on when it freezes "
            "them (TinyGemmWeightQBitsTensor on a CPU or CUDA device in bf16, with scale and shift packed "
            "together), and a model frozen on meta keeps the portable WeightQBitsTensor, which computes other "
            "values. Load the checkpoint with quanto's own loader (optimum.quanto.requantize) into a model on "
            "the device, then call layerwise.configure_layerwise_offload. The model is unchanged.")
    module, _, attr = name.rpartition(".")
    leaves = form.leaves()
    ao = forms.get(name)

    def check(keys):
        for leaf in leaves:
            s = stored.get(keys[leaf.path])
            if s is None:
                return f"its inner tensor {'.'.join(leaf.path)} is not in the checkpoint under {keys[leaf.path]!r}"
            if (s.dtype, tuple(s.shape)) != (leaf.dtype, tuple(leaf.shape)):
                return (f"{keys[leaf.path]!r} is {s.dtype}{list(s.shape)} in the checkpoint, the model's inner "
                        f"tensor is {leaf.dtype}{list(leaf.shape)}")
        return None

    if ao is not None:
        kind = ao.get("_type")
        if kind != form.cls.__name__:
            raise ValueError(f"{what}; the checkpoint holds it as a torchao {kind} (torchao safetensors)." + remedy)
        if any(len(leaf.path) != 1 for leaf in leaves):
            raise ValueError(f"{what} with nested inner tensors, which torchao's safetensors layout does not "
                             "hold." + remedy)
        keys = {leaf.path: f"{module}._{attr}_{leaf.path[0]}" if module else f"_{attr}_{leaf.path[0]}"
                for leaf in leaves}
        why = check(keys)
        if why is None:
            why = _torchao_mismatch(form, ao, keys, stored)
        if why:
            raise ValueError(f"{what}; the checkpoint's torchao {kind} does not match it: {why}." + remedy)
        return keys
    keys = {leaf.path: f"{name}.{'.'.join(leaf.path)}" for leaf in leaves}
    why = check(keys)
    if why is None:
        return keys
    if name in stored:
        s = stored[name]
        why = f"the checkpoint holds it as a plain {s.dtype}{list(s.shape)} tensor (an unquantized checkpoint?)"
    else:
        own = sorted(k for k in stored if k.startswith(name + "."))
        if own:
            why += f"; the checkpoint holds {', '.join(own[:8])} under it"
    raise ValueError(f"{what}; {why}." + remedy)


def _torchao_mismatch(form: Structure, ao: dict, keys: dict, stored: dict) -> str | None:
    """What differs between the model's wrapper and the one torchao rebuilds from the
    checkpoint's JSON form over meta tensors of the stored dtypes and shapes (None: alike)."""
    import copy

    try:
        from torchao.prototype.safetensors.safetensors_utils import object_from_dict
    except ImportError as err:
        return f"torchao cannot read its safetensors form here ({err})"
    data = copy.deepcopy(ao)
    data.setdefault("_data", {}).update(
        {path[0]: torch.empty(stored[k].shape, dtype=stored[k].dtype, device="meta") for path, k in keys.items()})
    try:
        theirs = object_from_dict(data)
    except Exception as err:  # noqa: BLE001 - torchao's own error, reported with the remedy
        return f"torchao cannot rebuild it ({type(err).__name__}: {err})"
    return form.mismatch(structure(theirs))
