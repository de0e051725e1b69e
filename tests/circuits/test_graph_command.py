"""``penzai-lm graph``: the files it writes from a saved graph are the
library's (`graph_json`, circuit-tracer's folder, the HTML page), through
``main`` and through the installed command; bad requests exit with 2 and
a message saying what to change."""

import json
import subprocess
import sys

import pytest

from penzai_lm import cli
from penzai_lm.circuits import Graph
from penzai_lm.circuits import graph_page
from penzai_lm.circuits import neuronpedia
from penzai_lm.tokenizer import Tokenizer
from tests.circuits import small_graphs


@pytest.fixture(name="saved", scope="module")
def _saved(tmp_path_factory):
  folder = tmp_path_factory.mktemp("graph")
  path = small_graphs.graph().save(folder / "my-prompt.safetensors")
  return path, small_graphs.write_tokenizer_dir(folder)


def test_outputs_are_the_librarys(saved, tmp_path):
  path, tok_dir = saved
  out = tmp_path / "out"
  code = cli.main(["graph", str(path), "--json", str(tmp_path / "g.json"),
                   "--html", str(tmp_path / "g.html"), "--folder", str(out),
                   "--tokenizer", str(tok_dir), "--scan", "test-scan",
                   "--node-threshold", "0.7", "--edge-threshold", "0.9"])
  assert code == 0
  graph, tok = Graph.load(path), Tokenizer.from_hf(tok_dir)
  options = dict(tokenizer=tok, node_threshold=0.7, edge_threshold=0.9)
  expected = neuronpedia.graph_json(graph, slug="my-prompt", scan="test-scan",
                                    **options)
  text = (tmp_path / "g.json").read_bytes()
  assert json.loads(text) == expected
  assert (out / "my-prompt.json").read_bytes() == text
  index = json.loads((out / "graph-metadata.json").read_text())
  assert index == {"graphs": [expected["metadata"]]}
  page = (tmp_path / "g.html").read_text()
  assert page == graph_page.export_html(neuronpedia.export_graph(
      graph, slug="my-prompt", scan="test-scan", **options))
  assert page.startswith("<!DOCTYPE html>") and "test-scan" in page


def test_the_installed_command(saved, tmp_path):
  """``python -m penzai_lm.cli`` (the console script's ``main``), with a
  GGUF tokenizer and distinct error ids."""
  path, tok_dir = saved
  gguf = tok_dir.parent / "t.gguf"
  done = subprocess.run(
      [sys.executable, "-m", "penzai_lm.cli", "graph", str(path), "--json",
       str(tmp_path / "g.json"), "--tokenizer", str(gguf), "--slug", "other",
       "--distinct-error-ids", "--prompt", "typed"],
      capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr
  data = json.loads((tmp_path / "g.json").read_text())
  assert data == neuronpedia.graph_json(
      Graph.load(path), slug="other", tokenizer=Tokenizer.from_gguf(gguf),
      distinct_error_ids=True, prompt="typed")
  assert f"[wrote {tmp_path / 'g.json'}: {len(data['nodes'])} nodes," in (
      done.stderr)


@pytest.mark.parametrize("args, message", [
    ([], "nothing to write"),
    (["--html", "x.html", "--node-threshold", "2"], "node_threshold"),
    (["--html", "x.html", "--slug", "a b"], "Give one with --slug"),
    (["--html", "x.html", "--tokenizer", "missing.gguf"], "--tokenizer"),
    (["--html", "x.html", "--scan", ""], None),  # An empty scan is fine.
])
def test_bad_requests_exit_2(saved, tmp_path, monkeypatch, capsys, args,
                             message):
  monkeypatch.chdir(tmp_path)
  code = cli.main(["graph", str(saved[0]), *args])
  err = capsys.readouterr().err
  if message is None:
    assert code == 0 and (tmp_path / "x.html").is_file()
  else:
    assert code == 2 and message in err and err.startswith("error: ")
    assert not (tmp_path / "x.html").exists()


def test_files_that_are_not_graphs_exit_2(tmp_path, capsys):
  assert cli.main(["graph", str(tmp_path / "none.safetensors"), "--html",
                   str(tmp_path / "x.html")]) == 2
  assert "does not exist" in capsys.readouterr().err
  bad = tmp_path / "bad.safetensors"
  bad.write_bytes(b"not a safetensors file")
  assert cli.main(["graph", str(bad), "--html", str(tmp_path / "x.html")]
                  ) == 2
  assert "not a readable safetensors file" in capsys.readouterr().err
