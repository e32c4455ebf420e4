"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

gguf-py's `GGUFReader` builds a numpy view for every entry of every metadata array (24 s for
Gemma 3's 262144-token vocabulary on a 2-core machine); here string arrays are read with one
`struct` call each and numeric arrays as one `frombuffer`. The value types, quantisation block
sizes and dequantisation still come from gguf-py.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32}


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGML order: fastest dimension first
    data: np.ndarray  # a view of the file, as `gguf.quants.dequantize` takes it


@dataclasses.dataclass
class GGUFFile:
    fields: dict  # metadata key -> str, number, bool or list
    tensors: list[Tensor]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[vtype])
        itype, n = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype])
            out = np.frombuffer(self.buf, dtype, n, self.pos)
            self.pos += dtype.itemsize * n
            return out.tolist()
        return [self.value(itype) for _ in range(n)]


def read(path: str | Path) -> GGUFFile:
    """Parse `path`'s header; tensor data stay in the memory map until dequantised. Raises
    ValueError (or struct.error) on a malformed or truncated file."""
    mapped = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(mapped))
    if bytes(cur.buf[:4]) != MAGIC:
        raise ValueError("bad magic bytes")
    cur.pos = 4
    version, n_tensors, n_fields = cur.unpack("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (jaxspec reads 2 and 3)")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.unpack(f"<{cur.unpack('<I')}Q")
        dims = (dims,) if isinstance(dims, int) else dims
        table.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, qtype, offset in table:
        shape = tuple(reversed(dims))
        n = int(np.prod(dims))
        if qtype in _PLAIN:
            dtype, count = np.dtype(_PLAIN[qtype]), n
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            dtype, count, shape = np.dtype(np.uint8), n // block * size, \
                quant_shape_to_byte_shape(shape, qtype)
        at = start + offset
        if at + count * dtype.itemsize > len(mapped):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(mapped, dtype, count, at).reshape(shape)
        tensors.append(Tensor(name, qtype, dims, data))
    return GGUFFile(fields, tensors)
