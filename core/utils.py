"""Small helpers that core, the plugins and the planner share."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``), without floats: the blocks ``a`` tokens take."""
    return -(-a // b)


def tensor_bytes(*roots: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots``: modules (their
    parameters, buffers and attributes), lists, tuples, dicts, and objects' attributes (packed
    weights hold their tensors there). Each storage is counted once, however many views of it."""
    import torch

    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_mkldnn or obj.layout != torch.strided:  # opaque (oneDNN-packed) or sparse: no storage
                storages[id(obj)] = obj.numel() * obj.element_size()
                continue
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters(recurse=False))
            stack.extend(obj.buffers(recurse=False))
            stack.extend(obj.children())
            stack.extend(v for k, v in vars(obj).items() if not k.startswith("_"))
        elif type(obj).__module__.startswith("tokenloom."):
            fields = getattr(obj, "__dict__", None) or {s: getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())}
            stack.extend(fields.values())
    return sum(storages.values())
