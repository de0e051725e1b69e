"""A Jinja2 sandbox that also bounds the time and memory a template takes.

Chat templates come with checkpoints, so they are untrusted code. Jinja's
`ImmutableSandboxedEnvironment` stops them from reaching Python internals
but not from working forever or building huge values: ``{{ 'x' * 10**10
}}``, nested loops of 10**5 iterations each, a string doubled in a loop,
or a list that holds another twice, forty times over, would run until
``MemoryError`` or the kernel kills the process.

`BoundedSandbox` charges every step a template takes, compiling included,
to a per-render `Budget` (`Limits`, in `template_budget`), and refuses
with `TemplateLimitError` (a `ChatTemplateError`, a ``ValueError``)
naming the template's source and the limit:

* source: longer than ``max_template_chars`` is refused before compiling;
* time: a wall-clock deadline checked for every token parsed, every node
  compiled and every step below. Only Python's own ``compile()`` of the
  generated code is not interrupted: linear in the bounded source, it may
  overrun the deadline by the time that compile takes;
* loop iterations: every ``for`` loop's iterable is wrapped (by the code
  generator) in a counter, which also charges the loop body's literal text
  to the output budget;
* output: every ``{{ ... }}`` value (in macros and ``set`` blocks too) and
  every streamed chunk is counted, the value before it is printed;
* single values, counted as trees over shared references
  (`template_values`): every list, tuple and dict literal, and every
  call's and filter's result; ``*``, ``+``, ``**`` and ``%`` are
  intercepted and refused *before* they would build a value over the
  size limit (or an integer over ``max_int_bits``), ``~`` (concatenation)
  likewise; calls and filters that print or amplify their input
  (``string``, ``join``, ``format``, ``str.replace``, ``center``, ...)
  are estimated before they run, ``tojson`` and ``pprint`` are bounded
  versions (`template_filters`), and a filter's generator is charged for
  what it yields;
* ``range()`` above jinja's ``MAX_RANGE`` is refused with the same error.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
import functools
from typing import Any, Callable

import jinja2
import jinja2.compiler
import jinja2.lexer
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox

from penzai_lm.tokenizer import template_filters
from penzai_lm.tokenizer import template_sizes
from penzai_lm.tokenizer.template_budget import Budget
from penzai_lm.tokenizer.template_budget import ChatTemplateError
from penzai_lm.tokenizer.template_budget import current_budget
from penzai_lm.tokenizer.template_budget import current_budget_or_none
from penzai_lm.tokenizer.template_budget import Limits
from penzai_lm.tokenizer.template_budget import TemplateLimitError
from penzai_lm.tokenizer.template_budget import using_budget

__all__ = ["BoundedSandbox", "Budget", "ChatTemplateError", "Limits",
           "TemplateLimitError", "current_budget", "using_budget"]

# Jinja's builtin filters that print a non-string input with str().
_TEXT_FILTERS = frozenset({
    "string", "capitalize", "center", "e", "escape", "forceescape",
    "indent", "lower", "upper", "title", "trim", "truncate", "wordcount",
    "wordwrap", "striptags", "replace", "urlize", "urlencode", "safe",
    "xmlattr"})


class _LoopIterable:
  """A loop's iterable that charges the budget for every iteration (and
  the loop body's literal text); sized like the iterable it wraps."""

  def __init__(self, iterable: Any, chars: int):
    self._iterable = iterable
    self._chars = chars

  def __len__(self) -> int:
    return len(self._iterable)

  def __iter__(self):
    budget = current_budget()
    for item in self._iterable:
      budget.iteration(self._chars)
      yield item


class _ChargedIterator:
  """A generator a filter returned (``map``, ``select``, ...), charged for
  the size of everything it yields, which ``list`` or ``join`` collects."""

  def __init__(self, iterator: Iterator[Any], what: str):
    self._iterator = iterator
    self._what = what
    self._total = 0

  def __iter__(self):
    return self

  def __next__(self):
    item = next(self._iterator)
    budget = current_budget()
    budget.tick()
    self._total += budget.unrolled(item)
    budget.check_size(self._total, self._what)
    return item


def _checked_result(budget: Budget, result: Any, what: str) -> Any:
  if isinstance(result, Iterator):
    return _ChargedIterator(result, what)
  budget.check_value(result, what)
  return result


