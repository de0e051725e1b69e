"""``.. reexports:: penzai_lm``: a table of a module's re-exported names.

Each name links to its entry on the page of the package that defines it
(``penzai_lm.load`` -> ``penzai_lm.loading.load``), with its summary line,
so the top-level page lists every shortcut without documenting an object
twice (Sphinx warns about two descriptions of one class). The list follows
the module, so a new top-level name appears by itself.
"""

import importlib
import inspect

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def documented_names(module_name: str) -> list[str]:
  """Package-qualified names of ``module_name``'s public non-module names.

  A name defined in ``penzai_lm.generation.chat`` is documented on the page
  of ``penzai_lm.generation``, which re-exports it.

  Raises:
    ValueError: for a name no package re-exports (it would have no entry
      to link to).
  """
  module = importlib.import_module(module_name)
  names = getattr(module, "__all__", None) or [
      n for n in dir(module) if not n.startswith("_")]
  out = []
  for name in names:
    obj = getattr(module, name)
    if inspect.ismodule(obj) or not hasattr(obj, "__module__"):
      continue
    package = ".".join(obj.__module__.split(".")[:2])
    if getattr(importlib.import_module(package), name, None) is not obj:
      raise ValueError(
          f"{module_name}.{name} comes from {obj.__module__}, but"
          f" {package} does not export it under that name; export it there"
          " so that its package page documents it")
    out.append(f"{package}.{name}")
  return out


class ReexportsDirective(SphinxDirective):
  required_arguments = 1

  def run(self) -> list[nodes.Node]:
    lines = [".. autosummary::", ""]
    # Relative to the page's module (autosummary refuses its full name).
    prefix = self.arguments[0] + "."
    lines += [f"   ~{name.removeprefix(prefix)}"
              for name in documented_names(self.arguments[0])]
    container = nodes.container()
    self.state.nested_parse(StringList(lines, source="reexports"),
                            self.content_offset, container)
    return container.children


def setup(app):
  app.setup_extension("sphinx.ext.autosummary")
  app.add_directive("reexports", ReexportsDirective)
  return {"parallel_read_safe": True}
