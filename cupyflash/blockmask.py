"""A mask_mod's tile map made once and kept: FlexAttention's BlockMask for cupyflash's expressions.

Every GPU call with a ``mask_mod`` runs on a tile map: which (B_r, B_c) tiles of each work head some
visible pair lies in, and which have every pair visible (``mask.cuh``: ``TileMap``; docs/semantics.md,
"What a mask_mod skips"). A call writes that map before its main kernel unless a like call kept it,
and a ``mask_mod`` that reads a ``mod_args`` array is written again at every call, since the array may
have changed. A :class:`BlockMask` holds the maps of one ``mask_mod`` over arrays its caller promises
not to change: each kernel's map (the forward's and the backward's tiles differ) is written by the
first call that needs it, on each CUDA stream, and read by every later call that passes the block mask.
"""

from __future__ import annotations

from typing import Optional

import numpy

from ._expr import user_mods

__all__ = ["BlockMask", "block_mask"]


class BlockMask:
    """A ``mask_mod`` with its ``mod_args`` and the shapes it serves, and its tile maps once made.

    Made by :func:`block_mask`; pass it as ``block_mask=`` to :func:`cupyflash.flash_attention_forward`,
    :func:`cupyflash.flash_attention_backward` or :func:`cupyflash.flash_attention` (and it passes on to
    :meth:`cupyflash.ForwardResult.backward`).

    Attributes
    ----------
    mask_mod : str
    mod_args : dict or None
        As given: the arrays are read by reference, and must not change while the block mask is used
        (a changed array is not seen by maps already made).
    batch_shape : tuple of int
    Nq, Nk : int
        The shapes of the calls it serves: q ``(*batch_shape, Nq, D)``, k and v ``(..., Nk, D)``.
    """

    def __init__(self, mask_mod: str, batch_shape, Nq: int, Nk: int, mod_args: Optional[dict] = None):
        if not isinstance(mask_mod, str):
            raise TypeError(f"mask_mod must be a str (a C expression), got {type(mask_mod).__name__}")
        user_mods(None, None, mask_mod, mod_args)   # the expression and its names, checked here
        if not (isinstance(batch_shape, tuple) and all(isinstance(n, (int, numpy.integer)) and n >= 0
                                                       for n in batch_shape)):
            raise ValueError(f"batch_shape must be a tuple of ints >= 0, got {batch_shape!r}")
        for name, n in (("Nq", Nq), ("Nk", Nk)):
            if not isinstance(n, (int, numpy.integer)) or isinstance(n, bool) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        self.mask_mod, self.mod_args = mask_mod, mod_args
        self.batch_shape, self.Nq, self.Nk = tuple(int(n) for n in batch_shape), int(Nq), int(Nk)
        self._maps: dict = {}          # (a plan's map key, stream) -> the map (_launch.TileMapPlan.locate)
        self._on_device: dict = {}     # device -> mod_args with each array a contiguous CuPy array there

    def __repr__(self):
        return (f"BlockMask({self.mask_mod!r}, batch_shape={self.batch_shape}, Nq={self.Nq}, Nk={self.Nk}, "
                f"maps={len(self._maps)})")

    def args_on(self, device: int) -> Optional[dict]:
        """``mod_args`` as the kernels on ``device`` read them, made once: each array a C-contiguous CuPy
        array on ``device`` (the given one where it already is), each number as given. The same arrays
        from call to call keep the maps' keys (their addresses are in them)."""
        if self.mod_args is None:
            return None
        args = self._on_device.get(device)
        if args is None:
            import cupy

            args = {}
            with cupy.cuda.Device(device):
                for name, value in self.mod_args.items():
                    if numpy.ndim(value) == 0 and not hasattr(value, "__cuda_array_interface__"):
                        args[name] = value
                    elif isinstance(value, cupy.ndarray) and value.device.id == device and value.flags.c_contiguous:
                        args[name] = value
                    else:
                        args[name] = cupy.ascontiguousarray(cupy.asarray(value))
            self._on_device[device] = args
        return args

    def check_call(self, q, k, mask_mod, mod_args):
        """ValueError unless a call of ``q``, ``k`` with these ``mask_mod`` and ``mod_args`` keywords is one
        this block mask serves: the same shapes, and no other expression or arguments."""
        if mask_mod is not None and mask_mod != self.mask_mod:
            raise ValueError(f"mask_mod {mask_mod!r} differs from the block_mask's {self.mask_mod!r}: give one")
        if mod_args is not None and mod_args is not self.mod_args:
            raise ValueError("mod_args is not the block_mask's own dict: with a block_mask the expressions read "
                             "its mod_args (leave mod_args out)")
        got = (tuple(numpy.shape(q)[:-2]), numpy.shape(q)[-2], numpy.shape(k)[-2])
        if got != (self.batch_shape, self.Nq, self.Nk):
            raise ValueError(f"block_mask serves batch_shape {self.batch_shape}, Nq {self.Nq}, Nk {self.Nk}; the "
                             f"call has q {tuple(numpy.shape(q))} and k {tuple(numpy.shape(k))}")


def block_mask(mask_mod: str, batch_shape, Nq: int, Nk: int, mod_args: Optional[dict] = None) -> BlockMask:
    """A ``mask_mod`` whose tile maps are made once and kept, for calls of one shape.

    Parameters
    ----------
    mask_mod : str
        The expression, as the calls' ``mask_mod`` (docs/semantics.md): True where query ``q_idx`` sees
        key ``kv_idx`` of batch entry ``b``.
    batch_shape : tuple of int
        The batch dims of the calls' q.
    Nq, Nk : int
        Their query and key lengths.
    mod_args : dict, optional
        The names ``mask_mod`` reads (and a ``score_mod`` of the same calls): arrays and numbers. The arrays
        must not change while the block mask is used; NumPy arrays are copied to each GPU once.

    Returns
    -------
    BlockMask
        Pass it as ``block_mask=``. A GPU call writes the tile map of its kernel the first time on its
        CUDA stream and reads it after; the NumPy path reads ``mask_mod`` as it would without it.

    Raises
    ------
    ValueError, TypeError
        A bad expression or name (as ``mask_mod`` would at a call), bad shapes.

    Notes
    -----
    Not for packed sequences (the ``varlen`` functions): their maps depend on the offsets of each call.
    """
    return BlockMask(mask_mod, batch_shape, Nq, Nk, mod_args)
