"""Eager's reference outputs, kept compactly.

Every candidate is compared with eager's outputs on every recorded sample and every probe, so those
references live for the whole of a graph's tuning. A :class:`ReferenceStore` keeps them:

* on the host: a CUDA output is copied to host memory chunk by chunk (no second full copy on the device);
* without needless copies: a CPU output is kept as eager returned it, cloned only when it shares memory with
  the module's parameters/buffers (a later state restore would change it) or is a view into a larger
  storage (which it would keep alive);
* spilled to disk once the graph's references pass ``spill_bytes`` in total (default :data:`SPILL_BYTES`,
  256 MiB; ``$AITUNE_REFERENCE_SPILL_BYTES`` overrides it): every tensor is written, flattened, to a
  safetensors file in a temporary folder of the graph's workdir, and read back one chunk at a time. A
  check then holds one candidate output plus one chunk of the reference.

NOTE [reference storage]: a kept output is a :class:`StoredOutputs` — the tree's structure and its leaves,
tensors as :class:`StoredTensor` — not a rebuilt container, so user containers (transformers' caches,
dataclasses) are never constructed around objects that are not tensors. :class:`StoredTensor` remembers the
original shape, dtype, device and memory format, which correctness rule 1 compares; values are read in
logical (row-major) order through :func:`chunk_plan`, whatever the original strides. The file is written
here chunk by chunk rather than with ``safetensors.torch.save_file``, which needs the whole tensor
contiguous on the host (a second full copy of a CUDA or non-contiguous output), and read with plain reads
into a chunk-sized tensor rather than ``safe_open(...).get_slice``: safetensors maps the file, and every
page a slice touched counts in the process's resident memory while the file is open (measured: a 0.5 GiB
reference compared once added 0.5 GiB of resident file pages). The files stay standard safetensors.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import weakref
from pathlib import Path
from typing import Any, Iterator

import torch

from aitune.torch.record.pytree import TreeSpec, tree_flatten

logger = logging.getLogger(__name__)

SPILL_BYTES = 256 * 2**20  # a graph's references above this (bytes, in total) go to a file
# Elements per chunk when comparing, copying to the host or writing a file. A comparison holds a few
# chunk-sized temporaries: measured on CPU (a 0.5 GiB fp32 output), 2^22 elements added ~230 MiB of resident
# memory to the check, 2^20 ~70 MiB; per-chunk overhead stays negligible (~1 ms of work per chunk).
CHUNK_ELEMENTS = 2**20
SPILL_ENV = "AITUNE_REFERENCE_SPILL_BYTES"

# safetensors' dtype names (https://huggingface.co/docs/safetensors, "Format"); others stay in memory.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def spill_bytes_from_env(default: int = SPILL_BYTES) -> int:
    """``$AITUNE_REFERENCE_SPILL_BYTES`` (bytes; ``0`` spills every reference), else ``default``."""
    value = os.environ.get(SPILL_ENV, "").strip()
    if not value:
        return default
    try:
        return max(int(value), 0)
    except ValueError:
        logger.warning("aitune: %s=%r is not a number of bytes; using %d", SPILL_ENV, value, default)
        return default


def chunk_plan(shape: torch.Size | tuple, chunk_elements: int = CHUNK_ELEMENTS) -> Iterator[tuple[tuple, int, int]]:
    """Split a tensor of ``shape`` into pieces of at most about ``chunk_elements`` elements, in logical order.

    Yields:
        ``(index, start, stop)``: ``tensor[index]`` is the piece (a view: leading integers, then one slice) and
        ``[start, stop)`` its range in the row-major flattening. The plan depends on the shape only, so two
        tensors of one shape but different strides are split alike. A piece holds whole rows of the first
        dimension whose rows fit a chunk, so it can exceed ``chunk_elements`` only when a single row of the
        last dimension does not (never: the last dimension is split by elements).
    """
    chunk_elements = max(int(chunk_elements), 1)

    def walk(prefix: tuple, dims: tuple, base: int):
        if not dims:
            yield prefix, base, base + 1
            return
        inner = math.prod(dims[1:])
        if dims[0] == 0 or inner == 0:
            return
        if inner <= chunk_elements:
            rows = max(1, chunk_elements // inner)
            for first in range(0, dims[0], rows):
                last = min(first + rows, dims[0])
                yield prefix + (slice(first, last),), base + first * inner, base + last * inner
        else:
            for row in range(dims[0]):
                yield from walk(prefix + (row,), dims[1:], base + row * inner)

    yield from walk((), tuple(shape), 0)


def flat_piece(tensor: torch.Tensor, index: tuple) -> torch.Tensor:
    """``tensor[index]`` flattened (a view when that piece is contiguous, else a copy of the piece only)."""
    return tensor[index].reshape(-1)


def piece_of(leaf: "torch.Tensor | StoredTensor", index: tuple, start: int, stop: int) -> torch.Tensor:
    """One chunk of a leaf, flattened: :meth:`StoredTensor.piece` for a kept reference, else :func:`flat_piece`
    (``index`` / ``start``/``stop`` from :func:`chunk_plan`)."""
    return leaf.piece(index, start, stop) if isinstance(leaf, StoredTensor) else flat_piece(leaf, index)


def memory_format(tensor: torch.Tensor) -> str:
    """``"channels_last"`` / ``"channels_last_3d"`` (4-D / 5-D tensors in that layout and not plain
    contiguous), ``"contiguous"``, or ``"strided"`` (any other strides)."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if tensor.dim() == 5 and not tensor.is_contiguous() and \
            tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "contiguous" if tensor.is_contiguous() else "strided"


