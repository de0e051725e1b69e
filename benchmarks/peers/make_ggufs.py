"""Writes F32, F16, Q8_0, Q4_0, Q4_1 and Q4_K_M GGUF variants of SmolLM2-135M.

Every variant is made from the same file, the SmolLM2-135M-Instruct GGUF
that penzai_lm fetches (Q4_1 layers, a Q8_0 token embedding, F32 norms), so
that generate_vs_peers.py compares llama.cpp (and penzai_lm) at several
weight formats on exactly the same weights. Each tensor is dequantized with
``gguf.quants.dequantize`` and requantized with ``gguf.quants.quantize``
(gguf-py's reference quantizers, those of llama.cpp's ``*_ref`` functions),
and every metadata field is copied over (tokenizer arrays included, strings
byte for byte), except ``general.file_type``, which names the variant. As in
llama.cpp's converter, 1-D tensors (the norms) stay F32 in every variant;
the token embedding of the Q4_0 and Q4_1 variants stays Q8_0, as in the
source file (so the Q4_1 variant holds the source file's blocks again).

Q4_K_M is llama.cpp's own mix, written by llama.cpp's quantizer
(``llama_model_quantize`` with ``LLAMA_FTYPE_MOSTLY_Q4_K_M``, as its
``llama-quantize`` tool does) from the F32 variant: gguf-py cannot write
K-quants. SmolLM2's rows of 576 values are not whole super-blocks of 256,
so llama.cpp falls back for those tensors (Q4_K -> Q5_0, Q6_K -> Q8_0) and
uses Q4_K / Q6_K only for ``ffn_down`` (1,536 values a row): the file mixes
Q5_0, Q8_0, Q4_K and Q6_K, like the real Gemma 3 270M Q4_K_M file. It needs
``llama_cpp`` (the llama.cpp venv of ``setup_llamacpp.sh``); from another
python the script runs that step in the llama.cpp venv.

Shapes: GGUF lists a tensor's shape as ``[in, out]`` (``ReaderTensor.shape``)
while the dequantized numpy array is ``(out, in)``; `gguf.GGUFWriter`
reverses the numpy shape when it writes, and for quantized data (uint8 rows
of blocks) it converts the byte shape ``(out, in_bytes)`` back to
``(out, in)`` itself, so each tensor is added with its numpy layout.

The files go to ``~/.cache/penzai_lm/peers/ggufs/`` (files already there are
skipped). Needs only ``gguf`` and ``numpy``; with ``llama_cpp`` importable
too (the llama.cpp venv of ``setup_llamacpp.sh``), ``--check`` loads every
variant in llama.cpp and prints 24 greedy tokens of each.

Usage:
  python benchmarks/peers/make_ggufs.py [--source PATH] [--out DIR] [--check]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import time

import numpy as np

PEERS_DIR = os.path.expanduser("~/.cache/penzai_lm/peers")
GGUF_DIR = os.path.join(PEERS_DIR, "ggufs")
SOURCE = os.path.expanduser(
    "~/.cache/penzai_lm/models/SmolLM2-135M-Instruct.Q4_1.gguf")
STEM = "SmolLM2-135M-Instruct"
VARIANTS = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k_m")
# Written by llama.cpp's quantizer from the F32 variant.
LLAMACPP_VARIANTS = {"q4_k_m": 15}  # LLAMA_FTYPE_MOSTLY_Q4_K_M


def gguf_path(variant: str, out_dir: str = GGUF_DIR) -> str:
  """Where the ``variant`` (one of `VARIANTS`) file goes."""
  return os.path.join(out_dir, f"{STEM}.{variant.upper()}.gguf")


def source_path() -> str:
  """The source GGUF: penzai_lm's cached copy (fetched if penzai_lm can)."""
  try:
    from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top
    return str(resolve_model_path("smollm2-135m-instruct"))
  except ImportError:  # The llama.cpp venv has no penzai_lm.
    return SOURCE


def _target_type(variant: str, name: str, ndim: int):
  """The GGML type of tensor ``name`` in ``variant``."""
  from gguf import GGMLQuantizationType as T  # pylint: disable=g-import-not-at-top
  if ndim < 2:
    return T.F32
  if variant in ("q4_0", "q4_1") and name == "token_embd.weight":
    return T.Q8_0
  return dict(f32=T.F32, f16=T.F16, q8_0=T.Q8_0, q4_0=T.Q4_0,
              q4_1=T.Q4_1)[variant]


