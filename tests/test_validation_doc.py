"""docs/validation.md stays true: every test it names exists."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _named_tests():
  text = (ROOT / "docs" / "validation.md").read_text()
  return sorted(set(re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text)))


def test_every_test_the_validation_table_names_exists():
  named = _named_tests()
  assert len(named) >= 20
  for path, function in named:
    file = ROOT / path
    assert file.is_file(), f"docs/validation.md names {path}, which is gone"
    if function:
      tree = ast.parse(file.read_text())
      functions = {n.name for n in ast.walk(tree)
                   if isinstance(n, ast.FunctionDef)}
      assert function in functions, (
          f"docs/validation.md names {path}::{function}, which is gone")
