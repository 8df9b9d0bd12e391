"""A GGUF file's key/values and tensor table, read in one pass over a memory map.

The `gguf` package's ``GGUFReader`` keeps every value as a numpy view and so builds ~250,000
of them for a 49k-token vocabulary and its merges: 5 s on each open of the embedded model, paid
by every engine start (once to plan, once to load). This reader decodes the header with
``struct`` and bulk numeric arrays with one ``numpy.frombuffer`` each (about 0.1 s) and gives the
same values: :attr:`GGUFFile.metadata` holds what ``ReaderField.contents()`` returns for each key,
and each of :attr:`GGUFFile.tensors` carries the same ``data`` view, shape and type as the
package's ``ReaderTensor`` (tests/test_gguf.py compares the two on every file the tests write).
Writing GGUF and decoding its quantised types stay with the `gguf` package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
)
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct code (uint8, int8, uint16, int16, uint32, int32, float32, bool, -, -,
# uint64, int64, float64)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# tensor types whose data the package exposes as typed elements, not bytes
_ELEMENT = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
            GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
            GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, slots=True)
class GGUFTensorEntry:
    """One tensor of the table. ``shape`` is in ggml's order (innermost first), as the file
    stores it; ``data`` is a read-only view of the memory map in numpy's order (elements for
    F16/F32/F64/I*, bytes of the blocks otherwise)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """``GGUFFile(path)``: ``metadata`` (key -> value) and ``tensors``, no weight read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data.data)  # the map's bytes
        if len(self._buf) < 24 or struct.unpack_from("<I", self._buf, 0)[0] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version = struct.unpack_from("<I", self._buf, 4)[0]
        self._order: Literal["<", ">"] = "<"
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            version = struct.unpack_from(">I", self._buf, 4)[0]
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} (this reader reads {SUPPORTED_VERSIONS})")
        self.version = version
        n_tensors, n_kv = struct.unpack_from(self._order + "QQ", self._buf, 8)
        self._offs = 24
        self.metadata: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key = self._string()
                if key in self.metadata:
                    raise ValueError(f"{self.path}: key {key!r} appears twice")
                self.metadata[key] = self._value(self._u32())
            infos = [self._tensor_info() for _ in range(n_tensors)]
        except struct.error:
            raise ValueError(f"{self.path}: the header runs past the end of the file (truncated?)") from None
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        self.data_offset = -(-self._offs // alignment) * alignment
        self.tensors: list[GGUFTensorEntry] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"{self.path}: tensor {name!r} appears twice")
            seen.add(name)
            self.tensors.append(self._tensor(name, dims, raw_type, self.data_offset + offset))
        del self._buf  # the tensors' views keep the map alive

    # ---- the header, field by field ----------------------------------------------------
    def _u32(self) -> int:
        value = struct.unpack_from(self._order + "I", self._buf, self._offs)[0]
        self._offs += 4
        return value

    def _u64(self) -> int:
        value = struct.unpack_from(self._order + "Q", self._buf, self._offs)[0]
        self._offs += 8
        return value

    def _string(self) -> str:
        n = self._u64()
        start = self._offs
        self._offs += n
        if self._offs > len(self._buf):
            raise struct.error("string past the end")
        return str(self._buf[start:self._offs], "utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._u32(), self._u64()
            if item in _SCALAR:  # a numeric array in one read
                dtype = np.dtype(_SCALAR[item]).newbyteorder(self._order)
                if self._offs + count * dtype.itemsize > len(self._buf):
                    raise struct.error("array past the end")
                values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._offs)
                self._offs += values.nbytes
                return values.tolist()
            return [self._value(item) for _ in range(count)]
        code = _SCALAR.get(kind)
        if code is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self._offs}")
        value = struct.unpack_from(self._order + code, self._buf, self._offs)[0]
        self._offs += struct.calcsize(code)
        return value

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._u32()
        dims = struct.unpack_from(f"{self._order}{n_dims}Q", self._buf, self._offs)
        self._offs += 8 * n_dims
        raw_type = self._u32()
        return name, dims, raw_type, self._u64()

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensorEntry:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}") from None
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block
        np_dims = tuple(reversed(dims))
        if qtype in _ELEMENT:
            dtype = np.dtype(_ELEMENT[qtype]).newbyteorder(self._order)
            count = n_elements
        else:
            dtype, count = np.dtype(np.uint8), n_bytes
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        if offset + n_bytes > len(self.data):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        data = np.frombuffer(self._buf, dtype=dtype, count=count, offset=offset).reshape(np_dims)
        return GGUFTensorEntry(name, qtype, dims, n_elements, n_bytes, offset, data)