def _file_type(variant: str) -> int:
  from gguf import LlamaFileType as F  # pylint: disable=g-import-not-at-top
  return dict(f32=F.ALL_F32, f16=F.MOSTLY_F16, q8_0=F.MOSTLY_Q8_0,
              q4_0=F.MOSTLY_Q4_0, q4_1=F.MOSTLY_Q4_1)[variant]


def _copy_fields(reader, writer, variant: str):
  """Every KV field of ``reader`` into ``writer`` (types kept exactly)."""
  from gguf import GGUFValueType as V  # pylint: disable=g-import-not-at-top
  for key, field in reader.fields.items():
    # GGUF.* are the header's pseudo-fields; the writer adds the architecture.
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    if key == "general.file_type":
      writer.add_key_value(key, int(_file_type(variant)), V.UINT32)
      continue
    kind = field.types[0]
    if kind == V.ARRAY:
      if len(field.types) != 2:
        raise NotImplementedError(f"nested array field {key}")
      sub = field.types[1]
      if sub == V.STRING:  # Raw bytes: no decoding round trip.
        values = [bytes(field.parts[i]) for i in field.data]
      else:
        values = [field.parts[i].tolist()[0] for i in field.data]
      writer.add_key_value(key, values, V.ARRAY, sub_type=sub)
    elif kind == V.STRING:
      writer.add_key_value(key, bytes(field.parts[-1]), V.STRING)
    else:
      writer.add_key_value(key, field.parts[-1].tolist()[0], kind)


def write_variant(reader, variant: str, path: str) -> dict:
  """Writes ``variant`` of the file behind ``reader`` to ``path``.

  Returns:
    Counts of tensors per written type, and the largest absolute difference
    between a written tensor and the source's dequantized values.
  """
  import gguf  # pylint: disable=g-import-not-at-top
  arch = reader.fields["general.architecture"].contents()
  tmp = path + ".tmp"
  writer = gguf.GGUFWriter(tmp, arch)
  _copy_fields(reader, writer, variant)
  counts, worst = {}, 0.0
  for t in reader.tensors:
    values = gguf.quants.dequantize(t.data, t.tensor_type)  # (out, in).
    # GGUF's [in, out] (fastest-varying first) is numpy's (out, in).
    expect = tuple(int(d) for d in reversed(t.shape.tolist()))
    values = values.reshape(expect)
    qtype = _target_type(variant, t.name, values.ndim)
    data = gguf.quants.quantize(values, qtype)
    back = gguf.quants.dequantize(data, qtype).reshape(expect)
    worst = max(worst, float(np.max(np.abs(back - values))))
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
      writer.add_tensor(t.name, data)
    else:  # uint8 (out, in_bytes): the writer turns it into (out, in).
      writer.add_tensor(t.name, data, raw_dtype=qtype)
    counts[qtype.name] = counts.get(qtype.name, 0) + 1
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  os.replace(tmp, path)
  return dict(types=counts, max_abs_change=worst)


def verify(source_reader, path: str, tolerance: float = 0.02):
  """Re-reads ``path``: same fields and shapes as the source, values within
  ``tolerance`` of each tensor's largest magnitude."""
  import gguf  # pylint: disable=g-import-not-at-top
  out = gguf.GGUFReader(path)
  skip = {"general.file_type", "GGUF.kv_count"}
  for key, field in source_reader.fields.items():
    if key in skip:
      continue
    other = out.fields[key]
    assert other.types == field.types, key
    if field.types[-1] != gguf.GGUFValueType.STRING:
      assert other.contents() == field.contents(), key
    else:
      assert [bytes(other.parts[i]) for i in other.data] == [
          bytes(field.parts[i]) for i in field.data], key
  theirs = {t.name: t for t in source_reader.tensors}
  # gguf-py keeps the source's order; llama.cpp's quantizer sorts by name.
  assert sorted(t.name for t in out.tensors) == sorted(theirs), "tensors"
  for t in out.tensors:
    src = theirs[t.name]
    assert t.shape.tolist() == src.shape.tolist(), t.name
    a = gguf.quants.dequantize(t.data, t.tensor_type)
    b = gguf.quants.dequantize(src.data, src.tensor_type)
    scale = float(np.max(np.abs(b))) or 1.0
    # Q4_1 of (already Q4_1) values: exact up to fp16 scales; Q8_0: ~1/127;
    # Q4_0: 1/8 of a block's largest magnitude (its clamped end).
    assert np.max(np.abs(a.reshape(b.shape) - b)) <= tolerance * scale, t.name


