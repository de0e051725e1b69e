"""Renders chat templates (Jinja2) the way Hugging Face transformers does.

A model's chat template turns a list of messages into the prompt text the
model was trained on. The environment here matches transformers'
``apply_chat_template``: a sandboxed Jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that does not escape HTML, and the globals
``raise_exception`` and ``strftime_now``. Special token strings
(``bos_token``, ``eos_token``, ...) are passed as template variables.

Files without a template get a documented fallback chosen from their
vocabulary (see `fallback_template`).

A template comes with a checkpoint, so it is untrusted code: it renders in
a `template_limits.BoundedSandbox`, which also bounds its time, loop
iterations and output (`DEFAULT_LIMITS`, scaled up with the size of the
conversation); one over a limit raises `TemplateLimitError` (a
``ValueError``) naming the template's source and the limit. The sandbox has
no ``lipsum`` global (no chat template uses it).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext

from penzai_lm.tokenizer import template_limits
from penzai_lm.tokenizer.template_limits import TemplateLimitError

__all__ = [
    "CHATML_TEMPLATE",
    "DEFAULT_LIMITS",
    "GEMMA_TEMPLATE",
    "TemplateLimitError",
    "fallback_template",
    "limits_for",
    "render_chat_template",
]

# Real chat templates render in milliseconds, with a few loop iterations per
# message and output about the size of the conversation.
DEFAULT_LIMITS = template_limits.Limits(
    max_chars=1 << 20, max_iterations=1_000_000, timeout_s=5.0)

# Gemma's turn format (text-only version of the Gemma 3 instruct template):
# <bos><start_of_turn>user\n{system\n\n}{text}<end_of_turn>\n
# <start_of_turn>model\n{text}<end_of_turn>\n ... and, for generation,
# <start_of_turn>model\n. Roles must alternate user/assistant.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + "
    "(first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

# ChatML, as used by SmolLM2 and Qwen (without a default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def fallback_template(vocab_has: Any) -> str | None:
  """Picks a template for a tokenizer whose files have none.

  Gemma's turn format if the vocabulary has ``<start_of_turn>`` and
  ``<end_of_turn>``, ChatML if it has ``<|im_start|>`` and ``<|im_end|>``,
  else None.

  Args:
    vocab_has: A predicate telling whether a token string is in the
      vocabulary.
  """
  if vocab_has("<start_of_turn>") and vocab_has("<end_of_turn>"):
    return GEMMA_TEMPLATE
  if vocab_has("<|im_start|>") and vocab_has("<|im_end|>"):
    return CHATML_TEMPLATE
  return None


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None,
            sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


@functools.cache
def _environment() -> template_limits.BoundedSandbox:
  return template_limits.BoundedSandbox(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols],
      filters={"tojson": _tojson},
      globals_={"raise_exception": _raise_exception,
                "strftime_now": _strftime_now},
  )


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  return _environment().from_string(template)


def _input_chars(value: Any, depth: int = 0) -> int:
  """Characters of the strings in the template's inputs (nested)."""
  if isinstance(value, (str, bytes)):
    return len(value)
  if depth > 8:
    return 0
  if isinstance(value, Mapping):
    return sum(_input_chars(k, depth + 1) + _input_chars(v, depth + 1)
               for k, v in value.items())
  if isinstance(value, (list, tuple)):
    return sum(_input_chars(v, depth + 1) for v in value)
  return 8


def limits_for(variables: Mapping[str, Any],
               base: template_limits.Limits = DEFAULT_LIMITS
               ) -> template_limits.Limits:
  """``base`` with the size limit raised to 4x the inputs' characters (a
  long conversation renders to about its own size)."""
  chars = _input_chars(dict(variables))
  return dataclasses.replace(
      base, max_chars=max(base.max_chars, 4 * chars + (64 << 10)))


def _check_messages(messages: Any) -> list[dict[str, Any]]:
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
    raise TypeError(
        "messages must be a list of dicts like "
        "[{'role': 'user', 'content': 'Hi'}], got "
        f"{type(messages).__name__}."
    )
  if not messages:
    raise ValueError("Cannot apply a chat template to an empty conversation.")
  out = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping) or "role" not in message:
      raise ValueError(
          f"messages[{i}] must be a dict with 'role' and 'content' keys, "
          f"got {message!r}."
      )
    # Like transformers: drop None values (e.g. OpenAI's content=None).
    out.append({k: v for k, v in message.items() if v is not None})
  return out


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    source: str | None = None,
    limits: template_limits.Limits | None = None,
    **kwargs: Any,
) -> str:
  """Renders ``messages`` with a Jinja2 chat template.

  Args:
    template: The Jinja2 template source.
    messages: Dicts with ``role`` and ``content`` keys.
    add_generation_prompt: Whether to append the header that starts the
      assistant's turn.
    special_tokens: Template variables such as ``bos_token`` and
      ``eos_token`` (token strings).
    source: Where the template comes from (e.g. "the chat template of
      model.gguf"), for error messages.
    limits: Bounds on rendering (default: `limits_for` the inputs).
    **kwargs: Further template variables (e.g. ``tools``), overriding
      ``special_tokens``.

  Returns:
    The rendered prompt text.

  Raises:
    ValueError: If the template raises (e.g. roles that do not alternate) or
      cannot be parsed. `TemplateLimitError` (a ``ValueError``) if it goes
      over a limit: time, loop iterations, or output size.
  """
  messages = _check_messages(messages)
  variables = {"tools": None, "documents": None, **(special_tokens or {})}
  variables.update(kwargs)
  variables.update(messages=messages,
                   add_generation_prompt=add_generation_prompt)
  budget = template_limits.Budget(
      limits or limits_for(variables), source or "the chat template")
  try:
    # Compiling folds constants (calling filters): it is charged too.
    with template_limits.using_budget(budget):
      compiled = _compile(template)
    return _environment().render_bounded(compiled, variables, budget)
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f"The chat template rejected these messages: {e}") from e
