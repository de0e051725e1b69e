"""A Jinja2 sandbox that also bounds the time and memory a template takes.

Chat templates come with checkpoints, so they are untrusted code. Jinja's
`ImmutableSandboxedEnvironment` stops them from reaching Python internals
but not from working forever or building huge strings: ``{{ 'x' * 10**10
}}``, nested loops of 10**5 iterations each, or a string doubled in a loop
would run until ``MemoryError`` or the kernel kills the process.

`BoundedSandbox` charges every step a template takes to a per-render
`Budget` (`Limits`), and refuses with `TemplateLimitError` (a
``ValueError``) naming the template's source and the limit:

* time: a wall-clock deadline checked at every step below;
* loop iterations: every ``for`` loop's iterable is wrapped (by the code
  generator) in a counter, which also charges the loop body's literal text
  to the output budget;
* output: every ``{{ ... }}`` value (in macros and ``set`` blocks too) and
  every streamed chunk is counted;
* single values: ``*``, ``+``, ``**`` and ``%`` are intercepted and refused
  *before* they would build a value over the size limit (or an integer over
  ``max_int_bits``), ``~`` (concatenation) likewise; calls and filters that
  can amplify their input (``str.replace``, ``join``, ``center``,
  ``indent``, ``format``, ...) are estimated before they run, and every
  call's and filter's result is checked after;
* ``range()`` above jinja's ``MAX_RANGE`` is refused with the same error.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import time
from typing import Any, Callable

import jinja2
import jinja2.compiler
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox

from penzai_lm.tokenizer import template_sizes

__all__ = ["BoundedSandbox", "Budget", "Limits", "TemplateLimitError",
           "using_budget"]


class TemplateLimitError(ValueError):
  """A template went over a rendering limit (time, iterations, size)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Bounds on one rendering.

  Attributes:
    max_chars: Most characters of the output, of all values output along
      the way (macros, ``set`` blocks; 4x this), and of any single value.
    max_iterations: Most loop iterations in all.
    timeout_s: Wall-clock seconds.
    max_int_bits: Largest integer an operator may build.
  """

  max_chars: int = 1 << 20
  max_iterations: int = 1_000_000
  timeout_s: float = 5.0
  max_int_bits: int = 1 << 16


class Budget:
  """What one rendering has spent; raises once a limit is passed."""

  def __init__(self, limits: Limits, source: str = "a chat template"):
    self.limits = limits
    self.source = source
    self.start = time.monotonic()
    self.deadline = self.start + limits.timeout_s
    self.iterations = 0
    self.output_chars = 0

  def fail(self, what: str) -> TemplateLimitError:
    return TemplateLimitError(
        f"Rendering {self.source} went over a limit: {what}. It was stopped"
        f" after {time.monotonic() - self.start:.2f} s; a chat template"
        " renders a prompt in milliseconds, so this one is broken or"
        " hostile.")

  def tick(self) -> None:
    if time.monotonic() > self.deadline:
      raise self.fail(f"it ran longer than {self.limits.timeout_s:g} s")

  def iteration(self, chars: int) -> None:
    self.iterations += 1
    if self.iterations > self.limits.max_iterations:
      raise self.fail(
          f"more than {self.limits.max_iterations:,} loop iterations")
    self.output(chars)

  def output(self, chars: int) -> None:
    """Charges output written anywhere (macros and blocks included)."""
    self.tick()
    self.output_chars += chars
    if self.output_chars > 4 * self.limits.max_chars:
      raise self.fail(
          f"more than {4 * self.limits.max_chars:,} characters output"
          " (macros and blocks included)")

  def check_size(self, n: int, what: str) -> None:
    if n > self.limits.max_chars:
      raise self.fail(f"{what} would build a value of {n:,} characters (or"
                      f" items), more than the limit of"
                      f" {self.limits.max_chars:,}")

  def check_int(self, bits: int, what: str) -> None:
    if bits > self.limits.max_int_bits:
      raise self.fail(f"{what} would build an integer of about {bits:,}"
                      f" bits, more than {self.limits.max_int_bits:,}")


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar(
    "penzai_lm_template_budget", default=None)


@contextlib.contextmanager
def using_budget(budget: Budget):
  """Charges what templates do in this block (compiling and rendering, in
  this thread or task) to ``budget``."""
  token = _BUDGET.set(budget)
  try:
    yield budget
  finally:
    _BUDGET.reset(token)


def current_budget() -> Budget:
  """The rendering's budget (a default one outside `BoundedSandbox.render`,
  e.g. while jinja folds constants at compile time)."""
  budget = _BUDGET.get()
  return budget if budget is not None else Budget(Limits())


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


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
  """Jinja's code generator, with every loop counted and every ``~``
  checked (neither has a sandbox hook of its own)."""

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


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """An immutable sandbox whose templates render within `Limits`; see the
  module docstring. Render with `render_bounded` (which sets the budget)."""

  code_generator_class = _BoundedCodeGenerator
  intercepted_binops = frozenset({"*", "+", "**", "%"})

  def __init__(self, *, filters: dict[str, Callable] | None = None,
               globals_: dict[str, Any] | None = None, **options: Any):
    super().__init__(finalize=_finalize, **options)
    self.filters.update(filters or {})
    self.filters = {name: _guarded_filter(name, f)
                    for name, f in self.filters.items()}
    self.globals.update(globals_ or {})
    self.globals["range"] = _bounded_range
    # Its output (n paragraphs of up to `max` words) is not a template's
    # business, and chat templates never use it.
    self.globals.pop("lipsum", None)

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
    budget.check_size(template_sizes.size(result),
                      f"the result of {name or 'a call'}()")
    return result

  def loop_iterable(self, iterable: Any, chars: int) -> _LoopIterable:
    return _LoopIterable(iterable, chars)

  def checked_concat(self, parts: tuple) -> str:
    budget = current_budget()
    budget.tick()
    strings = [str(p) for p in parts]
    budget.check_size(sum(map(len, strings)), "the operator '~'")
    return "".join(strings)


def _finalize(value: Any) -> Any:
  """Charges every ``{{ value }}`` written (at top level or in a macro)."""
  budget = _BUDGET.get()
  if budget is not None:  # None while jinja folds constants.
    budget.output(template_sizes.size(value)
                  if template_sizes.is_sized(value) else 16)
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
    if name == "format" and values:
      template_sizes.check_format(budget, values[0], values[1:] or kwargs,
                                  what)
    elif estimate is not None and values:
      try:
        n = estimate(*values, *kwargs.values())
      except (TypeError, AttributeError, ValueError):
        n = 0  # Bad arguments: the filter itself reports them.
      budget.check_size(n, what)
    result = fn(*args, **kwargs)
    budget.check_size(template_sizes.size(result),
                      f"the result of the filter {name!r}")
    return result

  return guarded
