"""SAELens's on-disk format: ``cfg.json`` + ``sae_weights.safetensors``.

Read (`read_saelens`) as SAELens 6.x's ``SAE.load_from_disk`` reads it,
older (5.x and before) configs included, and written (`write_saelens`) so that
``SAE.load_from_disk`` reads it back.

``cfg.json`` fields used (v6 puts the hook names under ``metadata``, v5 and
before at the top level; a config without ``sae_lens_version`` >= 6 is read
with SAELens's pre-6.0 defaults: ``hook_point`` -> ``hook_name``,
``activation_fn_str`` -> ``activation_fn``, ``architecture`` "standard",
``apply_b_dec_to_input`` true, ``activation_fn: "topk"`` with
``activation_fn_kwargs.k`` -> architecture "topk", a boolean
``normalize_activations``):

* ``architecture``: "standard" (ReLU), "jumprelu", "topk", "transcoder",
  "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder";
* ``d_in``, ``d_sae``, ``d_out`` (transcoders), ``k`` (topk),
  ``rescale_acts_by_decoder_norm`` (topk), ``apply_b_dec_to_input``,
  ``normalize_activations`` ("none", "constant_norm_rescale",
  "layer_norm"; "expected_average_only_in" and "covariance_whitening" are
  the identity when SAELens loads from disk, and load as "none" with a
  warning), ``dtype``;
* ``hook_name`` / ``hook_name_out`` (TransformerLens names), or
  ``hf_hook_name`` / ``hf_hook_name_out`` (preferred when present:
  `penzai_lm.sae.formats.hook_names`); ``hook_head_index`` must be null.
  A ``ln2.hook_normalized`` hook is before the pre-MLP norm's weights,
  which are folded into the arrays from ``model=``
  (`penzai_lm.sae.formats.norm_fold`); ``mlp_in`` is written as
  ``mlp.hook_in``.

Weights: ``W_enc`` ``[d_in, d_sae]``, ``b_enc`` ``[d_sae]``, ``W_dec``
``[d_sae, d_out]``, ``b_dec`` ``[d_out]``, ``threshold`` ``[d_sae]``
(JumpReLU; older files: ``log_threshold``), ``W_skip`` ``[d_out, d_in]``
(skip transcoders). A v5 ``scaling_factor`` (``finetuning_scaling_factor``)
multiplies the features before decoding; it is folded into ``W_dec``.
"""

from __future__ import annotations

import json
from pathlib import Path
import re
import warnings

import numpy as np

from penzai_lm.file_access import write_atomic
from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.formats import hook_names
from penzai_lm.sae.formats import tensor_files
from penzai_lm.sae.formats.assemble import make_autoencoder
from penzai_lm.sae.formats.assemble import resolve_dtype
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.formats.errors import check_shape
from penzai_lm.sae.formats.errors import read_json
from penzai_lm.sae.formats.errors import check_unexpected
from penzai_lm.sae.formats.errors import config_field
from penzai_lm.sae.formats.errors import require_tensor
from penzai_lm.sae.formats.errors import where
from penzai_lm.sae.formats.norm_fold import NormReader
from penzai_lm.sae.formats.norm_fold import fold_autoencoder

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
# architecture -> (activation, transcoder, skip connection)
ARCHITECTURES = {
    "standard": ("relu", False, False),
    "jumprelu": ("jumprelu", False, False),
    "topk": ("topk", False, False),
    "transcoder": ("relu", True, False),
    "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
}
_IDENTITY_AT_LOAD = ("expected_average_only_in", "covariance_whitening")
_META_KEYS = ("hook_name", "hook_head_index", "hook_name_out",
              "hook_head_index_out", "hf_hook_name", "hf_hook_name_out",
              "model_name", "sae_lens_version")
# metadata keys write_saelens sets itself (with the ones read above).
_WRITTEN_KEYS = frozenset(_META_KEYS) | {"sae_lens_training_version",
                                         "written_by"}