def tensor_nbytes(value: Any) -> int:
    """Bytes of the tensors in a nested value (raw outputs or :class:`StoredOutputs`)."""
    leaves = value.leaves if isinstance(value, StoredOutputs) else tree_flatten(value)[0]
    return sum(leaf.nbytes for leaf in leaves if isinstance(leaf, (torch.Tensor, StoredTensor)))


class StoredTensor:
    """One tensor of a kept reference: its shape, dtype, device and memory format as eager returned it, and its
    values — in host memory (any strides) or in a safetensors file (flattened, under ``name``).

    Not a dataclass on purpose: aitune's pytree opens dataclasses, and this must stay one leaf.
    """

    __slots__ = ("shape", "dtype", "device", "memory_format", "_values", "_file", "_offset", "_store")

    def __init__(self, tensor: torch.Tensor, values: torch.Tensor | None, memory_format: str, store: "ReferenceStore"):
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.memory_format = memory_format
        self._values, self._file, self._offset, self._store = values, None, 0, store

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def is_complex(self) -> bool:
        return self.dtype.is_complex

    @property
    def spilled(self) -> bool:
        return self._file is not None

    def piece(self, index: tuple, start: int, stop: int) -> torch.Tensor:
        """The flattened piece ``[start, stop)`` (``index`` as in :func:`chunk_plan`), on the host."""
        if self._values is not None:
            return flat_piece(self._values, index)
        return self._store.read(self._file, self._offset, self.dtype, start, stop)

    def tensor(self) -> torch.Tensor:
        """The whole tensor on the host (contiguous): for small references and tests, never in the checks."""
        if self._values is not None:
            return self._values.contiguous()
        return self._store.read(self._file, self._offset, self.dtype, 0, self.numel()).reshape(self.shape)

    def __repr__(self) -> str:
        where = f"file {self._file.name}" if self._file is not None else "host memory"
        return f"StoredTensor({str(self.dtype).removeprefix('torch.')}{list(self.shape)} from {self.device}, {where})"


class StoredOutputs:
    """One call's outputs as kept: the tree's structure and its leaves (tensors as :class:`StoredTensor`,
    constants as they were). :func:`aitune.torch.check.correctness.OutputComparator.compare` takes it in place of
    the outputs (NOTE [reference storage])."""

    __slots__ = ("spec", "leaves")

    def __init__(self, spec: TreeSpec, leaves: list):
        self.spec, self.leaves = spec, leaves

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self)


def flatten_outputs(value: Any) -> tuple[list, TreeSpec]:
    """``tree_flatten`` that also takes a :class:`StoredOutputs` (its leaves and structure as kept)."""
    if isinstance(value, StoredOutputs):
        return value.leaves, value.spec
    return tree_flatten(value)


def leaf_magnitudes(value: Any, chunk_elements: int = CHUNK_ELEMENTS) -> list[float | None]:
    """Per leaf of ``value`` (raw outputs or :class:`StoredOutputs`), the largest finite ``|x|`` of a floating
    tensor (0.0 when it has none), None for other leaves; read one chunk at a time."""
    magnitudes: list[float | None] = []
    for leaf in flatten_outputs(value)[0]:
        if not isinstance(leaf, (torch.Tensor, StoredTensor)) or not leaf.is_floating_point():
            magnitudes.append(None)
            continue
        largest = 0.0
        for index, start, stop in chunk_plan(leaf.shape, chunk_elements):
            piece = piece_of(leaf, index, start, stop).detach()
            piece = piece[torch.isfinite(piece)]
            if piece.numel():
                largest = max(largest, float(piece.abs().max()))
        magnitudes.append(largest)
    return magnitudes


def all_finite(value: Any, chunk_elements: int = CHUNK_ELEMENTS) -> bool:
    """No NaN/Inf in the floating/complex tensors of ``value`` (raw outputs or :class:`StoredOutputs`), checked
    one chunk at a time."""
    for leaf in flatten_outputs(value)[0]:
        if not isinstance(leaf, (torch.Tensor, StoredTensor)) or not (leaf.is_floating_point() or leaf.is_complex()):
            continue
        for index, start, stop in chunk_plan(leaf.shape, chunk_elements):
            piece = piece_of(leaf, index, start, stop)
            if not bool(torch.isfinite(piece).all()):
                return False
    return True


