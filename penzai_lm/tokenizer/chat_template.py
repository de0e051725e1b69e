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
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

__all__ = [
    "CHATML_TEMPLATE",
    "GEMMA_TEMPLATE",
    "fallback_template",
    "render_chat_template",
]

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


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols],
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(template)


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
    **kwargs: Further template variables (e.g. ``tools``), overriding
      ``special_tokens``.

  Returns:
    The rendered prompt text.

  Raises:
    ValueError: If the template raises (e.g. roles that do not alternate) or
      cannot be parsed.
  """
  messages = _check_messages(messages)
  variables = {"tools": None, "documents": None, **(special_tokens or {})}
  variables.update(kwargs)
  try:
    return _compile(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        **variables,
    )
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f"The chat template rejected these messages: {e}") from e
