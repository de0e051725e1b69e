"""Reads a Hugging Face tokenizer directory into `Tokenizer` arguments.

Files read (all but ``tokenizer.json`` optional): ``tokenizer.json``;
``tokenizer_config.json`` (special tokens, ``add_bos_token``,
``chat_template``, ``clean_up_tokenization_spaces``); ``chat_template.jinja``
(overrides the config's template); ``special_tokens_map.json``; the EOS ids
of ``generation_config.json`` and ``config.json``.

Every value is checked (`file_values`): a malformed file or field raises
`TokenizerFileError` naming the file and the field, with the library's own
error chained, never a bare `tokenizers` or `json` traceback.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping
from typing import Any

import tokenizers

from penzai_lm.tokenizer.file_values import TokenizerFileError
from penzai_lm.tokenizer.file_values import parse_bool
from penzai_lm.tokenizer.file_values import parse_token_id
from penzai_lm.tokenizer.file_values import parse_token_ids
from penzai_lm.tokenizer.file_values import read_json_object

__all__ = ["read_hf_tokenizer"]

_CORRUPT = "the file is corrupt; re-download it"


def _merge_problem(model: Mapping[str, Any], path) -> TokenizerFileError | None:
  """The first merge of a BPE model that tokenizers would reject, if any."""
  vocab, merges = model.get("vocab"), model.get("merges")
  if not isinstance(vocab, Mapping) or not all(
      isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()):
    return TokenizerFileError(
        path, "model.vocab", f"must map token strings to integer ids; "
        f"{_CORRUPT}.")
  if not isinstance(merges, list):
    return TokenizerFileError(
        path, "model.merges", f"is a {type(merges).__name__}, not a list; "
        f"{_CORRUPT}.")
  prefix = model.get("continuing_subword_prefix") or ""
  for i, merge in enumerate(merges):
    pair = merge.split(" ") if isinstance(merge, str) else merge
    if not (isinstance(pair, list) and len(pair) == 2
            and all(isinstance(p, str) and p for p in pair)):
      return TokenizerFileError(
          path, f"model.merges[{i}]",
          f"is {merge!r}; a merge is two tokens (\"a b\" or [\"a\", \"b\"])"
          f"; {_CORRUPT}.")
    left, right = pair
    merged = left + (right[len(prefix):] if right.startswith(prefix) else right)
    for token in (left, right, merged):
      if token not in vocab:
        return TokenizerFileError(
            path, f"model.merges[{i}]",
            f"merges {left!r} and {right!r}, but {token!r} is not in "
            f"model.vocab; {_CORRUPT}.")
  return None


def _diagnose(path: pathlib.Path, error: Exception) -> TokenizerFileError:
  """Names the field of ``tokenizer.json`` that tokenizers cannot read."""
  data = read_json_object(path)  # Raises for non-JSON (e.g. truncated).
  model = data.get("model")
  if not isinstance(model, Mapping):
    return TokenizerFileError(
        path, "model", f"is missing or not an object; {_CORRUPT}.")
  if model.get("type", "BPE") == "BPE" and "merges" in model:
    problem = _merge_problem(model, path)
    if problem is not None:
      return problem
  added = data.get("added_tokens", [])
  for i, token in enumerate(added if isinstance(added, list) else [None]):
    if not (isinstance(token, Mapping) and isinstance(token.get("id"), int)
            and isinstance(token.get("content"), str)):
      return TokenizerFileError(
          path, "added_tokens" if token is None else f"added_tokens[{i}]",
          "must be a list of {\"id\": int, \"content\": str, ...} entries; "
          f"{_CORRUPT}.")
  missing = re.search(r"missing field `(\w+)`", str(error))
  return TokenizerFileError(
      path, missing.group(1) if missing else "",
      f"cannot be read by the tokenizers library ({error}); the file is "
      "corrupt, or written by a newer tokenizers version.")


def _load_backend(path: pathlib.Path) -> tokenizers.Tokenizer:
  try:
    return tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # tokenizers raises a bare Exception.
    raise _diagnose(path, e) from e


def _token_content(value: Any, path, field: str) -> str | None:
  if isinstance(value, Mapping):  # {"content": "<s>", "lstrip": ...}
    value = value.get("content")
    field = f"{field}.content"
  if value is None or isinstance(value, str):
    return value
  raise TokenizerFileError(
      path, field, f"is {value!r}; a special token must be given as its "
      "string (or {\"content\": string, ...}).")


def _config_template(cfg: Mapping[str, Any], path) -> tuple[str | None, str]:
  """``chat_template`` of tokenizer_config.json, and where it comes from.

  A list of ``{"name", "template"}`` entries (as transformers allows) gives
  the one named "default".
  """
  template = cfg.get("chat_template")
  source = f"the chat template of {path}"
  if template is None or isinstance(template, str):
    return template, source
  if not isinstance(template, list):
    raise TokenizerFileError(
        path, "chat_template", f"is a {type(template).__name__}; it must be a"
        " string, or a list of {\"name\": ..., \"template\": ...} entries.")
  named = {}
  for i, entry in enumerate(template):
    if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)):
      raise TokenizerFileError(
          path, f"chat_template[{i}]",
          f"is {entry!r:.80}; each entry of a list of chat templates must be"
          " {\"name\": string, \"template\": string}.")
    named[entry["name"]] = entry["template"]
  if "default" not in named:
    raise TokenizerFileError(
        path, "chat_template",
        f"lists templates named {sorted(named)} but none named 'default', "
        "so there is no template to use; name one 'default' (or write it to "
        "chat_template.jinja).")
  return named["default"], f"the chat template 'default' of {path}"


def read_hf_tokenizer(directory) -> dict[str, Any]:
  """`Tokenizer` keyword arguments for a Hugging Face model directory.

  Raises:
    ValueError: If the directory has no ``tokenizer.json``;
      `TokenizerFileError` if a file or field is malformed.
  """
  d = pathlib.Path(directory)
  if not (d / "tokenizer.json").is_file():
    raise ValueError(
        f"{d} has no tokenizer.json. Tokenizer.from_hf needs a Hugging Face "
        "'fast' tokenizer file; for a GGUF file use Tokenizer.from_gguf."
    )
  backend = _load_backend(d / "tokenizer.json")
  size = backend.get_vocab_size(with_added_tokens=True)
  paths = {n: d / f"{n}.json" for n in (
      "tokenizer_config", "special_tokens_map", "config", "generation_config")}
  cfg, smap, model_cfg, gen_cfg = (read_json_object(p) for p in paths.values())

  def token_id(name: str) -> int | None:
    where, source = ("tokenizer_config", cfg) if name in cfg else (
        "special_tokens_map", smap)
    token = _token_content(source.get(name), paths[where], name)
    if token is not None and backend.token_to_id(token) is not None:
      return backend.token_to_id(token)
    ids = parse_token_ids(model_cfg.get(f"{name}_id"), paths["config"],
                          f"{name}_id")
    return parse_token_id(ids[0], paths["config"], f"{name}_id", size) if (
        ids) else None

  bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
  add_bos = parse_bool(cfg.get("add_bos_token"), paths["tokenizer_config"],
                       "add_bos_token")
  if add_bos is None:  # Does the post-processor add BOS (e.g. Llama 3)?
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    add_bos = (bos_id is not None and len(with_special) > len(plain)
               and with_special[0] == bos_id)
  extra = []
  for name, source in (("generation_config", gen_cfg), ("config", model_cfg)):
    ids = parse_token_ids(source.get("eos_token_id"), paths[name],
                          "eos_token_id")
    if eos_id is None and ids:
      eos_id = parse_token_id(ids[0], paths[name], "eos_token_id", size)
    extra.extend(ids)
  jinja = d / "chat_template.jinja"
  if jinja.is_file():
    try:
      template = jinja.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
      raise TokenizerFileError(jinja, "", f"is not UTF-8 text (byte "
                               f"{e.start}); {_CORRUPT}.") from e
    source = f"the chat template {jinja}"
  else:
    template, source = _config_template(cfg, paths["tokenizer_config"])
  model_type = model_cfg.get("model_type")
  if model_type is not None and not isinstance(model_type, str):
    raise TokenizerFileError(paths["config"], "model_type",
                             f"is {model_type!r}, not a string.")
  return dict(
      backend=backend,
      bos_id=bos_id,
      eos_id=eos_id,
      pad_id=token_id("pad_token"),
      unk_id=token_id("unk_token"),
      add_bos=add_bos,
      extra_eos_ids=extra,
      chat_template=template,
      clean_up_tokenization_spaces=bool(parse_bool(
          cfg.get("clean_up_tokenization_spaces"), paths["tokenizer_config"],
          "clean_up_tokenization_spaces")),
      architecture=model_type,
      chat_template_source=source,
  )
