"""CuPy arrays over memory another framework owns (a torch tensor's, an XLA buffer's), kept by what they view.

``cupyflash.torch`` and ``cupyflash.jax`` pass each call's arguments and outputs to cupyflash as such
arrays: no DLPack capsule, no copy. A training step's tensors come back at the same addresses step after
step (torch's caching allocator, XLA's), so most calls find their arrays here: one costs about 1.5-2 us
to make on the H200 machine's host, a look-up a tenth of that.
"""

from __future__ import annotations

_KEPT: dict = {}
MAX_KEPT = 4096


def view(address: int, nbytes: int, shape: tuple, dtype, strides, device: int, owner=None):
    """A ``cupy.ndarray`` of ``shape`` and NumPy ``dtype`` with ``strides`` in bytes (None: C order) over
    the ``nbytes`` bytes at ``address`` on ``device``, holding ``owner`` (the tensor or buffer whose memory
    it is; None: the caller keeps that alive while it uses the array). An empty array where ``nbytes`` is
    0: such a tensor may have no address."""
    import cupy

    if not nbytes:   # on ``device``, which need not be the current one
        with cupy.cuda.Device(device):
            return cupy.ndarray(shape, dtype)
    memory = cupy.cuda.UnownedMemory(address, nbytes, owner, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


def device_view(address: int, nbytes: int, shape: tuple, dtype, strides, device: int):
    """``view`` holding no owner, made once per these values: the caller uses it only while the owner's
    memory lives, for the length of one call."""
    key = (address, nbytes, shape, dtype, strides, device)
    array = _KEPT.get(key)
    if array is None:
        array = view(address, nbytes, shape, dtype, strides, device)
        if len(_KEPT) >= MAX_KEPT:
            _KEPT.clear()
        _KEPT[key] = array
    return array
