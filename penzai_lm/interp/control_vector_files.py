"""Reading and writing control vectors as llama.cpp / repeng GGUF files.

The same ``.gguf`` files are used by llama.cpp (``--control-vector FILE``,
``--control-vector-scaled FILE SCALE``, ``--control-vector-layer-range START
END``), written by llama.cpp's ``llama-cvector-generator`` and by repeng
(``ControlVector.export_gguf``), and read and written here as
:class:`~penzai_lm.interp.control_vectors.ControlVector`.

**Tensor ``direction.N`` holds ``ControlVector.directions[i]`` with
``N == i``**, the 0-based penzai_lm block index (the vector is added after
block ``i``): no shift is needed. File indices do start at 1 (llama.cpp
rejects ``direction.0``), but not because of a 1-based shift: llama.cpp has
no slot for the first block's output (see below). So a vector for block 0 is
usable in penzai_lm but cannot be saved.

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

import os
from pathlib import Path
import re
import tempfile
import warnings

import numpy as np

from penzai_lm.file_access import open_regular
from penzai_lm.file_access import write_atomic
from penzai_lm.interp.control_vectors import ControlVector

ARCHITECTURE = "controlvector"
MODEL_HINT_KEY = f"{ARCHITECTURE}.model_hint"
LAYER_COUNT_KEY = f"{ARCHITECTURE}.layer_count"
TENSOR_PREFIX = "direction."

_GGUF_MAGIC = b"GGUF"
_TENSOR_NAME = re.compile(re.escape(TENSOR_PREFIX) + r"([0-9]+)")
_DEFAULT_ALIGNMENT = 32
_FIX_REEXPORT = (
    "re-download the file, or re-export it (penzai_lm"
    " save_control_vector, repeng ControlVector.export_gguf or"
    " llama-cvector-generator)"
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


def _check_layer_count(reader, path: Path, n_tensors: int) -> None:
  """Refuses a ``controlvector.layer_count`` that is not an integer or not
  the number of direction tensors (what every writer puts there); a file
  without the key passes, as llama.cpp reads none of these keys."""
  import gguf  # pylint: disable=g-import-not-at-top

  field = reader.fields.get(LAYER_COUNT_KEY)
  if field is None:
    return
  value = None
  if (len(field.types) == 1 and field.types[0] in _int_types(gguf)
      and field.data):
    value = int(field.parts[field.data[0]][0])
  if value != n_tensors:
    shown = value if value is not None else "not an integer"
    raise ValueError(
        f"{path}: {LAYER_COUNT_KEY} is {shown} but the file has {n_tensors}"
        " direction tensor(s); writers store the number of tensors there, so"
        f" the file is truncated or was edited; {_FIX_REEXPORT}"
    )


def _int_types(gguf) -> tuple:
  """gguf's integer value types."""
  t = gguf.GGUFValueType
  return (t.UINT8, t.INT8, t.UINT16, t.INT16, t.UINT32, t.INT32, t.UINT64,
          t.INT64)


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
    ValueError: if the path is not a regular file (a FIFO, device...:
      refused before it is read), or the file is not a valid control
      vector (``controlvector.layer_count``, when present, must be the
      number of tensors); the message says what is wrong and how to fix
      it.
  """
  import gguf  # pylint: disable=g-import-not-at-top

  path = Path(path)
  # The reader maps the file opened here: what was checked is what is read.
  with open_regular(path, what="a control-vector .gguf file") as f:
    magic = f.read(4)
    size = os.fstat(f.fileno()).st_size
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
      reader = gguf.GGUFReader(f, "r")
      alignment = int(getattr(reader, "alignment", _DEFAULT_ALIGNMENT))
      tensors = list(reader.tensors)
    except Exception as e:  # gguf raises ValueError/IndexError/KeyError/...
      raise ValueError(
          f"{path} is a truncated or corrupt GGUF file (the gguf reader"
          f" failed: {type(e).__name__}: {e}); {_FIX_REEXPORT}"
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
  _check_layer_count(reader, path, len(tensors))

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
    if t.tensor_type != gguf.GGMLQuantizationType.F32:
      try:
        type_name = gguf.GGMLQuantizationType(t.tensor_type).name
      except ValueError:
        type_name = f"type {int(t.tensor_type)}"
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
  The file is built in a private temporary folder, then written to a
  temporary name beside ``path`` and renamed into place
  (`penzai_lm.file_access.write_atomic`): a crash never leaves a
  half-written ``path``, and a link planted at ``path`` is replaced, never
  written through.

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

  with tempfile.TemporaryDirectory() as private:  # 0700, this call's own.
    scratch = Path(private) / "vector.gguf"
    writer = gguf.GGUFWriter(scratch, ARCHITECTURE)
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
    finally:
      writer.close()
    data = scratch.read_bytes()
  write_atomic(Path(path), data)