WRITTEN_VERSION = "6.0.0"  # The format written (SAELens reads it as v6).


def _major(version) -> int | None:
  m = re.match(r"\s*(\d+)", str(version)) if version else None
  return int(m.group(1)) if m else None


def read_config(path: Path) -> dict:
  """``cfg.json`` in SAELens 6's terms: hook names merged from
  ``metadata``, pre-6.0 fields renamed and defaulted (module docstring)."""
  raw = read_json(path)
  if not isinstance(raw, dict):
    raise SAEFormatError(f"{path} is not a JSON object.")
  meta = raw.get("metadata") or {}
  if not isinstance(meta, dict):
    raise SAEFormatError(f"{where(path, 'metadata')} is not an object.")
  version = raw.get("sae_lens_version") or meta.get("sae_lens_version")
  cfg = dict(raw)
  if (_major(version) or 0) < 6:
    renames = {"hook_point": "hook_name",
               "hook_point_head_index": "hook_head_index",
               "activation_fn_str": "activation_fn"}
    cfg = {renames.get(k, k): v for k, v in raw.items()}
    cfg.setdefault("apply_b_dec_to_input", True)
    cfg.setdefault("architecture", "standard")
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if not isinstance(kwargs, dict):
      raise SAEFormatError(
          f"{where(path, 'activation_fn_kwargs')} is {kwargs!r}; it must be"
          " an object such as {\"k\": 32} (SAELens passes it as keyword"
          " arguments).")
    if cfg.get("activation_fn") == "topk" and kwargs.get("k") is not None:
      cfg["architecture"], cfg["k"] = "topk", kwargs["k"]
    if isinstance(cfg.get("normalize_activations"), bool):
      cfg["normalize_activations"] = (
          "expected_average_only_in" if cfg["normalize_activations"]
          else "none")
  for key in _META_KEYS:
    if meta.get(key) is not None:
      cfg[key] = meta[key]
  return cfg


def _read_weights(file: Path, cfg: dict, cfg_path: Path, arch: str):
  """The weights in `from_arrays`'s layout, checked against ``cfg``."""
  activation, transcoder, skip = ARCHITECTURES[arch]
  d_in = config_field(cfg, "d_in", cfg_path, kind="int")
  d_sae = config_field(cfg, "d_sae", cfg_path, kind="int")
  d_out = (config_field(cfg, "d_out", cfg_path, kind="int") if transcoder
           else d_in)
  tensors = tensor_files.read_safetensors(file)
  if "log_threshold" in tensors and "threshold" not in tensors:
    with np.errstate(over="ignore"):
      tensors["threshold"] = np.exp(tensors.pop("log_threshold"))
    bad = int(np.count_nonzero(~np.isfinite(tensors["threshold"])))
    if bad:
      raise SAEFormatError(
          f"{file}: tensor 'log_threshold' gives {bad} infinite thresholds"
          " (exp overflows float32 past 88.7): every such feature would be"
          " dead. The file is corrupt or not a JumpReLU SAE's.")
  scale = tensors.pop("scaling_factor", None)
  expected = {"W_enc": ((d_in, d_sae), "[d_in, d_sae]"),
              "b_enc": ((d_sae,), "[d_sae]"),
              "W_dec": ((d_sae, d_out), "[d_sae, d_out]"),
              "b_dec": ((d_out,), "[d_out]")}
  if activation == "jumprelu":
    expected["threshold"] = ((d_sae,), "[d_sae]")
  if skip:
    expected["W_skip"] = ((d_out, d_in), "[d_out, d_in]")
  check_unexpected(tensors, expected, file, f"{arch!r} autoencoder")
  arrays = {}
  for key, (shape, meaning) in expected.items():
    value = require_tensor(tensors, key, file,
                           why=f" (a {arch!r} autoencoder needs it)")
    arrays[key] = check_shape(value, shape, file, key, meaning)
  if scale is not None:
    check_shape(scale, (d_sae,), file, "scaling_factor", "[d_sae]")
    if not np.allclose(scale, 1.0):
      if cfg.get("rescale_acts_by_decoder_norm"):
        raise SAEFormatError(
            f"{file}: a scaling_factor with rescale_acts_by_decoder_norm"
            " cannot be folded into W_dec; SAELens 6 cannot load it either.")
      arrays["W_dec"] = arrays["W_dec"] * scale[:, None]
  out = {"w_enc": arrays["W_enc"], "b_enc": arrays["b_enc"],
         "w_dec": arrays["W_dec"], "b_dec": arrays["b_dec"],
         "threshold": arrays.get("threshold")}
  if skip:
    out["w_skip"] = arrays["W_skip"].T
  return out