class ReferenceStore:
    """Where one graph's reference outputs are kept (see the module docstring).

    Args:
        directory: the graph's workdir; spilled files go to a temporary folder inside it, removed by
            :meth:`close` (or when the store is garbage collected). None: never spill.
        module: the eager module; outputs sharing memory with its parameters/buffers are cloned when kept.
        spill_bytes: once the references kept pass this many bytes in total, all of them are written to files.
            None: never spill.
        chunk_elements: elements per chunk when copying to the host or writing.
    """

    def __init__(self, directory: Path | str | None = None, *, module: torch.nn.Module | None = None,
                 spill_bytes: int | None = SPILL_BYTES, chunk_elements: int = CHUNK_ELEMENTS):
        self.directory = None if directory is None else Path(directory)
        self.module = module
        self.spill_bytes = spill_bytes if directory is not None else None
        self.chunk_elements = chunk_elements
        self.nbytes = 0  # bytes of every tensor kept so far (in memory or spilled)
        self._groups: list[list[StoredTensor]] = []  # per kept call, its tensors (to spill them later)
        self._folder: Path | None = None
        self._files = itertools.count()
        self._handles: dict[Path, Any] = {}  # open files of spilled references
        self._finalizer = None

    @property
    def spilling(self) -> bool:
        """True once the references are written to files (everything kept from then on too)."""
        return self.spill_bytes is not None and self.nbytes > self.spill_bytes

    def keep(self, outputs: Any) -> StoredOutputs:
        """Keep one call's outputs (eager's on a sample or probe, or an input after the call).

        The returned object holds no reference to ``outputs``' tensors once they are spilled, so the caller's
        copy is freed when it drops it.
        """
        leaves, spec = tree_flatten(outputs)
        state = self._state_storages()
        kept, group = [], []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided or leaf.is_nested:
                kept.append(leaf)
                continue
            leaf = leaf.detach()
            stored = StoredTensor(leaf, self._host_values(leaf, state), memory_format(leaf), self)
            kept.append(stored)
            group.append(stored)
            self.nbytes += stored.nbytes
        result = StoredOutputs(spec, kept)
        if group:
            self._groups.append(group)
        if self.spilling:
            for earlier in self._groups:
                self._spill(earlier)
            self._groups.clear()
        return result

    def close(self) -> None:
        """Remove the spilled files (the references read from them cannot be used after)."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        if self._finalizer is not None:
            self._finalizer()

    # ---- internals
    def _state_storages(self) -> set[int]:
        if self.module is None:
            return set()
        tensors = itertools.chain(self.module.parameters(), self.module.buffers())
        return {tensor.untyped_storage().data_ptr() for tensor in tensors if tensor.device.type != "meta"}

    def _host_values(self, tensor: torch.Tensor, state: set[int]) -> torch.Tensor:
        """The values to keep in memory: on the host, not sharing memory with the module, compact."""
        if tensor.device.type != "cpu":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            flat = host.view(-1)
            for index, start, stop in chunk_plan(tensor.shape, self.chunk_elements):
                flat[start:stop].copy_(flat_piece(tensor, index))
            return host
        storage = tensor.untyped_storage()
        if storage.data_ptr() in state or storage.nbytes() > tensor.numel() * tensor.element_size():
            with torch.inference_mode(False):
                return tensor.clone()
        return tensor

    def _spill(self, group: list[StoredTensor]) -> None:
        """Write a kept call's in-memory tensors to one safetensors file; their values are dropped."""
        group = [stored for stored in group if stored._values is not None and stored.dtype in _SAFETENSORS_DTYPES]
        if not group:
            return
        path = self._new_file()
        header, offset = {}, 0
        for position, stored in enumerate(group):
            header[str(position)] = {"dtype": _SAFETENSORS_DTYPES[stored.dtype], "shape": [stored.numel()],
                                     "data_offsets": [offset, offset + stored.nbytes]}
            offset += stored.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes
        with open(path, "wb") as file:
            file.write(struct.pack("<Q", len(text)))
            file.write(text)
            for stored in group:
                for index, _, _ in chunk_plan(stored.shape, self.chunk_elements):
                    piece = flat_piece(stored._values, index).contiguous()
                    if piece.numel():
                        file.write(_bytes_of(piece))
        data_start, offset = 8 + len(text), 0
        for stored in group:
            stored._values, stored._file, stored._offset = None, path, data_start + offset
            offset += stored.nbytes
        logger.debug("reference outputs spilled to %s (%d bytes kept in all)", path, self.nbytes)

    def _new_file(self) -> Path:
        if self._folder is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix="references-", dir=self.directory))
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._folder), True)
        return self._folder / f"{next(self._files)}.safetensors"

    def read(self, path: Path, offset: int, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of a spilled tensor whose data begins at byte ``offset`` of ``path``: a new
        host tensor, read with plain reads (NOTE [reference storage]: no mapping of the file)."""
        piece = torch.empty(stop - start, dtype=dtype)
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        handle.seek(offset + start * dtype.itemsize)
        view, done = _bytes_of(piece), 0
        while done < len(view):
            count = handle.readinto(view[done:])
            if not count:
                raise OSError(f"{path}: the spilled reference file ended early")
            done += count
        return piece


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, writable and without a copy (no numpy needed)."""
    size = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")
