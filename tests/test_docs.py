"""The documentation site builds without a warning and covers every package.

The site (docs/, Sphinx: autodoc + napoleon for the docstrings, MyST for
the Markdown pages) is built as CI would publish it, warnings as errors: a
docstring that docutils cannot parse, a page missing from a table of
contents or an include marker gone from README.md fails here.
"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _packages() -> list[str]:
  return sorted(p.parent.name for p in (ROOT / "penzai_lm").glob("*/__init__.py"))


def test_sphinx_build_has_no_warnings(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
       "html", str(DOCS), str(tmp_path / "html")],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, (
      f"sphinx-build failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
  page = (tmp_path / "html" / "api" / "interp.html").read_text()
  # Autodoc ran (a class and a function of the package are described) and
  # the top-level page links each shortcut to its package's entry.
  assert 'id="penzai_lm.interp.AddVector"' in page
  assert 'id="penzai_lm.interp.run_with_cache"' in page
  top = (tmp_path / "html" / "api" / "penzai_lm.html").read_text()
  assert 'href="generation.html#penzai_lm.generation.generate"' in top
  # The getting-started page shows the README's code.
  started = re.sub(r"<[^>]+>", "", (
      tmp_path / "html" / "getting-started.html").read_text())
  assert "pip install -e . &amp;&amp; penzai-lm generate" in started
  assert "interp.run_with_cache(model, ids," in started


def test_every_package_has_an_api_page():
  index = (DOCS / "api" / "index.md").read_text()
  for package in _packages():
    page = DOCS / "api" / f"{package}.rst"
    assert page.is_file(), (
        f"penzai_lm.{package} has no page: add docs/api/{package}.rst (a"
        " title and `.. automodule:: penzai_lm.{package}`, as the others)"
        " and list it in docs/api/index.md")
    assert f".. automodule:: penzai_lm.{package}" in page.read_text()
    assert re.search(rf"^{package}$", index, re.M), (
        f"docs/api/index.md does not list {package}")


def test_reexported_names_all_have_a_package_page():
  sys.path.insert(0, str(DOCS / "_ext"))
  try:
    import reexports  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(DOCS / "_ext"))
  names = reexports.documented_names("penzai_lm")
  assert "penzai_lm.loading.load" in names
  assert "penzai_lm.generation.generate_text" in names
  for name in names:
    package = name.split(".")[1]
    assert (DOCS / "api" / f"{package}.rst").is_file(), name


def test_pages_speak_of_the_repository_only():
  """No page points outside the repository (a relative path climbing out
  of it, or a machine's own folders) or speaks of the project's internal
  notes and issues (docs/gpu.md did: "The issue's targets")."""
  for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
    text = page.read_text()
    for match in re.finditer(r"\.\./[\w./-]+", text):
      target = (page.parent / match.group(0)).resolve()
      assert target.is_relative_to(ROOT) and target.exists(), (
          f"{page.relative_to(ROOT)} points to {match.group(0)}, outside"
          " the repository or missing")
    for match in re.finditer(
        r"(?<![\w.])(/(?:work|tmp|home|root|Users|mnt)/[\w./-]*"
        r"|shared/(?:notes|seeds)\b|[Tt]he issue's)", text):
      raise AssertionError(f"{page.relative_to(ROOT)} speaks of"
                           f" {match.group(0)!r}: a machine's folders or"
                           " the project's internal notes")


def test_the_kernel_build_figures_agree():
  """The measured cold-build times read the same in the kernels' module
  and in docs/quantization.md (they had disagreed with each other)."""
  figures = (r"took\s+([\d.]+-[\d.]+ s)\s+of\s+CPU\s+time\s+each,\s+"
             r"(?:and\s+)?([\d.]+-[\d.]+ s)\s+of\s+wall\s+time")
  found = [re.findall(figures, path.read_text()) for path in (
      ROOT / "penzai_lm" / "kernels" / "build.py", DOCS / "quantization.md")]
  assert len(found[0]) == 1 and found[0] == found[1], found