def _points(cfg: dict, cfg_path: Path, point, output_point, config,
            transcoder: bool):
  """The points read and written: the caller's, else from the hook names
  (Hugging Face names first: they are exact); each with the
  TransformerLens hook it came from (None otherwise)."""
  if cfg.get("hook_head_index") is not None:
    raise SAEFormatError(
        f"{where(cfg_path, 'hook_head_index')} is {cfg['hook_head_index']}:"
        " SAEs on a single attention head are not supported (they read one"
        " head's slice of attn.head_out).")

  def find(tl_key, hf_key, given, what):
    if given is not None:
      return given, None
    hf, tl = cfg.get(hf_key), cfg.get(tl_key)
    found = hook_names.from_hugging_face(hf) if isinstance(hf, str) else None
    if found is not None:
      return found, None
    if isinstance(tl, str):
      found = hook_names.from_transformer_lens(tl)
      hook_names.check_mlp_hook_out(tl, found, config, where(cfg_path, tl_key))
    if found is None and (tl is not None or hf is not None):
      raise SAEFormatError(
          f"{where(cfg_path, tl_key if tl is not None else hf_key)} is"
          f" {tl if tl is not None else hf!r}, which is not a point penzai_lm"
          f" knows; pass {what}= (e.g. 'blocks.3.resid_post'). Known names:"
          f" {sorted(hook_names.TL_BLOCK_HOOKS)} after 'blocks.{{i}}.'.")
    return found, tl if found is not None else None

  read = find("hook_name", "hf_hook_name", point, "point")
  write = (find("hook_name_out", "hf_hook_name_out", output_point,
                "output_point") if transcoder else (None, None))
  return read, write


def _fold(sae: SparseAutoencoder, cfg_path: Path, read_hook, write_hook,
          model, fold_norm: bool) -> SparseAutoencoder:
  """``sae`` with the pre-MLP norm's weights folded in where its file's
  hooks are before them (`norm_fold`); an SAE is folded on both sides."""
  norms = NormReader(model, fold_norm)
  c = sae.config
  read = norms.weights(read_hook, c.hook_point, where(cfg_path, "hook_name"))
  write = (norms.weights(write_hook, c.output_point,
                         where(cfg_path, "hook_name_out"))
           if c.is_transcoder else read)
  return fold_autoencoder(sae, read, write, cfg_path)


