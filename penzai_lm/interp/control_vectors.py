"""Steering (control) vectors, read and written as llama.cpp GGUF files.

A control vector is one direction per transformer block, added to the
residual stream at every token position. The same ``.gguf`` files are used
by llama.cpp (``--control-vector FILE``, ``--control-vector-scaled FILE
SCALE``, ``--control-vector-layer-range START END``), written by llama.cpp's
``llama-cvector-generator`` and by repeng (``ControlVector.export_gguf``),
and read here.

Numbering used by this module
-----------------------------
:class:`ControlVector` is keyed by the **0-based penzai_lm block index**
``i``; ``directions[i]`` is added to the residual stream *after* block ``i``
(the output of block ``i``, TransformerLens's ``blocks.{i}.hook_resid_post``,
Hugging Face's ``hidden_states[i + 1]``), before the next block and before
the final norm.

**In the file, ``direction.N`` holds exactly that vector with ``N == i``**: no
shift is needed. File indices do start at 1 (llama.cpp rejects
``direction.0``), but not because of a 1-based shift: llama.cpp has no slot
for the first block's output (see below). So a vector for block 0 is usable
in penzai_lm but cannot be saved.

The file format (with the sources it was read from)
---------------------------------------------------
Read from ggml-org/llama.cpp and vgel/repeng:

* ``general.architecture = "controlvector"`` (string);
  ``controlvector.model_hint`` (string: llama.cpp's generator writes the
  model's GGUF architecture, e.g. ``"llama"``; repeng writes the Hugging Face
  ``config.model_type``); ``controlvector.layer_count`` (the number of
  direction tensors; repeng writes it as uint32, llama.cpp's generator as
  int32). Sources: ``tools/cvector-generator/cvector-generator.cpp``
  (``export_gguf``) and ``repeng/extract.py`` (``ControlVector.export_gguf``).
  llama.cpp's loader reads none of these keys; repeng's ``import_gguf``
  warns on a wrong architecture and *requires* ``controlvector.model_hint``.
* One tensor per steered layer, named ``direction.{N}``, type F32,
  one-dimensional with ``n_embd`` (hidden size) elements. The loader
  (``common/common.cpp``, ``common_control_vector_load_one``; formerly
  ``llama_control_vector_load_one``) rejects the whole file if any tensor is
  not named ``direction.<int>``, if the index is 0 ("invalid (zero) direction
  tensor layer index"), if a tensor is not F32 or not 1-D (``ggml_n_dims``,
  so trailing dimensions of size 1 are tolerated), or if the sizes differ.
  Tensors with the same index are summed. A file with no tensors is skipped.
* Where ``direction.N`` goes: the loader stores it at offset
  ``n_embd * (N - 1)`` of a flat buffer ("layer 1 at [0]");
  ``llama_adapter_cvec::apply`` (``src/llama-adapter.cpp``) copies offset
  ``n_embd * (il - 1)`` into ``tensors[il]`` for ``il = 1 .. n_layer - 1``
  ("there's never a tensor for layer 0"), so ``tensors[il]`` is
  ``direction.il``. ``apply_to(cur, il)`` adds ``tensors[il]`` where each
  model graph (e.g. ``src/models/llama.cpp``, loop ``for il in 0 ..
  n_layer-1``) calls ``cur = build_cvec(cur, il)`` right after the block's
  last residual add, i.e. on the block's output ``l_out-{il}``. ``il`` is
  the 0-based block index, hence ``N == i`` above. Directions with
  ``N >= n_layer`` are silently ignored by llama.cpp.
* Several files / scales (``common_control_vector_load``): every file's
  vectors are multiplied by its scale (``--control-vector`` is scale 1.0)
  and all files are summed layer by layer; all must have the same
  ``n_embd``. See :meth:`ControlVector.scaled` and ``+``.
* Layer range (``common_init_from_params`` in ``common/common.cpp``,
  ``llama_adapter_cvec::tensor_for``): the summed vector is applied only to
  layers ``START <= il <= END`` (both inclusive, same ``il`` numbering, so the
  same numbers as penzai_lm block indices); ``START <= 0`` means 1 and
  ``END <= 0`` means ``n_layer``. See :meth:`ControlVector.restricted`.
* repeng keys ``directions`` by the 0-based index of the decoder layer whose
  output it read (``hidden_states[layer + 1]``, ``batched_get_hiddens`` in
  ``repeng/extract.py``) and adds ``directions[layer]`` to the output of
  ``model.layers[layer]`` (``ControlModule.forward`` in
  ``repeng/control.py``); it writes ``direction.{layer}`` unchanged. So
  repeng, llama.cpp and this module agree: ``direction.N`` = after block
  ``N``. (repeng's default layers are ``range(-1, -num_layers, -1)``, which
  never includes layer 0.)
* Caveat on provenance: ``llama-cvector-generator`` computes its vectors from
  ``l_out`` of layers ``0 .. n_layer-2`` and names the one from layer ``k``
  ``direction.{k+1}`` (``tools/cvector-generator/mean.hpp``, ``pca.hpp``),
  so its vectors are *applied* one block after the one they were *measured*
  at. The file's meaning is what llama.cpp applies; this module loads such
  files as they are.

* The data section must be complete, including the last tensor's alignment
  padding: ``gguf_init_from_file`` (``ggml/src/gguf.cpp``), called with
  ``no_alloc = false`` by the loader, reads the whole padded blob and fails
  otherwise. The loader here checks the same.

This module is stricter than llama.cpp where a file is certainly wrong: it
also requires ``general.architecture == "controlvector"``, finite values, a
non-empty hidden size, and tensor names of the exact form ``direction.<N>``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from pathlib import Path
import re
from typing import Mapping
import uuid
import warnings

import numpy as np

ARCHITECTURE = "controlvector"
MODEL_HINT_KEY = f"{ARCHITECTURE}.model_hint"
LAYER_COUNT_KEY = f"{ARCHITECTURE}.layer_count"
TENSOR_PREFIX = "direction."

_GGUF_MAGIC = b"GGUF"
_TENSOR_NAME = re.compile(r"direction\.([0-9]+)")
_DEFAULT_ALIGNMENT = 32
_FIX_REEXPORT = (
    "re-download the file, or re-export it (penzai_lm"
    " save_control_vector, repeng ControlVector.export_gguf or"
    " llama-cvector-generator)"
)


def _block_index(key) -> int:
  """Checks a direction key and returns it as a Python int."""
  if isinstance(key, bool) or not isinstance(key, numbers.Integral):
    raise ValueError(
        f"direction keys must be integer block indices, got {key!r}"
        f" ({type(key).__name__})"
    )
  key = int(key)
  if key < 0:
    raise ValueError(
        f"block index {key} is negative: directions are keyed by the 0-based"
        " block index i (added after block i); negative indices are not"
        " allowed, use num_layers + i"
    )
  return key


def _as_direction(block: int, value) -> np.ndarray:
  """Checks one direction and returns a read-only float32 copy."""
  array = np.asarray(value)
  if array.dtype.kind not in "fiu":
    raise ValueError(
        f"direction for block {block} has dtype {array.dtype}; expected real"
        " numbers (it is stored as float32)"
    )
  if array.ndim != 1:
    raise ValueError(
        f"direction for block {block} has shape {array.shape}; expected a 1-D"
        " vector of the model's hidden size (one vector per block)"
    )
  if array.size == 0:
    raise ValueError(f"direction for block {block} is empty")
  with np.errstate(over="ignore"):  # Overflow to inf is reported below.
    array = np.array(array, dtype=np.float32, copy=True)
  bad = int(np.count_nonzero(~np.isfinite(array)))
  if bad:
    raise ValueError(
        f"direction for block {block} has {bad} non-finite value(s) (NaN or"
        " inf, after conversion to float32)"
    )
  array.setflags(write=False)
  return array


def _check_factor(factor) -> float:
  if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
    raise ValueError(f"scale factor must be a real number, got {factor!r}")
  factor = float(factor)
  if not math.isfinite(factor):
    raise ValueError(f"scale factor must be finite, got {factor}")
  return factor


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ControlVector:
  """A steering vector: one direction per block, added to the residual stream.

  Attributes:
    directions: ``{i: vector}`` keyed by the 0-based penzai_lm block index;
      ``vector`` (float32, shape ``(hidden_size,)``) is added to the residual
      stream after block ``i`` (``blocks.{i}.hook_resid_post``), at every
      position. Blocks without a key are left alone. In a llama.cpp file it
      is the tensor ``direction.{i}`` (same number). Values are copied to
      read-only float32 arrays, sorted by block.
    model_hint: Free-form name of the model the vector was made for
      (``controlvector.model_hint``; e.g. ``"llama"`` or ``"mistral"``), or
      None. Informational only: nothing checks it against a model.

  Raises:
    ValueError: on construction, if ``directions`` is empty, a key is not a
      non-negative integer, a vector is not 1-D real numbers, is empty or has
      NaN/inf values, or the vectors differ in size.
  """

  directions: dict[int, np.ndarray]
  model_hint: str | None = None

  def __post_init__(self):
    if not isinstance(self.directions, Mapping):
      raise ValueError(
          "directions must be a dict {block_index: vector}, got"
          f" {type(self.directions).__name__}"
      )
    if not self.directions:
      raise ValueError(
          "a ControlVector needs at least one direction (a dict"
          " {block_index: vector})"
      )
    checked = {}
    for key, value in self.directions.items():
      block = _block_index(key)
      if block in checked:
        raise ValueError(f"block {block} is given twice")
      checked[block] = _as_direction(block, value)
    sizes = {v.shape[0] for v in checked.values()}
    if len(sizes) > 1:
      by_size = {}
      for block, v in checked.items():
        by_size.setdefault(v.shape[0], []).append(block)
      described = "; ".join(
          f"size {size}: blocks {blocks}" for size, blocks in by_size.items()
      )
      raise ValueError(
          "all directions must have the same size (the model's hidden size),"
          f" got {described}"
      )
    if self.model_hint is not None and not isinstance(self.model_hint, str):
      raise ValueError(
          f"model_hint must be a str or None, got {self.model_hint!r}"
      )
    object.__setattr__(self, "directions", dict(sorted(checked.items())))
    object.__setattr__(self, "model_hint", self.model_hint or None)

  @property
  def hidden_size(self) -> int:
    """The length of every direction (the model's residual width)."""
    return next(iter(self.directions.values())).shape[0]

  @property
  def blocks(self) -> tuple[int, ...]:
    """The steered block indices, ascending."""
    return tuple(self.directions)

  def scaled(self, factor: float) -> ControlVector:
    """Returns every direction multiplied by ``factor`` (float32 arithmetic).

    This is what ``--control-vector-scaled FILE factor`` does to a file's
    vectors in llama.cpp. A negative factor steers the opposite way.

    Args:
      factor: A finite real number.

    Returns:
      A new ControlVector with the same blocks and model hint.
    """
    f = np.float32(_check_factor(factor))
    return ControlVector(
        directions={i: v * f for i, v in self.directions.items()},
        model_hint=self.model_hint,
    )

  def __add__(self, other: ControlVector) -> ControlVector:
    """Sums two control vectors block by block, as llama.cpp combines files.

    Blocks present in only one operand are kept as they are. The model hint
    is kept when both agree (or one is None); if they differ, a warning is
    issued and the left operand's hint is kept (as repeng does).

    Raises:
      ValueError: if the hidden sizes differ.
    """
    if not isinstance(other, ControlVector):
      return NotImplemented
    if other.hidden_size != self.hidden_size:
      raise ValueError(
          f"cannot add control vectors of hidden sizes {self.hidden_size} and"
          f" {other.hidden_size}: they are for different models (llama.cpp"
          " also refuses this combination)"
      )
    hint = self.model_hint
    if hint is None:
      hint = other.model_hint
    elif other.model_hint is not None and other.model_hint != hint:
      warnings.warn(
          f"adding control vectors with different model hints ({hint!r} and"
          f" {other.model_hint!r}); keeping {hint!r}",
          stacklevel=2,
      )
    directions = dict(self.directions)
    for i, v in other.directions.items():
      directions[i] = directions[i] + v if i in directions else v
    return ControlVector(directions=directions, model_hint=hint)

  def __radd__(self, other) -> ControlVector:
    # Lets ``sum(vectors)`` work (it starts from 0).
    if isinstance(other, numbers.Number) and other == 0:
      return self
    return NotImplemented

  def restricted(self, start: int, end: int) -> ControlVector:
    """Keeps only the blocks ``start <= i <= end`` (both ends inclusive).

    This is llama.cpp's ``--control-vector-layer-range START END``. The
    numbers are the same in both places: llama.cpp's layer ``il`` (and file
    tensor ``direction.{il}``) is penzai_lm block ``i = il``, so
    ``--control-vector-layer-range 10 20`` is ``restricted(10, 20)``. (In
    llama.cpp, ``START <= 0`` means 1 and ``END <= 0`` means the last layer;
    here ``start=0`` keeps block 0.)

    Args:
      start: First block kept (>= 0).
      end: Last block kept (>= start).

    Returns:
      A new ControlVector.

    Raises:
      ValueError: if the range is invalid or keeps no direction.
    """
    for name, value in (("start", start), ("end", end)):
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
      if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if start > end:
      raise ValueError(f"empty layer range: start {start} > end {end}")
    kept = {i: v for i, v in self.directions.items() if start <= i <= end}
    if not kept:
      raise ValueError(
          f"no direction in blocks {start}..{end}; this vector has blocks"
          f" {list(self.blocks)}"
      )
    return ControlVector(directions=kept, model_hint=self.model_hint)

  def for_layers(self, num_layers: int) -> np.ndarray:
    """Stacks the directions for a model with ``num_layers`` blocks.

    Args:
      num_layers: The model's number of blocks.

    Returns:
      A float32 array ``(num_layers, hidden_size)``; row ``i`` is the vector
      added after block ``i``, zeros where there is no direction. For a
      stacked penzai_lm model, ``pz.nx.wrap(a).tag("blocks", "embedding")``.

    Raises:
      ValueError: if a direction is for a block ``>= num_layers`` (llama.cpp
        would silently ignore it; here it most likely means the vector is for
        another model; use :meth:`restricted` to drop such blocks).
    """
    if (isinstance(num_layers, bool)
        or not isinstance(num_layers, numbers.Integral) or num_layers < 1):
      raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    too_deep = [i for i in self.directions if i >= num_layers]
    if too_deep:
      raise ValueError(
          f"directions for blocks {too_deep} but the model has only"
          f" {num_layers} blocks (0..{num_layers - 1}); the vector is probably"
          " for another model, or use"
          f" restricted(0, {num_layers - 1}) to drop them"
      )
    out = np.zeros((int(num_layers), self.hidden_size), dtype=np.float32)
    for i, v in self.directions.items():
      out[i] = v
    return out

  def __eq__(self, other) -> bool:
    if not isinstance(other, ControlVector):
      return NotImplemented
    return (
        self.model_hint == other.model_hint
        and self.directions.keys() == other.directions.keys()
        and all(
            np.array_equal(v, other.directions[i])
            for i, v in self.directions.items()
        )
    )

  __hash__ = None  # Holds arrays.

  def __repr__(self) -> str:
    return (
        f"ControlVector(blocks={list(self.blocks)},"
        f" hidden_size={self.hidden_size}, model_hint={self.model_hint!r})"
    )


def _string_field(reader, key: str):
  """Returns (present, value-or-None) for a string metadata key."""
  import gguf  # pylint: disable=g-import-not-at-top

  field = reader.fields.get(key)
  if field is None:
    return False, None
  if (not field.types or field.types[0] != gguf.GGUFValueType.STRING
      or not field.data):
    return True, None
  raw = bytes(field.parts[field.data[0]])
  return True, raw.decode("utf-8", errors="replace")


def load_control_vector(path: str | os.PathLike) -> ControlVector:
  """Reads a llama.cpp / repeng control-vector ``.gguf`` file.

  Accepts what llama.cpp's ``--control-vector`` accepts (see the module
  docstring), and additionally checks the architecture and that the values
  are finite. Tensor ``direction.N`` becomes ``directions[N]`` (the vector
  added after 0-based block ``N``); tensors with the same ``N`` are summed,
  as llama.cpp does.

  Args:
    path: The ``.gguf`` file.

  Returns:
    The ControlVector, with ``model_hint`` from ``controlvector.model_hint``
    (None if missing or empty).

  Raises:
    FileNotFoundError: (or another OSError) if the file cannot be opened.
    ValueError: if the file is not a valid control vector; the message says
      what is wrong and how to fix it.
  """
  import gguf  # pylint: disable=g-import-not-at-top

  path = Path(path)
  with open(path, "rb") as f:
    magic = f.read(4)
  size = path.stat().st_size
  if magic != _GGUF_MAGIC:
    if len(magic) < 4:
      raise ValueError(
          f"{path} is not a GGUF file: it is only {size} bytes long;"
          f" {_FIX_REEXPORT}"
      )
    raise ValueError(
        f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF file"
        f" starts with {_GGUF_MAGIC!r}); pass a control-vector .gguf file"
    )
  try:
    reader = gguf.GGUFReader(path, "r")
    alignment = int(getattr(reader, "alignment", _DEFAULT_ALIGNMENT))
    tensors = list(reader.tensors)
  except Exception as e:  # gguf raises ValueError/IndexError/KeyError/...
    raise ValueError(
        f"{path} is a truncated or corrupt GGUF file (the gguf reader failed:"
        f" {type(e).__name__}: {e}); {_FIX_REEXPORT}"
    ) from e

  present, arch = _string_field(reader, "general.architecture")
  if arch != ARCHITECTURE:
    what = (
        "has no general.architecture" if not present
        else "has a non-string general.architecture" if arch is None
        else f"has general.architecture {arch!r}"
    )
    raise ValueError(
        f"{path} {what}, not {ARCHITECTURE!r}: it is not a control-vector"
        " file (a model or LoRA GGUF, perhaps). Pass a file written by"
        " llama-cvector-generator, repeng's ControlVector.export_gguf or"
        " save_control_vector."
    )
  present, model_hint = _string_field(reader, MODEL_HINT_KEY)
  if present and model_hint is None:
    warnings.warn(
        f"{path}: {MODEL_HINT_KEY} is not a string; ignoring it",
        stacklevel=2,
    )

  if not tensors:
    raise ValueError(
        f"{path} has no direction tensors (llama.cpp skips such a file);"
        f" {_FIX_REEXPORT}"
    )

  directions: dict[int, np.ndarray] = {}
  first_name = None
  for t in tensors:
    name = str(t.name)
    match = _TENSOR_NAME.fullmatch(name)
    if match is None:
      raise ValueError(
          f"{path} has a tensor named {name!r}; a control-vector file holds"
          " only tensors named direction.N (N = 1, 2, ...), and llama.cpp"
          " rejects the whole file otherwise. Remove or rename that tensor."
      )
    layer = int(match.group(1))
    if layer == 0:
      raise ValueError(
          f"{path}: tensor {name} is invalid: llama.cpp numbers"
          " control-vector layers from 1 and rejects the whole file"
          " (direction.N is added after block N counting blocks from 0;"
          " llama.cpp never steers block 0's output). Drop that tensor, or"
          " re-export without layer 0."
      )
    try:
      type_name = gguf.GGMLQuantizationType(t.tensor_type).name
    except ValueError:
      type_name = f"type {int(t.tensor_type)}"
    if t.tensor_type != gguf.GGMLQuantizationType.F32:
      raise ValueError(
          f"{path}: tensor {name} is {type_name}; llama.cpp accepts only F32"
          " direction tensors. Re-export it as float32."
      )
    ne = [int(d) for d in t.shape]  # ggml order: ne[0] is the vector length
    if len(ne) == 0 or any(d != 1 for d in ne[1:]):
      raise ValueError(
          f"{path}: tensor {name} has shape {tuple(reversed(ne))} (numpy"
          " order); a direction must be a 1-D vector of the model's hidden"
          " size (llama.cpp rejects non-1-D tensors). Re-export one vector per"
          " layer."
      )
    if ne[0] == 0:
      raise ValueError(f"{path}: tensor {name} is empty; {_FIX_REEXPORT}")
    end = int(t.data_offset) + -(-int(t.n_bytes) // alignment) * alignment
    if end > size:
      raise ValueError(
          f"{path} is truncated: tensor {name} (with its padding) ends at byte"
          f" {end} but the file has {size} bytes; {_FIX_REEXPORT}"
      )
    try:
      values = np.array(t.data, dtype=np.float32, copy=True).reshape(-1)
    except Exception as e:
      raise ValueError(
          f"{path}: cannot read tensor {name} ({type(e).__name__}: {e});"
          f" {_FIX_REEXPORT}"
      ) from e
    if values.shape[0] != ne[0]:
      raise ValueError(
          f"{path} is truncated: tensor {name} should have {ne[0]} values,"
          f" found {values.shape[0]}; {_FIX_REEXPORT}"
      )
    if first_name is None:
      first_name, first_size = name, ne[0]
    elif ne[0] != first_size:
      raise ValueError(
          f"{path}: tensor {name} has {ne[0]} values but {first_name} has"
          f" {first_size}; every direction must have the model's hidden size"
          " (llama.cpp rejects the file). The file mixes vectors for"
          " different models; re-export it."
      )
    bad = int(np.count_nonzero(~np.isfinite(values)))
    if bad:
      raise ValueError(
          f"{path}: tensor {name} has {bad} NaN/inf value(s) out of"
          f" {values.shape[0]}; llama.cpp would load it and produce garbage."
          " Re-train or re-export the vector."
      )
    if layer in directions:  # e.g. direction.1 and direction.01: summed.
      values = directions[layer] + values
    directions[layer] = values
  del reader, tensors  # Releases the memory map.
  return ControlVector(directions=directions, model_hint=model_hint)


def save_control_vector(
    vector: ControlVector,
    path: str | os.PathLike,
    *,
    model_hint: str | None = None,
) -> None:
  """Writes ``vector`` as a llama.cpp control-vector ``.gguf`` file.

  The file is what repeng's ``ControlVector.export_gguf`` writes:
  ``general.architecture = "controlvector"``, ``controlvector.model_hint``
  (string), ``controlvector.layer_count`` (uint32, the number of tensors)
  and one F32 1-D tensor ``direction.{i}`` per block ``i``, ascending. It
  loads with llama.cpp's ``--control-vector`` and repeng's ``import_gguf``.
  The file is written to a temporary name in the same directory and renamed
  into place, so a crash never leaves a half-written ``path``.

  Args:
    vector: The control vector. It must not have a direction for block 0:
      llama.cpp rejects ``direction.0`` (it cannot steer the first block's
      output).
    path: Destination file (overwritten if it exists).
    model_hint: Written as ``controlvector.model_hint``; defaults to
      ``vector.model_hint``. If both are None an empty string is written
      (repeng's reader requires the key to exist).

  Raises:
    ValueError: if ``vector`` has a direction for block 0 or is not a
      ControlVector, or ``model_hint`` is not a string.
  """
  import gguf  # pylint: disable=g-import-not-at-top

  if not isinstance(vector, ControlVector):
    raise ValueError(
        f"expected a ControlVector, got {type(vector).__name__}; build one"
        " with ControlVector(directions={block: vector})"
    )
  if 0 in vector.directions:
    raise ValueError(
        "this ControlVector has a direction for block 0, which llama.cpp"
        " cannot apply: it rejects direction.0 (it never steers the first"
        " block's output). Drop it with vector.restricted(1, <last block>)"
        " before saving."
    )
  hint = vector.model_hint if model_hint is None else model_hint
  if hint is not None and not isinstance(hint, str):
    raise ValueError(f"model_hint must be a str or None, got {hint!r}")
  hint = hint or ""

  path = Path(path)
  tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
  writer = gguf.GGUFWriter(tmp, ARCHITECTURE)
  try:
    # add_string skips empty strings; repeng's import_gguf needs the key.
    writer.add_key_value(MODEL_HINT_KEY, hint, gguf.GGUFValueType.STRING)
    writer.add_uint32(LAYER_COUNT_KEY, len(vector.directions))
    for i, v in vector.directions.items():
      writer.add_tensor(
          f"{TENSOR_PREFIX}{i}", np.ascontiguousarray(v, dtype="<f4")
      )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(tmp, "rb+") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    writer.close()
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise
