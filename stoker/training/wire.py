"""What peers send each other: tensors and JSON, never pickles.

`broadcast_object_list` and `gather_object` unpickle whatever another machine sends, which is code execution for
anyone who reaches the group. Here a value (nested dicts, lists and tuples of tensors, numbers, strings, None)
travels as one uint8 tensor: an 8-byte length, a JSON description (the structure, each tensor's dtype and shape)
and the tensors' bytes. Decoding builds only those types; anything else is refused on both sides.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in vars(torch).values()
           if isinstance(dtype, torch.dtype)}
_LENGTH = torch.int64
MAX_MESSAGE_BYTES = 64 << 30  # a replica's state with its optimizer: far below; a peer cannot claim more
_SCALARS = (type(None), bool, int, float, str)


class WireError(ValueError):
    """A value that cannot be sent, or bytes that do not describe one."""


def pack(value: Any) -> torch.Tensor:
    tensors: list[torch.Tensor] = []
    tree = _encode(value, tensors)
    header = json.dumps({"tree": tree, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                   for t in tensors]}).encode()
    parts = [torch.tensor([len(header)], dtype=_LENGTH).view(torch.uint8), torch.frombuffer(bytearray(header),
                                                                                             dtype=torch.uint8)]
    parts += [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts)


def unpack(buffer: torch.Tensor) -> Any:
    buffer = buffer.cpu()
    try:
        length = int(buffer[:8].clone().view(_LENGTH))
        header = json.loads(bytes(buffer[8:8 + length].numpy()))
        tensors, offset = [], 8 + length
        for dtype_name, shape in header["tensors"]:
            dtype = _DTYPES[dtype_name]
            size = _numel(shape) * dtype.itemsize
            if offset + size > buffer.numel():
                raise WireError(f"{size} bytes of a tensor missing")
            tensors.append(buffer[offset:offset + size].clone().view(dtype).reshape(shape))
            offset += size
        return _decode(header["tree"], tensors)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:
        raise WireError(f"not a stoker message ({type(error).__name__}: {error})") from None


def send(value: Any, dst: int, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """Point-to-point (`dst` a global rank); `device` is the one the backend of `group` moves data from (the GPU
    for NCCL, the host for gloo)."""
    buffer = pack(value).to(device)
    dist.send(torch.tensor([buffer.numel()], dtype=_LENGTH, device=device), dst, group=group)
    dist.send(buffer, dst, group=group)


def recv(src: int, device: torch.device, group: dist.ProcessGroup | None = None) -> Any:
    size = torch.empty(1, dtype=_LENGTH, device=device)
    dist.recv(size, src, group=group)
    claimed = int(size.item())
    if not 0 <= claimed <= MAX_MESSAGE_BYTES:
        raise WireError(f"rank {src} announced a message of {claimed} bytes (at most {MAX_MESSAGE_BYTES} accepted)")
    buffer = torch.empty(claimed, dtype=torch.uint8, device=device)
    dist.recv(buffer, src, group=group)
    return unpack(buffer)


def broadcast(value: Any, src: int, device: torch.device) -> Any:
    """`value` of rank `src` on every rank (`value` is ignored elsewhere)."""
    buffer = pack(value).to(device) if dist.get_rank() == src else None
    size = torch.tensor([buffer.numel() if buffer is not None else 0], dtype=_LENGTH, device=device)
    dist.broadcast(size, src)
    if buffer is None:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src)
    return value if dist.get_rank() == src else unpack(buffer)


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise WireError(f"cannot send a {value.layout} tensor")
        tensors.append(value)
        return {"x": len(tensors) - 1}
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, dict):
        return {"d": [[_encode(key, tensors), _encode(item, tensors)] for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"t" if isinstance(value, tuple) else "l": [_encode(item, tensors) for item in value]}
    raise WireError(f"cannot send a {type(value).__name__}: only tensors, numbers, strings, None, lists, tuples "
                    "and dicts travel between processes")


def _decode(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, _SCALARS):
        return tree
    if not isinstance(tree, dict) or len(tree) != 1:
        raise WireError(f"unexpected {type(tree).__name__} in the description")
    (tag, body), = tree.items()
    if tag == "x":
        return tensors[body]
    if tag == "d":
        return {_decode(key, tensors): _decode(item, tensors) for key, item in body}
    if tag in ("l", "t"):
        items = [_decode(item, tensors) for item in body]
        return tuple(items) if tag == "t" else items
    raise WireError(f"unknown tag {tag!r} in the description")


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        if not isinstance(size, int) or size < 0:
            raise WireError(f"bad tensor shape {shape}")
        count *= size
    return count
