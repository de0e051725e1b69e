"""Sphinx configuration of the penzai_lm documentation site.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``
(tests/test_docs.py runs the same command, warnings as errors).

Pages are Markdown (MyST); the API reference is autodoc of each package's
public names, one page per package under ``docs/api/`` (a new package needs
one short page there and a line in ``docs/api/index.md``;
tests/test_docs.py says when one is missing). Docstrings are Google style
(napoleon). A single-backquoted name in a docstring (`generate`) is a
cross-reference, resolved where it can be and plain code where not
(nitpicky mode is off, so an unresolved one is no warning).
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # The docs of this checkout, installed or not.
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

project = "penzai_lm"
author = "penzai_lm authors"
copyright = "penzai_lm authors"  # pylint: disable=redefined-builtin

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "reexports",  # docs/_ext/reexports.py
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_ext"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# `name` in a docstring: a cross-reference to a Python object.
default_role = "py:obj"

autodoc_default_options = {
    "members": True,
    "imported-members": True,  # Packages re-export from their modules.
    "show-inheritance": True,
    "member-order": "bysource",
}
# Signatures keep their annotations; the descriptions stay the docstrings'.
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Attributes sections as fields of their class: autodoc documents the
# properties and dataclass fields themselves (two entries otherwise).
napoleon_use_ivar = True

html_theme = "furo"
html_title = "penzai_lm"


def _skip_foreign(app, what, name, obj, skip, options):
  """Leaves out names a package imports from elsewhere (``typing.Any``,
  numpy, penzai): the reference lists penzai_lm's own objects only."""
  del app, name, options
  if what == "module":
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and not module.startswith("penzai_lm"):
      return True
  return skip


def setup(app):
  app.connect("autodoc-skip-member", _skip_foreign)