def _ticking(stream: Iterator[jinja2.lexer.Token]
             ) -> Iterator[jinja2.lexer.Token]:
  """Tokens, with the clock checked for each (parsing has no other hook)."""
  budget = current_budget_or_none()
  for token in stream:
    if budget is not None:
      budget.tick()
    yield token


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
  """Jinja's code generator, with every loop counted, every literal
  container and ``~`` checked (none has a sandbox hook of its own), and
  the clock checked for every node."""

  def visit(self, node, *args, **kwargs):
    budget = current_budget_or_none()
    if budget is not None:
      budget.tick()
    return super().visit(node, *args, **kwargs)

  def visit_For(self, node, frame):
    wrapped = (isinstance(node.iter, jinja2.nodes.Call) and isinstance(
        node.iter.node, jinja2.nodes.EnvironmentAttribute))
    if not wrapped:
      # The loop body's literal text, written once per iteration.
      chars = sum(len(data.data) for child in node.body
                  for data in child.find_all(jinja2.nodes.TemplateData))
      chars += sum(len(child.data) for child in node.body
                   if isinstance(child, jinja2.nodes.TemplateData))
      # ``environment.loop_iterable(iterable, chars)``, called through the
      # sandbox like any call (jinja allows no custom node types).
      node.iter = jinja2.nodes.Call(
          jinja2.nodes.EnvironmentAttribute("loop_iterable"),
          [node.iter, jinja2.nodes.Const(chars)], [], None, None,
          lineno=node.iter.lineno)
    super().visit_For(node, frame)

  def visit_Concat(self, node, frame):
    if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
      super().visit_Concat(node, frame)
      return
    self.write("environment.checked_concat((")
    for arg in node.nodes:
      self.visit(arg, frame)
      self.write(", ")
    self.write("))")

  def _checked_literal(self, visit, node, frame):
    if getattr(node, "ctx", "load") != "load":  # An assignment's target.
      visit(node, frame)
      return
    self.write("environment.checked_value(")
    visit(node, frame)
    self.write(")")

  def visit_List(self, node, frame):
    self._checked_literal(super().visit_List, node, frame)

  def visit_Tuple(self, node, frame):
    self._checked_literal(super().visit_Tuple, node, frame)

  def visit_Dict(self, node, frame):
    self._checked_literal(super().visit_Dict, node, frame)


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """An immutable sandbox whose templates render within `Limits`; see the
  module docstring. Render with `render_bounded` (which sets the budget)."""

  code_generator_class = _BoundedCodeGenerator
  intercepted_binops = frozenset({"*", "+", "**", "%"})

  def __init__(self, *, filters: dict[str, Callable] | None = None,
               globals_: dict[str, Any] | None = None, **options: Any):
    super().__init__(finalize=_finalize, **options)
    self.filters.update(tojson=template_filters.tojson,
                        pprint=template_filters.pprint)
    self.filters.update(filters or {})
    self.filters = {name: _guarded_filter(name, f)
                    for name, f in self.filters.items()}
    self.globals.update(globals_ or {})
    self.globals["range"] = _bounded_range
    # Its output (n paragraphs of up to `max` words) is not a template's
    # business, and chat templates never use it.
    self.globals.pop("lipsum", None)
    self._compiled: collections.OrderedDict[str, jinja2.Template] = (
        collections.OrderedDict())

  def compile_bounded(self, source: str, budget: Budget) -> jinja2.Template:
    """Compiles ``source`` within ``budget`` (the last 16 are kept)."""
    budget.check_source(source)
    template = self._compiled.get(source)
    if template is None:
      with using_budget(budget):
        try:
          template = self.from_string(source)
        except RecursionError as e:
          raise budget.fail("it is nested too deeply to compile") from e
        except MemoryError as e:
          raise budget.fail("it ran out of memory compiling") from e
      budget.tick()  # Python's compile() of the generated code.
      self._compiled[source] = template
      if len(self._compiled) > 16:
        self._compiled.popitem(last=False)
    return template

  def _tokenize(self, source, name, filename=None, state=None):
    stream = super()._tokenize(source, name, filename, state)
    return jinja2.lexer.TokenStream(_ticking(stream), name, filename)

  def render_bounded(self, template: jinja2.Template,
                     variables: dict[str, Any], budget: Budget) -> str:
    """Renders ``template`` chunk by chunk within ``budget``."""
    with using_budget(budget):
      try:
        return self._render(template, variables, budget)
      except RecursionError as e:
        raise budget.fail("it recursed too deeply") from e
      except MemoryError as e:
        raise budget.fail("it ran out of memory") from e

  def _render(self, template, variables, budget) -> str:
    out, total = [], 0
    for chunk in template.generate(**variables):
      total += len(chunk)
      if total > budget.limits.max_chars:
        raise budget.fail(
            f"its output passed {budget.limits.max_chars:,} characters")
      budget.tick()
      out.append(chunk)
    return "".join(out)

  # Sandbox hooks.

  def call_binop(self, context, operator, left, right):
    budget = current_budget()
    budget.tick()
    template_sizes.check_binop(budget, operator, left, right)
    return super().call_binop(context, operator, left, right)

  # Positional-only: a template may pass any keyword, "context" included.
  def call(self_, context_, obj_, /, *args, **kwargs):  # pylint: disable=no-self-argument
    budget = current_budget()
    budget.tick()
    # Jinja adds these for callables that take the context.
    user_kwargs = {k: v for k, v in kwargs.items()
                   if k not in ("_loop_vars", "_block_vars")}
    target = getattr(obj_, "__wrapped__", obj_)  # str.format's wrapper.
    owner = getattr(target, "__self__", None)
    name = getattr(target, "__name__", "")
    if isinstance(owner, (str, bytes)):
      what, values = f"the call {name}()", [*args, *user_kwargs.values()]
      if name in ("format", "format_map"):
        template_sizes.check_format(budget, owner, values, what)
      elif name in template_sizes.STR_METHOD_SIZES:
        budget.check_size(
            template_sizes.STR_METHOD_SIZES[name](owner, *values), what)
    result = super().call(context_, obj_, *args, **kwargs)
    return _checked_result(budget, result,
                           f"the result of {name or 'a call'}()")

  def loop_iterable(self, iterable: Any, chars: int) -> _LoopIterable:
    return _LoopIterable(iterable, chars)

  def checked_concat(self, parts: tuple) -> str:
    budget = current_budget()
    budget.tick()
    budget.check_size(sum(map(budget.text_size, parts)), "the operator '~'")
    return "".join(map(str, parts))

  def checked_value(self, value: Any) -> Any:
    """A list, tuple or dict literal's value, if not too large as a tree."""
    budget = current_budget()
    budget.tick()
    budget.check_value(value, "a literal")
    return value


