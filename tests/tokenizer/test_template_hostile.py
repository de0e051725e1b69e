"""Hostile chat templates (issue 26): shared references, deep values, huge
and deeply nested sources, and runtime errors all end in one clear error.

Each case runs in this process: the limits stop it long before it could
exhaust memory, so a regression shows as a slow or failing test here (the
old code took minutes or was OOM-killed on each).
"""

import json
import pprint
import re
import resource
import time

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

from penzai_lm.tokenizer import Tokenizer
from penzai_lm.tokenizer import chat_template as ct
from penzai_lm.tokenizer.template_limits import ChatTemplateError
from penzai_lm.tokenizer.template_limits import Limits
from penzai_lm.tokenizer.template_limits import TemplateLimitError
from tests.tokenizer.conftest import write_tiny_bpe_gguf

CHAT = [{"role": "user", "content": "Hi"}]

# ns.x holds the previous ns.x twice: 41 objects, 2**40 leaves as a tree.
SHARED_LIST = ("{% set ns = namespace(x=[1]) %}"
               + "{% set ns.x = [ns.x, ns.x] %}" * 40)
SHARED_DICT = ("{% set ns = namespace(x={}) %}"
               + "{% set ns.x = {'a': ns.x, 'b': ns.x} %}" * 60)
# The same sharing, hidden from the checks on literals: each pair is built
# while its namespace is still empty, and filled afterwards.
SHARED_NAMESPACES = (
    "{% set ns = namespace(list=[], pairs=[]) %}"
    "{% for i in range(41) %}"
    "{% set ns.list = ns.list + [namespace(x=0)] %}{% endfor %}"
    "{% for n in ns.list %}{% set ns.pairs = ns.pairs + [[n, n]] %}"
    "{% endfor %}"
    "{% for n in ns.list %}{% if not loop.first %}"
    "{% set n.x = ns.pairs[loop.index0 - 1] %}{% endif %}{% endfor %}"
    "{% set ns.x = ns.pairs[-1] %}")
DEEP_LIST = ("{% set ns = namespace(x=[]) %}{% for i in range(900) %}"
             "{% set ns.x = [ns.x] %}{% endfor %}")

CONSUMERS = {
    "tojson": "{{ ns.x | tojson }}",
    "string": "{{ ns.x | string }}",
    "pprint": "{{ ns.x | pprint }}",
    "output": "{{ ns.x }}",
    "concat": "{{ ns.x ~ '' }}",
    "format": "{{ '%s' % (ns.x,) }}",
    "str.format": "{{ '{}'.format(ns.x) }}",
    "join": "{{ [ns.x, 1] | join(',') }}",
    "raise_exception": "{{ raise_exception(ns.x) }}",
}


def _render_error(template, **kwargs):
  """What rendering ``template`` raises, without its traceback: pytest
  prints the arguments of a failing traceback's frames, and printing these
  values is what must not happen."""
  try:
    ct.render_chat_template(template, CHAT, source="the hostile template",
                            **kwargs)
  except Exception as e:  # pylint: disable=broad-exception-caught
    error = e
  else:
    pytest.fail("the template rendered")
  error.__traceback__ = error.__cause__ = error.__context__ = None
  return error


def _fails_fast(template, match="", **kwargs):
  """Renders ``template``: it must raise TemplateLimitError within seconds
  and without growing the process's peak memory by 200 MiB."""
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  start = time.perf_counter()
  error = _render_error(template, **kwargs)
  assert time.perf_counter() - start < 5
  grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               - rss_before) / 1024
  assert grown_mib < 200
  message = f"{type(error).__name__}: {error}"
  assert isinstance(error, TemplateLimitError), message
  assert re.search(match, message), message
  assert message.startswith(
      "TemplateLimitError: Rendering the hostile template went"), message
  return message


@pytest.mark.parametrize("consumer", list(CONSUMERS))
@pytest.mark.parametrize("shared", ["list", "dict"])
def test_shared_references(shared, consumer):
  _fails_fast({"list": SHARED_LIST, "dict": SHARED_DICT}[shared]
              + CONSUMERS[consumer], match="a literal would build a value")


@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_shared_references_through_namespaces(consumer):
  template = SHARED_NAMESPACES + CONSUMERS[consumer]
  if consumer == "tojson":  # JSON has no namespaces: it fails at once.
    error = _render_error(template)
    assert type(error) is ChatTemplateError  # pylint: disable=unidiomatic-typecheck
    assert "Namespace is not JSON serializable" in str(error)
  else:  # Caught where the value is printed, before it is.
    _fails_fast(template, match="would build a value of")


