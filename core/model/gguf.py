"""A small direct GGUF reader: metadata, tensor index, and dequantization.

Reads the header with struct and maps tensor data with numpy (no copy until
dequantized). Supports the tensor types small Llama-family files use: F32,
F16, BF16, Q4_0, Q4_1, Q8_0. Errors name the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"

# metadata value types
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# tensor types: (name, elements per block, bytes per block)
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_TYPES = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    Q4_0: ("Q4_0", 32, 18),
    Q4_1: ("Q4_1", 32, 20),
    Q8_0: ("Q8_0", 32, 34),
    BF16: ("BF16", 1, 2),
}


class GGUFError(ValueError):
    pass


@dataclass(slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest first); GGUF stores it reversed
    ggml_type: int
    offset: int  # from the start of the file


class _Reader:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("<I"), self.take("<Q")
            if itype in _SCALAR:
                fmt = _SCALAR[itype]
                size = struct.calcsize(fmt)
                arr = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += size * count
                return arr
            return [self.value(itype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata type {vtype}")


class GGUFFile:
    """Metadata (``metadata``) and tensors (``tensors``) of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise GGUFError(f"{self.path}: cannot read ({exc})") from None
        r = _Reader(self._data.data, self.path)
        if bytes(self._data[:4]) != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        r.pos = 4
        version = r.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            self.metadata[key] = r.value(r.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.take("<Q") for _ in range(r.take("<I"))]
            ggml_type, offset = r.take("<I"), r.take("<Q")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = (r.pos + align - 1) // align * align
        self.tensors = {n: TensorInfo(n, shape, t, start + off) for n, shape, t, off in infos}
        for info in self.tensors.values():
            if info.ggml_type not in _TYPES:
                raise GGUFError(f"{self.path}: tensor {info.name} has unsupported type {info.ggml_type}")
            if info.offset + self._nbytes(info) > len(self._data):
                raise GGUFError(f"{self.path}: tensor {info.name} runs past the end of the file (truncated?)")

    @staticmethod
    def _nbytes(info: TensorInfo) -> int:
        _, per_block, block_bytes = _TYPES[info.ggml_type]
        return int(np.prod(info.shape)) // per_block * block_bytes

    def type_name(self, name: str) -> str:
        return _TYPES[self.tensors[name].ggml_type][0]

    def array(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32 (bf16/f16 kept as float32 too)."""
        info = self.tensors[name]
        return dequantize(self._raw(info), info.ggml_type, int(np.prod(info.shape))).reshape(info.shape)

    def blocks(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, one row per output row (uint8 [rows, bytes])."""
        info = self.tensors[name]
        return self._raw(info).reshape(info.shape[0], -1)

    def _raw(self, info: TensorInfo) -> np.ndarray:
        return self._data[info.offset : info.offset + self._nbytes(info)]


def dequantize(raw: np.ndarray, ggml_type: int, count: int) -> np.ndarray:
    if ggml_type == F32:
        return raw.view(np.float32).copy()
    if ggml_type == F16:
        return raw.view(np.float16).astype(np.float32)
    if ggml_type == BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    _, _, block_bytes = _TYPES[ggml_type]
    blocks = raw.reshape(-1, block_bytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    if ggml_type == Q8_0:
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(count)
    if ggml_type == Q4_0:
        q = _nibbles(blocks[:, 2:]).astype(np.float32) - 8.0
        return (d * q).reshape(count)
    # Q4_1: scale d and minimum m, then 16 bytes of nibbles
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = _nibbles(blocks[:, 4:]).astype(np.float32)
    return (d * q + m).reshape(count)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are elements 0-15, the high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)