def read_saelens(directory: Path, *, model=None, point=None, output_point=None,
                 input_axes=None, dtype=None, fold_norm=True
                 ) -> SparseAutoencoder:
  """Loads an SAELens directory (see the module docstring and
  `penzai_lm.sae.load_sae`)."""
  cfg_path = directory / CFG
  weights = directory / WEIGHTS
  if not weights.exists():
    raise SAEFormatError(f"{directory} has {CFG} but no {WEIGHTS}; the"
                         " SAELens directory is incomplete.")
  cfg = read_config(cfg_path)
  arch = config_field(cfg, "architecture", cfg_path, kind="str")
  if arch not in ARCHITECTURES:
    raise SAEFormatError(
        f"{where(cfg_path, 'architecture')} is {arch!r}; supported:"
        f" {sorted(ARCHITECTURES)}.")
  activation, transcoder, _ = ARCHITECTURES[arch]
  norm = cfg.get("normalize_activations") or "none"
  if norm in _IDENTITY_AT_LOAD:
    warnings.warn(
        f"{cfg_path}: normalize_activations={norm!r} is not applied when"
        " SAELens loads from disk either (from_pretrained folds a registry"
        " scaling factor into the weights); loaded as 'none'.", stacklevel=3)
    norm = "none"
  if norm not in ("none", "constant_norm_rescale", "layer_norm"):
    raise SAEFormatError(
        f"{where(cfg_path, 'normalize_activations')} is {norm!r}; supported:"
        " 'none', 'constant_norm_rescale', 'layer_norm'.")
  b_dec_in = config_field(cfg, "apply_b_dec_to_input", cfg_path, kind="bool",
                          default=True)
  if transcoder and b_dec_in:
    raise SAEFormatError(f"{where(cfg_path, 'apply_b_dec_to_input')} is true,"
                         " which SAELens refuses for transcoders.")
  if transcoder and norm != "none":
    raise SAEFormatError(
        f"{where(cfg_path, 'normalize_activations')} is {norm!r} on a"
        " transcoder: SAELens normalizes a transcoder's input without undoing"
        " it on the output, while penzai_lm's autoencoders always undo it, so"
        " this transcoder cannot be loaded exactly (only 'none' is"
        " supported for transcoders).")
  is_topk = activation == "topk"
  k = config_field(cfg, "k", cfg_path, kind="int") if is_topk else None
  rescale = (config_field(cfg, "rescale_acts_by_decoder_norm", cfg_path,
                          kind="bool", default=False) if is_topk else False)
  arrays = _read_weights(weights, cfg, cfg_path, arch)
  config = hook_names.model_config(model)
  (read, read_hook), (write, write_hook) = _points(
      cfg, cfg_path, point, output_point, config, transcoder)
  sae = make_autoencoder(
      cfg_path, arrays, activation=activation, transcoder=transcoder,
      point=read, output_point=write, model=model, input_axes=input_axes,
      dtype=resolve_dtype(dtype, cfg.get("dtype"), cfg_path), k=k,
      apply_b_dec_to_input=b_dec_in, normalize_activations=norm,
      rescale_acts_by_decoder_norm=rescale)
  return _fold(sae, cfg_path, read_hook, write_hook, model, fold_norm)


# -- writing ------------------------------------------------------------------


def _architecture(sae: SparseAutoencoder) -> str:
  c = sae.config
  skip = sae.w_skip is not None
  if not c.is_transcoder:
    if skip:
      raise ValueError("SAELens has no SAE architecture with a skip"
                       " connection (only skip transcoders); cannot save it.")
    return {"relu": "standard", "jumprelu": "jumprelu",
            "topk": "topk"}[c.activation]
  if c.activation == "topk":
    raise ValueError("SAELens has no TopK transcoder; cannot save it.")
  if c.normalize_activations != "none":
    raise ValueError("SAELens transcoders do not undo the input"
                     " normalization on their output; cannot save a"
                     " transcoder with normalize_activations="
                     f"{c.normalize_activations!r}.")
  if c.apply_b_dec_to_input:
    raise ValueError("SAELens refuses apply_b_dec_to_input on transcoders;"
                     " cannot save this one.")
  base = "jumprelu_" if c.activation == "jumprelu" else ""
  return f"{base}skip_transcoder" if skip else f"{base}transcoder"