def test_shared_tuples_are_refused_before_they_are_hashed():
  _fails_fast("{% set ns = namespace(x=(1,)) %}"
              + "{% set ns.x = (ns.x, ns.x) %}" * 40
              + "{{ [ns.x] | unique | list | length }}")


def test_tojson_indent_on_deep_nesting():
  _fails_fast(DEEP_LIST + "{{ ns.x | tojson(indent=3000) }}",
              match="the filter 'tojson' would build a value of 2,4")
  _fails_fast("{{ 1 | tojson(indent=10**9) }}", match="indent of the filter")


def test_pprint_of_a_60_level_dict():
  _fails_fast(SHARED_DICT + "{{ ns.x | pprint }}")
  # Without sharing, 60 levels print as jinja's pprint does.
  nested = ("{% set ns = namespace(x=1) %}{% for i in range(60) %}"
            "{% set ns.x = {'key' ~ i: ns.x, 'other': [i, 'x']} %}"
            "{% endfor %}")
  value = 1
  for i in range(60):
    value = {f"key{i}": value, "other": [i, "x"]}
  assert ct.render_chat_template(
      nested + "{{ ns.x | pprint }}", CHAT) == pprint.pformat(value)


def test_pprint_output_is_bounded_while_printing():
  # 150 levels of 1000-character keys: 150,000 characters as one line;
  # pprint indents each level's second item past all the keys above it,
  # about 11 million characters.
  long_keys = ("{% set ns = namespace(x=1) %}{% set k = 'k' * 1000 %}"
               "{% for i in range(150) %}{% set ns.x = {k: ns.x, 'b': 1} %}"
               "{% endfor %}{{ ns.x | pprint }}")
  _fails_fast(long_keys, match="output of the filter 'pprint'")


def test_map_generators_are_charged():
  _fails_fast("{{ range(100000) | map('center', 1000000) | list | length }}",
              match="the result of the filter 'map'")


def test_bounded_filters_match_the_unbounded_ones():
  value = {"name": "añadir \u2028 \"x\" \\ \n\t\x00 😀", "n": [1, 2.5, None,
           True, {"deep": [[], {}, [[]]]}], "ok": False, 3: "int key"}
  for kwargs in [{}, {"indent": 2}, {"indent": "\t"},
                 {"separators": (",", ":")}, {"ensure_ascii": True},
                 {"indent": 0, "sort_keys": False}]:
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    out = ct.render_chat_template(f"{{{{ v | tojson({args}) }}}}", CHAT, v=value)
    assert out == json.dumps(value, **{"ensure_ascii": False, **kwargs})
  assert ct.render_chat_template("{{ v | pprint }}", CHAT,
                                 v=value) == pprint.pformat(value)