def _finalize(value: Any) -> Any:
  """Charges every ``{{ value }}`` written (at top level or in a macro)."""
  budget = current_budget_or_none()
  if budget is not None:  # None while jinja folds constants.
    chars = budget.text_size(value)
    budget.check_size(chars, "the value output")
    budget.output(chars)
  return value


def _bounded_range(*args: int) -> range:
  """``range`` capped at jinja's ``MAX_RANGE`` with a clear error."""
  rng = range(*args)
  if len(rng) > jinja2.sandbox.MAX_RANGE:
    raise current_budget().fail(
        f"range() of {len(rng):,} numbers, more than the sandbox's"
        f" {jinja2.sandbox.MAX_RANGE:,}")
  return rng


def _guarded_filter(name: str, fn: Callable) -> Callable:
  """``fn`` with its result's size checked before (amplifying filters) and
  after it runs."""
  estimate = template_sizes.FILTER_SIZES.get(name)

  @functools.wraps(fn)  # Keeps jinja's pass_context/pass_environment mark.
  def guarded(*args, **kwargs):
    budget = current_budget()
    budget.tick()
    # Skip a context/environment jinja passes before the value.
    values = [a for a in args if not isinstance(
        a, (jinja2.runtime.Context, jinja2.Environment,
            jinja2.nodes.EvalContext))]
    what = f"the filter {name!r}"
    if values and name in _TEXT_FILTERS and not isinstance(values[0], str):
      budget.check_size(budget.text_size(values[0]), what + " (its input"
                        " as text)")
    if name == "format" and values:
      template_sizes.check_format(budget, values[0], values[1:] or kwargs,
                                  what)
    elif name == "join" and values:
      template_sizes.check_join(budget, values[0], values[1:], kwargs, what)
    elif estimate is not None and values:
      try:
        n = estimate(*values, *kwargs.values())
      except (TypeError, AttributeError, ValueError):
        n = 0  # Bad arguments: the filter itself reports them.
      budget.check_size(n, what)
    result = fn(*args, **kwargs)
    return _checked_result(budget, result,
                           f"the result of the filter {name!r}")

  return guarded
