"""The floors: each package imports only from the packages below it.

The contract is `[tool.importlinter]` in pyproject.toml (a layers contract
over the packages and a no-cycles contract over every module); these tests
run `lint-imports` on it, as CI does with the rest of the suite.
"""

import ast
import pathlib
import shutil
import subprocess
import sys

import penzai_lm

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = pathlib.Path(penzai_lm.__file__).parent


def _lint_imports(cwd: pathlib.Path, pythonpath: pathlib.Path):
  tool = pathlib.Path(sys.executable).parent / "lint-imports"
  assert tool.exists(), (
      f"{tool} is missing: install the test extra (pip install -e"
      " '.[test]'), which brings import-linter.")
  return subprocess.run(
      [str(tool), "--no-cache"], cwd=cwd, capture_output=True, text=True,
      env={"PYTHONPATH": str(pythonpath), "PATH": "/usr/bin:/bin"},
      timeout=120, check=False)


def test_the_import_contract_holds():
  out = _lint_imports(ROOT, PACKAGE.parent)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "2 kept, 0 broken" in out.stdout, out.stdout


def test_an_upward_import_in_a_function_breaks_it(tmp_path):
  """The contract sees function-local imports too: the model package may
  not reach the generation engine even to dodge a cycle."""
  shutil.copytree(PACKAGE, tmp_path / "penzai_lm",
                  ignore=shutil.ignore_patterns("__pycache__", "*.so"))
  shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
  with open(tmp_path / "penzai_lm" / "model" / "dispatch.py", "a") as f:
    f.write("\n\ndef _upward():\n"
            "  from penzai_lm.generation import engine  # noqa\n")
  out = _lint_imports(tmp_path, tmp_path)
  assert out.returncode != 0, out.stdout
  assert ("penzai_lm.model is not allowed to import penzai_lm.generation"
          in out.stdout), out.stdout
  assert "penzai_lm.model.dispatch -> penzai_lm.generation.engine" in (
      out.stdout)


def _module_level_mutables(path: pathlib.Path) -> list[str]:
  """Module-level names bound to a mutable container or a call result."""
  found = []
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
        node.value, (ast.Dict, ast.List, ast.Set, ast.Call)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      found += [f"{path.parent.name}/{path.name}:{t.id}" for t in targets
                if isinstance(t, ast.Name) and t.id != "__all__"]
  return found


def test_no_module_level_state_but_the_defaults():
  """The runtime and generation floors keep no module-level state but the
  default runtime and the default engine over it."""
  found = [name for package in ("runtime", "generation")
           for path in sorted((PACKAGE / package).glob("*.py"))
           for name in _module_level_mutables(path)]
  assert found == ["runtime/runtime.py:_DEFAULT_RUNTIME",
                   "generation/engine.py:_DEFAULT_ENGINE"]