@pytest.mark.parametrize("size", [2_000_000, 10_000_000])
def test_template_size(size):
  template = "{{ 'a' }}" * (size // 9)
  start = time.perf_counter()
  message = _fails_fast(template, match="its source is")
  assert time.perf_counter() - start < 0.5  # Checked before compiling.
  assert f"{len(template):,} characters long" in message


def test_template_size_limit_leaves_room_for_real_templates():
  # The largest real template we know of has about 40,000 characters.
  assert ct.DEFAULT_LIMITS.max_template_chars >= 3 * 40_000
  template = "{{ 'a' }}" * (50_000 // 9)
  assert ct.render_chat_template(template, CHAT) == "a" * (50_000 // 9)


@pytest.mark.parametrize("units", [300_000, 5_600_000])  # 2.7 and 50 MB
def test_template_size_in_a_gguf_names_the_file(tmp_path, units):
  """The probe's 50 MB template had not finished after 170 s: it is now
  refused by its size, before anything compiles."""
  path = write_tiny_bpe_gguf(tmp_path / "big.gguf",
                             template="{{ 'a' }}" * units)
  start = time.perf_counter()
  tok = Tokenizer.from_gguf(path)
  with pytest.raises(TemplateLimitError, match=r"tokenizer\.chat_template\)"
                     r" of .*big\.gguf went over a limit: its source is"):
    tok.apply_chat_template(CHAT)
  assert time.perf_counter() - start < 30


@pytest.mark.parametrize("unit", ["{% if x %}y{% endif %}",
                                  "{{ x(1)(2)[3].y | trim | lower }}"])
def test_compiling_is_under_the_deadline(unit):
  # Well under the size limit, but compiling it takes seconds.
  template = unit * (120_000 // len(unit))
  start = time.perf_counter()
  with pytest.raises(TemplateLimitError, match="longer than 0.2 s"):
    ct.render_chat_template(template, CHAT, limits=Limits(timeout_s=0.2))
  assert time.perf_counter() - start < 2


@pytest.mark.parametrize("template", [
    "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000,
    "{{ " + "[" * 3000 + "]" * 3000 + " }}",
])
def test_deep_templates(template):
  _fails_fast(template, match="nested too deeply to compile")


@pytest.mark.parametrize("consumer", ["{{ ns.x }}", "{{ ns.x | tojson }}",
                                      "{{ ns.x | pprint }}"])
def test_deep_values_when_printed(consumer):
  _fails_fast(DEEP_LIST.replace("900", "3000") + consumer,
              match="recursed too deeply")


@pytest.mark.parametrize("template, line, what", [
    ("{{ 1 + 'a' }}", 1, "TypeError: unsupported operand"),
    ("x\n{{ '{}'.format() }}", 2, "IndexError: "),
    ("\n\n{{ 1 / 0 }}", 3, "ZeroDivisionError: division by zero"),
    ("{{ foo.bar.baz }}", 1, "UndefinedError: 'foo' is undefined"),
    ("{{ 2 ** 20000 }}", 1, "ValueError: Exceeds the limit"),
    ("{{ [1, [2]] | sort }}", 1, "TypeError: "),
    ("{{ {'a': [ns]} | tojson }}", 1, "UndefinedError|TypeError"),
    ("a\n{% if %}", 2, "not a valid Jinja2 template at line 2: Expected an"),
    ("{% for i in [1] %}" * 30 + "x" + "{% endfor %}" * 30, None,
     "could not be compiled: too many statically nested blocks"),
])
def test_template_errors(tmp_path, template, line, what):
  path = write_tiny_bpe_gguf(tmp_path / "broken.gguf", template=template)
  with pytest.raises(ChatTemplateError) as info:
    Tokenizer.from_gguf(path).apply_chat_template(CHAT)
  message = str(info.value)
  assert isinstance(info.value, ValueError)
  assert message.startswith("The chat template (tokenizer.chat_template) of ")
  assert "broken.gguf" in message
  if line is not None:
    assert f"at line {line}" in message
  assert any(w in message for w in what.split("|")), message


def test_raise_exception_says_which_template_rejected_the_messages():
  with pytest.raises(ChatTemplateError, match=r"^The test template rejected"
                     r" these messages at line 2: roles must alternate$"):
    ct.render_chat_template("\n{{ raise_exception('roles must alternate') }}",
                            CHAT, source="the test template")
  assert issubclass(TemplateLimitError, ChatTemplateError)


# A template in the style of current tool-calling templates (Kimi K2/K3,
# Qwen 3): sorted JSON by a recursive macro, tojson with options, pprint,
# namespaces and literals of the inputs; rendered as jinja's own sandbox
# with transformers' tojson renders it.
TOOLISH = """{%- macro json_sorted(value) -%}
{%- if value is mapping -%}{{ '{' }}{% for key, item in value | dictsort %}
{%- if not loop.first %},{% endif %}{{ key | tojson }}:{{ json_sorted(item) }}
{%- endfor %}{{ '}' }}
{%- elif value is string or value is number or value is none -%}
{{ value | tojson(ensure_ascii=false) }}
{%- else -%}[{% for item in value %}{{ ',' if not loop.first }}
{{- json_sorted(item) }}{% endfor %}]{% endif -%}
{%- endmacro -%}
{%- set state = namespace(seen=[], calls=0) -%}
{{ json_sorted(tools) }}
{{ tools | tojson(indent=4) }}{{ tools[0] | tojson(separators=(',', ':')) }}
{% for m in messages %}{% set state.seen = state.seen + [(m.role, m)] %}
{%- set state.calls = state.calls + 1 %}
<|{{ m.role }}|>{{ m.content | string }}{{ [m, m] | length }}
{%- endfor %}
{{ state.seen | map(attribute='0') | join(',') }} {{ {'n': state.calls} }}
{{ state.seen[-1] | pprint }}
"""

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Finds «things» — fast.",
    "parameters": {"type": "object", "required": ["q"], "properties": {
        "q": {"type": "string"}, "k": {"type": "integer", "default": 3}}}}}]


def test_a_tool_template_renders_as_in_jinjas_sandbox():
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, \
      separators=None, sort_keys=False: json.dumps(
          x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
          sort_keys=sort_keys)
  chat = [{"role": "user", "content": "Find\nit 😀"},
          {"role": "assistant", "content": "Done."}]
  expected = env.from_string(TOOLISH).render(messages=chat, tools=TOOLS)
  assert ct.render_chat_template(TOOLISH, chat, tools=TOOLS) == expected
