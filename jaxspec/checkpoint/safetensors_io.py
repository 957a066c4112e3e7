"""safetensors files, read by hand: headers, memory-mapped per-tensor views, the shard index, a writer.

The `safetensors` package's numpy framework cannot return F8_* / F4 tensors (numpy has no such
dtypes) and its other frameworks copy whole tensors. Here a file is one `np.memmap` and a tensor a
view into it, so reading a slice of a tensor copies (and pages in) only that slice: a process that
holds a quarter of the experts reads a quarter of their bytes. `Reader` counts what it copies.

Layout of a file: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data;
offsets count from byte 8 + N. A sharded checkpoint adds `model.safetensors.index.json`,
`{"metadata": {...}, "weight_map": {name: file}}`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"

# safetensors dtype -> numpy storage dtype of one element.
STORAGE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
# "F4" (e2m1): the header shape counts elements, two per byte along the last axis, low nibble first
# (the layout of torch.float4_e2m1fn_x2). Read as uint8 bytes [..., n / 2].
PACKED_FP4 = "F4"
SUPPORTED = (*STORAGE, PACKED_FP4)
_WRITE = {v: k for k, v in STORAGE.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str  # as stored in the file
    file: str  # absolute path
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]  # as the header declares it (F4: elements)
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """Shape of the stored array: the header's, except packed F4 ([..., n] -> [..., n / 2] bytes)."""
        if self.dtype == PACKED_FP4:
            return (*self.shape[:-1], self.shape[-1] // 2)
        return self.shape

    def storage_dtype(self) -> np.dtype:
        if self.dtype == PACKED_FP4:
            return np.dtype(np.uint8)
        if self.dtype not in STORAGE:
            raise ValueError(
                f"tensor {self.name!r} in {os.path.basename(self.file)} has unsupported dtype {self.dtype!r} "
                f"(supported: {', '.join(SUPPORTED)})"
            )
        return STORAGE[self.dtype]


def read_header(filename: str) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo of one .safetensors file (reads the header only)."""
    name = os.path.abspath(filename)  # errors name the file in full: a folder may hold many shards
    size = os.path.getsize(filename)
    with open(filename, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{name} is truncated or not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"{name} is truncated or not a safetensors file (header length {n} > file size {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{name} is truncated or not a safetensors file (malformed header: {e})") from None
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(s) for s in entry["shape"])
            begin, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name}: malformed header entry for tensor {key!r}: {entry!r}") from None
        info = TensorInfo(key, os.path.abspath(filename), dtype, shape, base + int(begin), base + int(end))
        if not base <= info.begin <= info.end <= size:
            raise ValueError(f"{name} is truncated or not a safetensors file: tensor {key!r} has data offsets "
                             f"{[begin, end]} outside the file")
        if dtype in STORAGE or dtype == PACKED_FP4:
            count = math.prod(shape)
            want = count // 2 if dtype == PACKED_FP4 else count * STORAGE[dtype].itemsize
            if (dtype == PACKED_FP4 and (not shape or shape[-1] % 2)) or info.nbytes != want:
                raise ValueError(
                    f"{name}: tensor {key!r} ({dtype} {list(shape)}) holds {info.nbytes} bytes, expected {want}"
                )
        out[key] = info
    return out


class Reader:
    """Per-tensor views into memory-mapped files; counts the bytes copied out, per tensor."""

    def __init__(self) -> None:
        self._maps: dict[str, np.memmap] = {}
        self.bytes_read: collections.Counter[str] = collections.Counter()

    def view(self, info: TensorInfo) -> np.ndarray:
        """The stored array (no copy; packed F4 as uint8 [..., n / 2])."""
        dtype = info.storage_dtype()
        if info.nbytes == 0:
            return np.zeros(info.storage_shape, dtype)
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        return mm[info.begin : info.end].view(dtype).reshape(info.storage_shape)

    def read(self, info: TensorInfo, index: tuple[slice, ...] = ()) -> np.ndarray:
        """A copy of `view(info)[index]` (only those bytes are read)."""
        out = np.array(self.view(info)[index])
        self.bytes_read[info.name] += out.nbytes
        return out

    @property
    def total(self) -> int:
        return sum(self.bytes_read.values())


@dataclasses.dataclass
class Folder:
    """The tensors of a checkpoint folder: `tensors` (name -> TensorInfo, the index's names when there
    is one), `unlisted` (name -> file of tensors in a listed shard that the index leaves out)."""

    path: str
    tensors: dict[str, TensorInfo]
    unlisted: dict[str, str]
    indexed: bool


def open_folder(path: str) -> Folder:
    """Headers of a folder's shards: through `model.safetensors.index.json` when present, else every
    `*.safetensors` file in it. ValueError on a missing shard, a tensor the index maps to a file that
    does not hold it, or one name in two files."""
    index_path = os.path.join(path, INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{index_path} has no weight_map") from None
        files = sorted(set(weight_map.values()))
        headers: dict[str, dict[str, TensorInfo]] = {}
        for file in files:
            full = os.path.join(path, file)
            if not os.path.isfile(full):
                first = next(k for k, v in weight_map.items() if v == file)
                raise ValueError(f"shard file {file!r} (tensor {first!r} in {INDEX}) is missing from {path!r}")
            headers[file] = read_header(full)
        tensors = {}
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise ValueError(f"{INDEX} maps tensor {name!r} to {file!r}, which does not hold it")
            tensors[name] = headers[file][name]
        unlisted = {k: file for file, h in headers.items() for k in h if k not in weight_map}
        return Folder(path, tensors, unlisted, True)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    tensors = {}
    for file in files:
        for name, info in read_header(os.path.join(path, file)).items():
            if name in tensors:
                raise ValueError(
                    f"tensor {name!r} is in both {os.path.basename(tensors[name].file)} and {file}"
                )
            tensors[name] = info
    return Folder(path, tensors, {}, False)


def dtype_name(a: np.ndarray) -> str:
    """safetensors dtype string of a numpy array (ml_dtypes types included)."""
    if a.dtype not in _WRITE:
        raise ValueError(f"unsupported dtype {a.dtype} for safetensors")
    return _WRITE[a.dtype]


def write_safetensors(filename: str, tensors: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (numpy or ml_dtypes arrays; FP4 is written packed as I8, as DeepSeek ships it)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for k, a in tensors.items():
        header[k] = {"dtype": dtype_name(a), "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(filename, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def write_index(path: str, weight_map: Mapping[str, str], total_size: int) -> None:
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}, f, indent=2)
