"""nvJPEG's batched decoder on the GPU's hardware JPEG engines, through ``ctypes``.

``torchvision.io.decode_jpeg(..., device="cuda")`` keeps one nvJPEG decoder per process behind a
mutex and decodes with CUDA kernels: under a training step its calls queue behind the step's
kernels, and the two GPU decoding threads take turns (a call takes several times as long under
load as on an idle GPU). A100, H100 and later carry
hardware JPEG decoders (NVJPG engines) that nvJPEG reaches through its ``HARDWARE`` backend: they
use no SMs, so decoding runs beside the step instead of between its kernels. This module binds that
backend from the ``libnvjpeg`` that torchvision ships (no new dependency, no compiler): one
``HardwareDecoder`` per decoding thread (each its own handle and state, no shared lock).

The backend takes 8-bit baseline JPEGs in 4:4:4, 4:2:2, 4:2:0 or grayscale; the loader workers
judge which from the header (``samples.hardware_decodes``) and the caller decodes the others as
before. The same bytes always take the same path, and the engine gives the same pixels for the same
bytes, so the offload replay stays bit-identical. The call's arrays are made with numpy (no Python
per image), the short setup calls hold the interpreter lock, and the decode call releases it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["HardwareDecoder", "Layout", "NvJpegError", "hardware_decoder", "library_path", "release_thread_decoders"]

BACKEND_HARDWARE = 3
OUTPUT_RGB = 3  # planar RGB: three planes, as torchvision's [3, h, w]
STATUS = {0: "success", 1: "not initialized", 2: "invalid parameter", 3: "bad jpeg", 4: "jpeg not supported",
          5: "allocator failure", 6: "execution failed", 7: "arch mismatch (no hardware decoder on this GPU)",
          8: "internal error", 9: "implementation not supported", 10: "incomplete bitstream"}


class NvJpegError(RuntimeError):
    """An nvJPEG call that did not succeed (``status``: its code)."""

    def __init__(self, call: str, status: int, detail: str | None = None):
        super().__init__(f"nvJPEG {call}: {detail or STATUS.get(status, f'status {status}')}")
        self.status = status


class _Image(ctypes.Structure):  # nvjpegImage_t
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


def library_path() -> str | None:
    """The ``libnvjpeg`` to bind: torchvision's own copy first (the one its ``decode_jpeg`` uses),
    then one of the NVIDIA wheels, then the loader's search path; ``None`` when there is none."""
    candidates = []
    try:
        import torchvision

        root = os.path.dirname(os.path.dirname(torchvision.__file__))
        candidates += sorted(glob.glob(os.path.join(root, "torchvision.libs", "libnvjpeg*.so*")))
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvjpeg.so*")))
    except ImportError:
        pass
    candidates.append("libnvjpeg.so")
    for path in candidates:
        try:
            ctypes.CDLL(path)
            return path
        except OSError:
            continue
    return None


_libraries: tuple | None = None
_lock = threading.Lock()


def _bind():
    """``(quick, slow)``: the library as ``PyDLL`` (calls hold the interpreter lock: microseconds
    each) and as ``CDLL`` (the decode call, which releases it); argument types declared."""
    global _libraries
    with _lock:
        if _libraries is None:
            path = library_path()
            if path is None:
                raise NvJpegError("load", 1, "no libnvjpeg beside torchvision, in the NVIDIA wheels or on the "
                                              "library path")
            quick, slow = ctypes.PyDLL(path), ctypes.CDLL(path)
            p, n = ctypes.c_void_p, ctypes.c_int
            out = ctypes.POINTER
            for lib in (quick, slow):
                lib.nvjpegCreateEx.argtypes = [n, p, p, ctypes.c_uint, out(p)]
                lib.nvjpegDestroy.argtypes = [p]
                lib.nvjpegJpegStateCreate.argtypes = [p, out(p)]
                lib.nvjpegJpegStateDestroy.argtypes = [p]
                lib.nvjpegDecodeBatchedInitialize.argtypes = [p, p, n, n, n]
                lib.nvjpegDecodeBatched.argtypes = [p, p, out(p), out(ctypes.c_size_t), out(_Image), p]
            _libraries = (quick, slow)
    return _libraries


def _check(call: str, status: int) -> None:
    if status != 0:
        raise NvJpegError(call, status)