def _check_metadata(metadata, model_name) -> None:
  """Refuses metadata that is not a JSON object of JSON values, or that
  would override a key `write_saelens` writes itself. Non-finite floats
  pass (written ``NaN`` / ``Infinity`` as Python's json writes them, which
  SAELens reads back): an evaluation's ``ce_recovered`` may be NaN."""
  if model_name is not None and not isinstance(model_name, str):
    raise TypeError(f"model_name must be a str, got {model_name!r}.")
  if metadata is None:
    return
  if not isinstance(metadata, dict) or not all(
      isinstance(k, str) for k in metadata):
    raise TypeError(f"metadata must be a dict with str keys, got"
                    f" {metadata!r}.")
  ours = sorted(_WRITTEN_KEYS & set(metadata))
  if ours:
    raise ValueError(
        f"metadata sets {ours}, which save_sae writes itself from the"
        " autoencoder (its points) and its arguments (model_name=); drop"
        " them (to save another point, change the autoencoder's config).")
  for key, value in metadata.items():
    try:
      json.dumps(value)
    except (TypeError, ValueError) as e:
      raise TypeError(
          f"metadata[{key!r}] is {value!r}, not a JSON value (str, number,"
          f" bool, None, or lists / dicts of those): {e}.") from e


_HEAD_OUT_AXES = (("heads", "projection"), ("query_heads", "projection"),
                  ("head_groups", "query_heads", "projection"))


def write_saelens(sae: SparseAutoencoder, directory, *, model_name=None,
                  metadata=None) -> Path:
  """Writes ``sae`` as an SAELens 6 directory (``cfg.json`` +
  ``sae_weights.safetensors``), creating it if needed; returns it.

  Raises:
    ValueError: for an autoencoder SAELens cannot represent (a skip
      connection on an SAE, a TopK transcoder, a normalized transcoder,
      head axes not in SAELens's ``(n_heads d_head)`` order).
  """
  if not isinstance(sae, SparseAutoencoder):
    raise TypeError(f"sae must be a SparseAutoencoder, got"
                    f" {type(sae).__name__}.")
  _check_metadata(metadata, model_name)
  sae.check()
  c = sae.config
  arch = _architecture(sae)
  if c.rescale_acts_by_decoder_norm and c.activation != "topk":
    raise ValueError("SAELens rescales by decoder norms in TopK SAEs only.")
  hook_z = c.hook_point is not None and c.hook_point.endswith(
      ".attn.head_out")
  if hook_z and sae.input_names not in _HEAD_OUT_AXES:
    raise ValueError(f"input axes {c.input_axes} are not in SAELens's"
                     " (n_heads d_head) order (head axes, then projection).")
  flat = {k: np.asarray(v) for k, v in sae.flat().items()}
  tensors = {"W_enc": flat["w_enc"], "b_enc": flat["b_enc"],
             "W_dec": flat["w_dec"], "b_dec": flat["b_dec"]}
  if "threshold" in flat:
    tensors["threshold"] = flat["threshold"]
  if "w_skip" in flat:
    tensors["W_skip"] = np.ascontiguousarray(flat["w_skip"].T)
  meta = {"sae_lens_version": WRITTEN_VERSION,
          "sae_lens_training_version": None, "written_by": "penzai_lm"}
  for key, point in (("hook_name", c.hook_point),
                     ("hook_name_out", c.output_point)):
    if point is not None:
      meta[key] = hook_names.to_transformer_lens(point) or point
  if model_name is not None:
    meta["model_name"] = model_name
  meta.update(metadata or {})
  cfg = {"architecture": arch, "d_in": c.input_size, "d_sae": c.num_features,
         "dtype": str(np.dtype(sae.dtype)), "device": "cpu",
         "apply_b_dec_to_input": c.apply_b_dec_to_input,
         "normalize_activations": c.normalize_activations,
         "reshape_activations": "hook_z" if hook_z else "none",
         "metadata": meta}
  if c.is_transcoder:
    cfg["d_out"] = c.output_size
  if c.activation == "topk":
    cfg["k"] = c.k
    cfg["rescale_acts_by_decoder_norm"] = c.rescale_acts_by_decoder_norm
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tensor_files.write_safetensors(directory / WEIGHTS, tensors)
  write_atomic(directory / CFG,
               (json.dumps(cfg, indent=2) + "\n").encode())
  return directory
