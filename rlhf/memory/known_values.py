"""The values of small integer tensors under fake tensors: what the memory simulation needs
to know to take the same path as a real step.

Fake tensors have shapes and no data, but a training step reads some values on the host:
a packed row's sample boundaries (`cu_seqlens.tolist()`: which slices the per-sample
attention takes), the GRPO groups' sizes (`bincount`), a mask's positions (`nonzero`),
Megatron's drop-and-pad expert token counts (`tokens_per_expert.tolist()`). These come from
the batch (token ids, lengths, group ids), never from the weights, and are small integer
or bool tensors. `rlhf.memory.fake_device.LiveBytes` keeps, next to each such fake tensor
(integer or bool, at most `LIMIT` elements), the real tensor it would be (`KNOWN`: an
attribute of the fake tensor, so it lives and dies with it): every aten op whose inputs are
all known or real runs once more on the real values (`propagate`), an op that writes into a
known tensor with unknown inputs makes it unknown (`forget`), and ops whose output shape
depends on values (`nonzero`, `bincount`, a bool-mask index) are answered from the known
values (`by_value`, `bool_indices`).

Values that depend on the weights are not known: a scalar read of one (`.item()` of a
gradient norm, a finite check) answers 1 (True for bool) and a mask of unknown values is
taken as all set (`nonzero`): a simulated step takes the path of a finite step whose
gradients need no clipping below 1 and whose tokens all count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

LIMIT = 1 << 16  # elements of the largest tensor whose values are carried (a row's tokens)
KNOWN = "_simulated_value"
CPU = torch.device("cpu")


class Unknown(Exception):
    """An input whose value is not known."""


def exact(t: torch.Tensor) -> bool:
    """A tensor whose values are carried: integer or bool, small."""
    return not (t.is_floating_point() or t.is_complex()) and t.numel() <= LIMIT


def known(t: object) -> torch.Tensor | None:
    """The real values of fake tensor `t`, when carried."""
    return getattr(t, KNOWN, None)


def _real(x: object) -> object:
    """The real counterpart of an op argument (devices become the CPU)."""
    if isinstance(x, FakeTensor):
        value = known(x)
        if value is None:
            raise Unknown
        return value
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta" or not exact(x):
            raise Unknown
        return x
    if isinstance(x, torch.device):
        return CPU
    return x


def _run_real(func, args: tuple, kwargs: dict) -> Any:
    real_args, real_kwargs = tree_map(_real, (args, kwargs))
    if "device" in real_kwargs:
        real_kwargs["device"] = CPU
    with _disable_current_modes():
        return func(*real_args, **real_kwargs)


def forget(func, args: tuple) -> None:
    """`func` may have written into its tensor arguments with values not known."""
    if func._schema.is_mutable:
        for t in tree_leaves(args):
            if isinstance(t, FakeTensor) and known(t) is not None:
                delattr(t, KNOWN)


def propagate(func, args: tuple, kwargs: dict, out: object) -> None:
    """Carry the values of `func`'s small exact outputs, from real inputs or known ones."""
    outs = [t for t in tree_leaves(out) if isinstance(t, FakeTensor)]
    uncarried = (
        not outs
        or not all(exact(t) for t in outs)
        or func.namespace != "aten"
        or torch.Tag.nondeterministic_seeded in func.tags
        or "empty" in func.__name__  # uninitialised
    )
    if uncarried:
        forget(func, args)
        return
    try:
        real = _run_real(func, args, kwargs)
    except (Unknown, RuntimeError, ValueError, IndexError, TypeError):
        forget(func, args)
        return
    reals = [t for t in tree_leaves(real) if isinstance(t, torch.Tensor)]
    if len(reals) != len(outs):
        return
    for fake, value in zip(outs, reals):
        if fake.shape == value.shape:
            setattr(fake, KNOWN, value)


def _as_fake(value: object, device: torch.device) -> object:
    """A real result as a fake tensor on `device` (the fake tensor mode is current), carrying
    its values when exact."""
    if not isinstance(value, torch.Tensor):
        return value
    fake = value.to(device)
    if exact(value):
        setattr(fake, KNOWN, value)
    return fake


def by_value(func, args: tuple, kwargs: dict) -> object:
    """An op whose output shape depends on its inputs' values, computed from the known
    values (raises `Unknown` when one is not known)."""
    device = next(t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor))
    return tree_map(lambda r: _as_fake(r, device), _run_real(func, args, kwargs))


def nonzero(mask: torch.Tensor) -> torch.Tensor:
    """`mask.nonzero()`; a mask of unknown values is taken as all set."""
    value = known(mask)
    with _disable_current_modes():
        if value is None:
            value = torch.ones(mask.shape, dtype=torch.bool)
        real = value.nonzero()
    result = _as_fake(real, mask.device)
    assert isinstance(result, torch.Tensor)
    return result


def bool_indices(args: tuple) -> tuple:
    """`aten.index` / `index_put` arguments with a known bool mask replaced by the integer
    positions it selects (a bool mask makes the output's shape depend on its values)."""
    indices = list(args[1])
    for i, index in enumerate(indices):
        value = known(index) if index is not None else None
        if value is None or value.dtype not in (torch.bool, torch.uint8):
            continue
        with _disable_current_modes():
            positions = value.nonzero(as_tuple=True)
        indices[i : i + 1] = [_as_fake(p, args[0].device) for p in positions]
        return (args[0], indices, *args[2:])
    return args


def scalar(t: torch.Tensor) -> bool | int | float:
    """`t.item()`: its known value, else 1 (True for bool: see the module docstring)."""
    value = known(t)
    if value is not None:
        with _disable_current_modes():
            return value.item()
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.is_floating_point() else 1
