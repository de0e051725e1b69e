"""Chat templates are untrusted: rendering is bounded in time and memory."""

import json
import resource
import time

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

from penzai_lm.tokenizer import Tokenizer
from penzai_lm.tokenizer import chat_template as ct
from penzai_lm.tokenizer.template_limits import Limits
from penzai_lm.tokenizer.template_limits import TemplateLimitError
from tests.tokenizer.conftest import write_tiny_bpe_gguf

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"}]

BOMBS = {
    "range": "{% for i in range(10**9) %}xxxxxxxx{% endfor %}",
    "nested loops": "{% for a in range(100000) %}{% for b in range(100000) %}"
                    "x{% endfor %}{% endfor %}",
    "silent nested loops": "{% for a in range(100000) %}"
                           "{% for b in range(100000) %}{% endfor %}"
                           "{% endfor %}",
    "string multiplication": "{{ 'x' * 10**10 }}",
    "list multiplication": "{% set s = 'x' * 100000 %}{{ [s] * 100000 }}",
    "power": "{{ 2 ** 1000000000 }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "format width": "{{ '%10000000000s' % 'x' }}",
    "str.format width": "{{ '{:>10000000000}'.format('x') }}",
    "ljust": "{{ 'x'.ljust(10000000000) }}",
    "center filter": "{{ 'x' | center(10000000000) }}",
    "replace": "{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}",
    "indent": "{{ ('\n' * 1000000) | indent(1000000) }}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}"
                         "{{ f(n - 1) }}{% endif %}x{% endmacro %}"
                         "{{ f(60) }}",
    "macro buffering": "{% set big = 'x' * 1000000 %}{% macro m() %}"
                       "{% for i in range(100000) %}{{ big }}{% endfor %}"
                       "{% endmacro %}{{ m() }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_hostile_template_fails_fast_with_bounded_memory(name):
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  start = time.perf_counter()
  with pytest.raises(TemplateLimitError) as info:
    ct.render_chat_template(BOMBS[name], CHAT, source="the test template")
  assert time.perf_counter() - start < 10
  grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               - rss_before) / 1024
  assert grown_mib < 500
  message = str(info.value)
  assert isinstance(info.value, ValueError)
  assert message.startswith("Rendering the test template went over a limit")


def test_the_error_names_the_limit():
  with pytest.raises(ValueError, match=r"range\(\) of 1,000,000,000 numbers, "
                     r"more than the sandbox's 100,000"):
    ct.render_chat_template(BOMBS["range"], CHAT)
  with pytest.raises(ValueError, match="more than 1,000,000 loop iterations"):
    ct.render_chat_template(BOMBS["nested loops"], CHAT)
  with pytest.raises(ValueError, match=r"the operator '\*' would build a value"
                     r" of 10,000,000,000 characters"):
    ct.render_chat_template(BOMBS["string multiplication"], CHAT)


def test_the_deadline_stops_a_slow_template():
  slow = ("{% for a in range(100000) %}{% for b in range(100000) %}"
          "{{ (messages | tojson) | length }}{% endfor %}{% endfor %}")
  limits = Limits(max_iterations=10**12, timeout_s=0.5)
  start = time.perf_counter()
  with pytest.raises(TemplateLimitError, match="longer than 0.5 s"):
    ct.render_chat_template(slow, CHAT, limits=limits)
  assert time.perf_counter() - start < 5


def test_the_error_names_the_checkpoint(tmp_path):
  path = write_tiny_bpe_gguf(tmp_path / "evil.gguf",
                             template=BOMBS["string multiplication"])
  tok = Tokenizer.from_gguf(path)
  with pytest.raises(ValueError, match=r"chat template \(tokenizer\."
                     r"chat_template\) of .*evil\.gguf went over a limit"):
    tok.apply_chat_template(CHAT)


def test_limits_grow_with_the_conversation():
  long_chat = [{"role": "user", "content": "y" * (3 << 20)}]
  text = ct.render_chat_template(ct.CHATML_TEMPLATE, long_chat)
  assert len(text) > 3 << 20
  assert ct.limits_for({"messages": long_chat}).max_chars > 12 << 20


# A template in the style of the tool-calling templates checkpoints ship
# (Llama 3.1, Qwen 2.5): namespaces, macros, loops with loop variables,
# filters, string methods and every operator the sandbox intercepts.
RICH = """{%- macro render(value, depth) -%}
{%- if value is mapping -%}
{%- for key, item in value | dictsort -%}{{ '  ' * depth ~ key }}:
{{ render(item, depth + 1) }}{% endfor -%}
{%- else -%}{{ '  ' * depth }}{{ value | string | trim }}
{% endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- set ns = namespace(system='', turns=0) %}
{%- if messages[0]['role'] == 'system' %}
{%- set ns.system = messages[0]['content'] | trim %}
{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- '<|system|>\n' + ns.system + '\nToday: %s\n' % '26 Jul 2024' }}
{%- if tools %}
{{- 'Tools (' ~ tools | length ~ '):\n' }}
{%- for tool in tools %}{{ loop.index }}/{{ loop.length }} {{ tool | tojson(indent=2) }}
{{ render(tool['function'], 1) }}{% endfor %}
{%- endif %}
{%- for message in loop_messages if message['content'] is string %}
{%- set ns.turns = ns.turns + 1 %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('roles must alternate') }}{% endif %}
{{- '<|' ~ message['role'] ~ '|>\n' ~ message['content'].strip().replace('2+2', 'two plus two') }}
{{- '\n' if not loop.last else '' }}{{ '-' * 3 if loop.last }}
{%- endfor %}
{{- '\n' ~ ['turns', ns.turns | string] | join('=') ~ ('\n' ~ '<|assistant|>' if add_generation_prompt else '') }}
{{- ' %d%%' % (100 // 3) }}{{ (2 ** 10) | string }}{{ '{}-{}'.format('a', 1) }}
"""

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Adds.",
    "parameters": {"a": {"type": "int"}, "b": {"type": "int"}}}}]


def _jinja_sandbox(template):
  """The environment transformers renders chat templates in."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(
      x, ensure_ascii=False, indent=indent)
  env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(
      jinja2.exceptions.TemplateError(m))
  return env.from_string(template)


@pytest.mark.parametrize("template", [RICH, ct.GEMMA_TEMPLATE,
                                      ct.CHATML_TEMPLATE])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_templates_render_as_in_jinjas_sandbox(template, tools):
  variables = dict(bos_token="<s>", tools=tools, documents=None,
                   add_generation_prompt=True)
  expected = _jinja_sandbox(template).render(messages=CHAT, **variables)
  assert ct.render_chat_template(
      template, CHAT, special_tokens={"bos_token": "<s>"},
      tools=tools) == expected
