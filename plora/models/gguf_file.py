"""A GGUF file's metadata and tensor table, read in a fraction of a second.

The ``gguf`` package's reader builds a numpy view for every element of every metadata array:
SmolLM2's 49,152 tokens and 48,900 merges took it 3.5 s on one core, before anything was
converted. The format's header is a flat list of typed values (the ``gguf`` specification:
magic, version, counts, key/value pairs, tensor infos, then the aligned tensor data), so it
is read here with `struct` in one pass; number arrays become numpy arrays at once, string
arrays Python lists. The tensors themselves are not read: each one's type, shape and byte
offset is, for `plora.models.gguf_native` to map what it dequantizes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GGUFFile", "GGUFFormatError", "TensorInfo", "read_gguf"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

#: value type -> (struct format, numpy dtype) of the specification's scalar types
_SCALARS = {
    0: ("<B", "u1"), 1: ("<b", "i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (the message says where)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    #: ggml's order: the first dimension is the fastest-varying (a linear layer's ``in`` features)
    dims: tuple[int, ...]
    #: ggml's type number (``gguf.GGMLQuantizationType``)
    ggml_type: int
    #: bytes from the start of the file
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape as torch and numpy spell it (rows first)."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    #: where the tensor data starts (the tensor infos' offsets are from here, aligned)
    data_start: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"the header ends early (at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"a string runs past the end of the file (at byte {self.pos})")
        text = _utf8(bytes(self.buf[self.pos:end]), self.pos)
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"unknown value type {vtype} (at byte {self.pos})")
        value = self.take(_SCALARS[vtype][0])
        return bool(value) if vtype == _BOOL else value

    def array(self) -> Any:
        import numpy as np

        etype, count = self.take("<I"), self.take("<Q")
        if etype == _STRING:
            out = []
            buf, pos, unpack = self.buf, self.pos, struct.unpack_from
            try:
                for _ in range(count):
                    (n,) = unpack("<Q", buf, pos)
                    pos += 8
                    if pos + n > len(buf):
                        raise struct.error
                    out.append(_utf8(bytes(buf[pos:pos + n]), pos))
                    pos += n
            except struct.error:
                raise GGUFFormatError(f"a string array runs past the end of the file (at byte {pos})") from None
            self.pos = pos
            return out
        if etype == _ARRAY:
            return [self.array() for _ in range(count)]
        if etype not in _SCALARS:
            raise GGUFFormatError(f"unknown array element type {etype} (at byte {self.pos})")
        dtype = np.dtype(_SCALARS[etype][1])
        end = self.pos + dtype.itemsize * count
        if end > len(self.buf):
            raise GGUFFormatError(f"an array runs past the end of the file (at byte {self.pos})")
        values = np.frombuffer(self.buf[self.pos:end], dtype=dtype).copy()
        self.pos = end
        return values.astype(bool) if etype == _BOOL else values


def _utf8(raw: bytes, at: int) -> str:
    """A copy's text: a view of the map would outlive the map in an error's traceback."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise GGUFFormatError(f"a string that is not UTF-8 (at byte {at})") from None


def read_gguf(path: str | Path) -> GGUFFile:
    """The header of the GGUF file at ``path``. Raises GGUFFormatError where it is not one."""
    import mmap

    path = Path(path)
    with path.open("rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise GGUFFormatError("the file is empty") from None
    with mapped:
        buf = memoryview(mapped)
        try:
            return _parse(path, buf)
        finally:
            buf.release()


def _parse(path: Path, buf: memoryview) -> GGUFFile:
    if bytes(buf[:4]) != _MAGIC:
        raise GGUFFormatError("no GGUF magic at its start")
    c = _Cursor(buf)
    c.pos = 4
    version = c.take("<I")
    if version > 0xFFFF and struct.unpack("<I", struct.pack(">I", version))[0] in (2, 3):
        raise GGUFFormatError("a big-endian GGUF file (this reader reads little-endian files)")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (this reader reads versions 2 and 3)")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        if key in metadata:
            raise GGUFFormatError(f"the key {key!r} twice")
        metadata[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("<I")
        dims = tuple(c.take("<Q") for _ in range(n_dims))
        infos.append((name, dims, c.take("<I"), c.take("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-c.pos // alignment) * alignment
    tensors = {name: TensorInfo(name, dims, ggml_type, data_start + offset) for name, dims, ggml_type, offset in infos}
    if len(tensors) != len(infos):
        raise GGUFFormatError("a tensor name twice")
    return GGUFFile(path, version, metadata, tensors, data_start)