def _tolerance(variant: str) -> float:
  return 0.13 if variant in ("q4_0", "q4_k_m") else 0.02


def quantize_with_llamacpp(source: str, path: str, ftype: int) -> dict:
  """Writes ``path`` from the F32 GGUF ``source`` with llama.cpp's own
  quantizer (``llama_model_quantize``); tensor types counted."""
  import gguf  # pylint: disable=g-import-not-at-top
  try:
    import llama_cpp  # pylint: disable=g-import-not-at-top
  except ImportError:  # Not the llama.cpp venv: run this step there.
    venv = os.path.join(PEERS_DIR, "llamacpp-venv", "bin", "python")
    if not os.path.exists(venv):
      raise SystemExit(f"{os.path.basename(path)} is written by llama.cpp's"
                       " quantizer: build it first with"
                       " bash benchmarks/peers/setup_llamacpp.sh") from None
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            " from make_ggufs import quantize_with_llamacpp as q;"
            " print(q(sys.argv[2], sys.argv[3], int(sys.argv[4])))")
    subprocess.run([venv, "-c", code, os.path.dirname(__file__), source,
                    path, str(ftype)], check=True)
    return {}
  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = ftype
  params.nthread = os.cpu_count() or 1
  tmp = path + ".tmp"
  status = llama_cpp.llama_model_quantize(source.encode(), tmp.encode(),
                                          ctypes.byref(params))
  if status:
    raise RuntimeError(f"llama_model_quantize returned {status}")
  os.replace(tmp, path)
  counts = {}
  for t in gguf.GGUFReader(path).tensors:
    counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
  return dict(types=counts)


def check_in_llamacpp(path: str, prompt: str, n: int = 24) -> str:
  """Loads ``path`` in llama.cpp and decodes ``n`` greedy tokens."""
  import llama_cpp  # pylint: disable=g-import-not-at-top
  llm = llama_cpp.Llama(path, n_ctx=256, n_threads=2, verbose=False)
  ids = llm.tokenize(prompt.encode(), add_bos=False)
  out = []
  for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
    out.append(tok)
    if len(out) == n:
      break
  return llm.detokenize(out).decode("utf-8", "replace")


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--source", default=None,
                      help="source GGUF (default: penzai_lm's SmolLM2 file)")
  parser.add_argument("--out", default=GGUF_DIR)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--check", action="store_true",
                      help="also load each file in llama.cpp (needs llama_cpp)")
  args = parser.parse_args()
  import gguf  # pylint: disable=g-import-not-at-top

  source = args.source or source_path()
  os.makedirs(args.out, exist_ok=True)
  reader = None
  for variant in args.variants.split(","):
    path = gguf_path(variant, args.out)
    if os.path.exists(path):
      print(f"{path}: exists, skipped")
      continue
    if reader is None:
      print(f"reading {source}")
      reader = gguf.GGUFReader(source)
    start = time.perf_counter()
    if variant in LLAMACPP_VARIANTS:
      f32 = gguf_path("f32", args.out)
      if not os.path.exists(f32):
        raise SystemExit(f"{variant} is quantized from {f32}: write the f32"
                         " variant first (--variants f32," + variant + ")")
      info = quantize_with_llamacpp(f32, path, LLAMACPP_VARIANTS[variant])
      info["max_abs_change"] = float("nan")
    else:
      info = write_variant(reader, variant, path)
    verify(reader, path, _tolerance(variant))
    print(f"{path}: {os.path.getsize(path) / 2**20:.0f} MiB, "
          f"{info.get('types')}, max |change| {info['max_abs_change']:.3g}, "
          f"re-read OK ({time.perf_counter() - start:.0f} s)", flush=True)
  if args.check:
    prompt = ("The lighthouse keeper kept a logbook in which every ship, "
              "storm and unusual bird was recorded")
    for variant in args.variants.split(","):
      text = check_in_llamacpp(gguf_path(variant, args.out), prompt)
      print(f"llama.cpp {variant}: {prompt!r} -> {text!r}", flush=True)


if __name__ == "__main__":
  main()
