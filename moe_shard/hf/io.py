"""Safetensors folders: lazy, counted reads of tensor slices, and sharded writes.

A Hugging Face model folder holds `config.json` and either `model.safetensors` or
`model.safetensors.index.json` with the shards it names. `Checkpoint` opens the folder without
reading any tensor; `Checkpoint.read(name, rows)` reads rows [lo, hi) of a tensor's first
axis (all of it by default) through `safe_open(..., framework="numpy").get_slice`, so only
those bytes leave the file. Every read adds its bytes to a per-process counter
(`bytes_read`), which the tests use to check that each process reads only its own experts.

A checkpoint is data, not code: a folder holding only PyTorch pickles
(`pytorch_model*.bin`) is refused, and nothing in it is opened. A file that cannot be parsed
(a safetensors file cut short by an interrupted download, a header of garbage, a JSON file
that is not JSON) raises a `ValueError` naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes  # registers bfloat16, which safetensors' NumPy reader needs
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# How a file that Git LFS has not fetched begins (a clone without `git lfs`).
LFS_POINTER = b"version https://git-lfs"
_BYTES_READ = [0]
# Dtypes safetensors' NumPy reader cannot make, read from the file's bytes instead.
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}


def bytes_read():
  """Returns the bytes of tensor data this process has read from safetensors files."""
  return _BYTES_READ[0]


def reset_bytes_read():
  """Sets the `bytes_read` counter of this process back to zero."""
  _BYTES_READ[0] = 0


class Checkpoint:
  """An open Hugging Face model folder: its config.json and where each tensor lives.

  Attributes:
    path: the folder.
    config: config.json, a dict.
    files: tensor name -> the safetensors file (name inside the folder) that holds it.
    source: where the tensor names come from ("model.safetensors" or the index), for errors.
  """

  def __init__(self, fn, path):
    path = Path(path)
    if not path.is_dir():
      raise FileNotFoundError(f"{fn}: path must be a model folder (got {str(path)!r})")
    config = path / "config.json"
    if not config.is_file():
      raise FileNotFoundError(f"{fn}: {str(path)!r} has no config.json")
    self.path, self.fn = path, fn
    self._handles = {}
    self.config = _read_json(fn, config)
    if (path / INDEX).is_file():
      self.source = INDEX
      self.files = dict(_read_json(fn, path / INDEX)["weight_map"])
    elif (path / SINGLE).is_file():
      self.source = SINGLE
      self.files = dict.fromkeys(self._keys(SINGLE), SINGLE)
    else:
      shards = sorted(p.name for p in path.glob("*.safetensors"))
      if shards:
        self.source = ", ".join(shards)
        self.files = {k: s for s in shards for k in self._keys(s)}
      else:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(
          p.name for p in path.glob("*.pt*")
        )
        if pickles:
          raise ValueError(
            f"{fn}: {str(path)!r} holds only PyTorch pickle files ({', '.join(pickles)}); "
            f"moe_shard never unpickles a checkpoint (unpickling runs code): convert it to "
            f"safetensors first, e.g. `AutoModelForCausalLM.from_pretrained(path)"
            f".save_pretrained(out, safe_serialization=True)` in a trusted environment"
          )
        raise FileNotFoundError(f"{fn}: {str(path)!r} has no *.safetensors files")

  def _keys(self, file):
    return list(self._open(file).keys())

  def __contains__(self, name):
    return name in self.files

  def _open(self, file):
    """The open safetensors file (kept open: a shard's header is parsed once)."""
    if file not in self._handles:
      try:
        self._handles[file] = safe_open(self.path / file, framework="numpy")
      except SafetensorError as e:
        raise ValueError(_unreadable(self.fn, self.path / file, e)) from e
    return self._handles[file]

  def meta(self, name):
    """Returns (shape, dtype name) of a tensor, e.g. ((8, 16), "BF16"), without reading it."""
    self._require(name)
    s = self._open(self.files[name]).get_slice(name)
    return tuple(s.get_shape()), s.get_dtype()

  def _require(self, name):
    if name not in self.files:
      raise ValueError(
        f"{self.fn}: tensor {name!r} is missing from {str(self.path / self.source)!r}"
      )

  def read(self, name, rows=None):
    """Reads a tensor, or rows [lo, hi) of its first axis (`rows=(lo, hi)`), as NumPy.

    BF16 tensors come back as `ml_dtypes.bfloat16` arrays (what safetensors' NumPy reader
    gives); nothing is converted.
    """
    self._require(name)
    s = self._open(self.files[name]).get_slice(name)
    if s.get_dtype() in RAW_DTYPES:
      a = self._read_raw(name, rows)
    else:
      a = s[:] if rows is None else s[rows[0] : rows[1]]
    _BYTES_READ[0] += a.nbytes
    return a

  def _read_raw(self, name, rows):
    """Reads a tensor of a dtype safetensors' NumPy reader lacks (FP8) from the file's bytes.

    A safetensors file is an 8-byte little-endian header length, a JSON header giving each
    tensor's dtype, shape and [begin, end) byte offsets after the header, then the data.
    """
    file = self.path / self.files[name]
    with open(file, "rb") as f:
      n = int.from_bytes(f.read(8), "little")
      meta = json.loads(f.read(n))[name]
      shape, (begin, end) = meta["shape"], meta["data_offsets"]
      dtype = RAW_DTYPES[meta["dtype"]]
      lo, hi = (0, shape[0]) if rows is None or not shape else rows
      row = (end - begin) // max(shape[0], 1) if shape else end - begin
      f.seek(8 + n + begin + lo * row)
      data = f.read((hi - lo) * row)
    return np.frombuffer(data, dtype).reshape((hi - lo, *shape[1:]) if shape else ())


def _unreadable(fn, file, error):
  """The message for a file safetensors cannot open: the file, the error, what to do."""
  with open(file, "rb") as f:
    lfs = f.read(len(LFS_POINTER)) == LFS_POINTER
  if lfs:
    what = (
      "it is a Git LFS pointer, not the tensors: fetch them with `git lfs pull`, or download "
      "the file itself"
    )
  else:
    what = (
      "the file is truncated or corrupt (an interrupted download?): download it again and "
      "check its size against the source's"
    )
  return f"{fn}: {str(file)!r} is not a readable safetensors file ({error}); {what}"


def _read_json(fn, file):
  """The JSON document in `file`, or a ValueError naming the file."""
  try:
    return json.loads(Path(file).read_text())
  except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
    raise ValueError(
      f"{fn}: {str(file)!r} is not valid JSON ({e}): check the file, or download it again"
    ) from e


def write_folder(path, config, shards):
  """Writes config.json, the shards and (with several shards) the index into `path`.

  Args:
    path: the output folder (created if absent).
    config: the dict to write as config.json.
    shards: a list of dicts, tensor name -> NumPy array; one safetensors file each, named
      `model.safetensors` when there is one, else `model-0000i-of-0000n.safetensors` with
      `model.safetensors.index.json`.
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  shards = [s for s in shards if s]
  if len(shards) == 1:
    save_file(_contiguous(shards[0]), path / SINGLE, metadata={"format": "pt"})
    if (path / INDEX).exists():
      os.remove(path / INDEX)
    return
  weight_map, total = {}, 0
  for i, shard in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(_contiguous(shard), path / name, metadata={"format": "pt"})
    for k, a in shard.items():
      weight_map[k] = name
      total += a.nbytes
  index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
  (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _contiguous(tensors):
  return {k: np.ascontiguousarray(a) for k, a in tensors.items()}
