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

A template comes with a checkpoint, so it is untrusted code: it compiles
and renders in a `template_limits.BoundedSandbox`, which also bounds its
source size, time, loop iterations and the size of its values and output
(`DEFAULT_LIMITS`, scaled up with the size of the conversation). The
sandbox has no ``lipsum`` global (no chat template uses it), and its
``tojson`` and ``pprint`` measure their output before building it.

Every failure of a template, whatever went wrong inside it, raises
`ChatTemplateError` (a ``ValueError``) whose message names the template's
source (the file and field it came from, when the caller says), the
template line when known, and what went wrong; one over a limit is the
subclass `TemplateLimitError`. Errors in the caller's own arguments (an
empty conversation, a message that is not a dict) stay plain ``TypeError``
and ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext

from penzai_lm.tokenizer import template_filters
from penzai_lm.tokenizer import template_limits
from penzai_lm.tokenizer.template_limits import ChatTemplateError
from penzai_lm.tokenizer.template_limits import TemplateLimitError

__all__ = [
    "CHATML_TEMPLATE",
    "ChatTemplateError",
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


class _Raised(jinja2.exceptions.TemplateError):
  """What a template's ``raise_exception(message)`` raises."""


def _raise_exception(message: Any):
  if not isinstance(message, str):
    budget = template_limits.current_budget()
    budget.check_size(budget.text_size(message),
                      "the message of raise_exception()")
    message = str(message)
  raise _Raised(message)


def _strftime_now(fmt: str) -> str:
  if isinstance(fmt, str):  # Each directive prints at most a few dozen.
    template_limits.current_budget().check_size(
        len(fmt) + 64 * fmt.count("%"), "strftime_now()")
  return datetime.datetime.now().strftime(fmt)


@functools.cache
def _environment() -> template_limits.BoundedSandbox:
  return template_limits.BoundedSandbox(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols],
      # transformers' tojson: json.dumps, HTML characters not escaped.
      filters={"tojson": template_filters.tojson},
      globals_={"raise_exception": _raise_exception,
                "strftime_now": _strftime_now},
  )


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


def _short(text: str, most: int = 500) -> str:
  return text if len(text) <= most else text[:most] + " [...]"


def _template_line(error: BaseException) -> int | None:
  """The template line an error was raised at (jinja rewrites tracebacks
  to point into the template), or None."""
  if isinstance(error, jinja2.exceptions.TemplateSyntaxError):
    return error.lineno
  line, tb = None, error.__traceback__
  while tb is not None:
    if tb.tb_frame.f_code.co_filename == "<template>":
      line = tb.tb_lineno
    tb = tb.tb_next
  return line


def _failure(error: Exception, source: str) -> ChatTemplateError:
  """One `ChatTemplateError` for whatever a template raised."""
  name = source[:1].upper() + source[1:]
  fix = ("Fix the template, or set the tokenizer's chat_template to one"
         " that works.")
  if isinstance(error, SyntaxError):  # Python's, on jinja's generated code.
    return ChatTemplateError(f"{name} could not be compiled:"
                             f" {_short(str(error.msg))}. {fix}")
  line = _template_line(error)
  at = f" at line {line}" if line else ""
  if isinstance(error, _Raised):
    return ChatTemplateError(
        f"{name} rejected these messages{at}: {_short(str(error.message))}")
  if isinstance(error, jinja2.exceptions.TemplateSyntaxError):
    return ChatTemplateError(f"{name} is not a valid Jinja2 template{at}:"
                             f" {_short(str(error.message))}. {fix}")
  return ChatTemplateError(
      f"{name} failed{at} with these messages:"
      f" {type(error).__name__}: {_short(str(error))}. {fix}")


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
    ChatTemplateError: (a ``ValueError``) If the template fails in any way:
      it raises (e.g. roles that do not alternate), cannot be compiled, or
      fails while rendering; `TemplateLimitError`, its subclass, if it goes
      over a limit: source size, time, loop iterations, value or output
      size.
    TypeError, ValueError: If ``messages`` is not a non-empty list of dicts.
  """
  messages = _check_messages(messages)
  variables = {"tools": None, "documents": None, **(special_tokens or {})}
  variables.update(kwargs)
  variables.update(messages=messages,
                   add_generation_prompt=add_generation_prompt)
  budget = template_limits.Budget(
      limits or limits_for(variables), source or "the chat template")
  environment = _environment()
  try:
    compiled = environment.compile_bounded(template, budget)
    return environment.render_bounded(compiled, variables, budget)
  except ChatTemplateError:
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise _failure(e, budget.source) from e