class Layout(NamedTuple):
    """Where a batch's decoded images go in one output buffer, grouped by size so that each group is
    one ``[m, 3, h, w]`` tensor: ``at[i]``, row ``i``'s first byte; ``order``, the rows group by
    group; ``unique`` sizes and their ``counts``; ``total`` bytes."""

    at: np.ndarray
    order: np.ndarray
    unique: np.ndarray
    counts: np.ndarray
    total: int

    @classmethod
    def of(cls, shapes: np.ndarray) -> Layout:
        """The layout of images of ``shapes [k, 2]`` (height, width), 3 planes each."""
        unique, inverse = np.unique(shapes, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        order = np.argsort(inverse, kind="stable")
        sizes = 3 * shapes[:, 0] * shapes[:, 1]
        at = np.empty(len(shapes), dtype=np.int64)
        at[order] = np.cumsum(sizes[order]) - sizes[order]
        return cls(at, order, unique, np.bincount(inverse, minlength=len(unique)), int(sizes.sum()))

    def destinations(self, base: int, shapes: np.ndarray) -> np.ndarray:
        """nvJPEG's output descriptors (``nvjpegImage_t``: 4 plane addresses, 4 pitches) for an
        output buffer at address ``base``: planar RGB, each plane ``width`` bytes a line."""
        out = np.zeros((len(shapes), 8), dtype=np.uint64)
        plane = shapes[:, 0] * shapes[:, 1]
        for channel in range(3):
            out[:, channel] = base + self.at + channel * plane
            out[:, 4 + channel] = shapes[:, 1]
        return out

    def groups(self):
        """``(rows, first byte, (height, width))`` per size."""
        done = 0
        for (height, width), count in zip(self.unique.tolist(), self.counts.tolist(), strict=True):
            rows = self.order[done:done + count]
            yield rows, int(self.at[rows[0]]), (height, width)
            done += count


class HardwareDecoder:
    """One nvJPEG handle on the ``HARDWARE`` backend with its batched-decoding state: used by one
    thread at a time. Raises ``NvJpegError`` when the GPU has no hardware JPEG decoder."""

    def __init__(self, device: torch.device):
        self.device = device
        self._quick, self._slow = _bind()
        self._handle, self._state = ctypes.c_void_p(), ctypes.c_void_p()
        with torch.cuda.device(device):
            _check("create (hardware backend)",
                   self._quick.nvjpegCreateEx(BACKEND_HARDWARE, None, None, 0, ctypes.byref(self._handle)))
            _check("state", self._quick.nvjpegJpegStateCreate(self._handle, ctypes.byref(self._state)))
        self._batch = 0  # the batch size the state is initialised for

    def decode(self, blob: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
               shapes: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The JPEGs at ``blob[starts[i]:starts[i] + lengths[i]]`` (``blob``: uint8, CPU), each of
        ``shapes[i]`` = (height, width), decoded to RGB in one batched call on the current CUDA stream
        (waited for: the bytes are read by then). Returns the images grouped by size: ``(rows,
        pixels [m, 3, h, w] uint8)`` per size, ``rows`` indexing the inputs. No Python work per
        image: the call's arrays are made with numpy. Raises ``NvJpegError`` if the batch fails (an
        image the hardware does not take, a corrupt one)."""
        k = len(starts)
        if k == 0:
            return []
        hw = shapes.numpy().astype(np.int64)
        plan = Layout.of(hw)
        out = torch.empty(plan.total, dtype=torch.uint8, device=self.device)
        destinations = plan.destinations(out.data_ptr(), hw)
        data = (blob.data_ptr() + starts.numpy().astype(np.int64)).astype(np.uint64)
        nbytes = lengths.numpy().astype(np.uint64)
        if k != self._batch:
            _check("batch initialise", self._quick.nvjpegDecodeBatchedInitialize(self._handle, self._state, k, 1,
                                                                                  OUTPUT_RGB))
            self._batch = k
        stream = torch.cuda.current_stream(self.device)
        status = self._slow.nvjpegDecodeBatched(
            self._handle, self._state, data.ctypes.data_as(ctypes.POINTER(ctypes.c_void_p)),
            nbytes.ctypes.data_as(ctypes.POINTER(ctypes.c_size_t)), destinations.ctypes.data_as(ctypes.POINTER(_Image)),
            ctypes.c_void_p(stream.cuda_stream))
        if status != 0:
            self._batch = 0  # a failed batch leaves the state to be initialised again
            raise NvJpegError("batched decode", status)
        stream.synchronize()  # the input bytes and the arrays above are read by now
        return [(torch.from_numpy(rows), out[start:start + len(rows) * 3 * h * w].view(len(rows), 3, h, w))
                for rows, start, (h, w) in plan.groups()]

    def close(self) -> None:
        if self._state:
            self._quick.nvjpegJpegStateDestroy(self._state)
        if self._handle:
            self._quick.nvjpegDestroy(self._handle)
        self._handle, self._state = ctypes.c_void_p(), ctypes.c_void_p()


_local = threading.local()


def hardware_decoder(device: torch.device) -> HardwareDecoder:
    """This thread's ``HardwareDecoder`` for ``device`` (made on first use, kept for the thread's
    life); raises ``NvJpegError`` where there is none."""
    decoders = getattr(_local, "decoders", None)
    if decoders is None:
        decoders = _local.decoders = {}
    if device not in decoders:
        decoders[device] = HardwareDecoder(device)
    return decoders[device]


def release_thread_decoders() -> None:
    """Close this thread's hardware decoders (a decoding thread calls it as it ends)."""
    for decoder in getattr(_local, "decoders", {}).values():
        decoder.close()
    _local.decoders = {}
