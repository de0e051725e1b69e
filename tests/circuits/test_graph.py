"""Graph: node bookkeeping, a safetensors round trip, and files or tables
that do not fit are clear errors."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from safetensors.numpy import save_file

from penzai_lm import circuits


def _graph(n_features=3, n_pos=2, layers=2, n_logits=2):
  sources = n_features + layers * n_pos + n_pos
  rng = np.random.default_rng(0)
  return circuits.Graph(
      input_tokens=np.array([3, 8][:n_pos]),
      active_features=np.array([[0, 0, 1], [0, 1, 4], [1, 1, 2],
                                [1, 1, 5]]),
      activation_values=np.array([.5, 1.5, 2.5, 3.5], np.float32),
      selected_features=np.array([0, 2, 3][:n_features]),
      logit_tokens=np.array([7, 1]), logit_probabilities=np.array([.6, .3]),
      edges=rng.standard_normal((n_features + n_logits, sources)).astype(
          np.float32),
      num_layers=layers, vocab_size=10)


def test_node_order():
  g = _graph()
  assert (g.n_features, g.n_errors, g.n_pos, g.n_logits) == (3, 4, 2, 2)
  assert (g.error_start, g.token_start, g.logit_start, g.n_nodes) == (
      3, 7, 9, 11)
  assert g.error_node(1, 0) == 5
  np.testing.assert_array_equal(g.feature_nodes[1], [1, 1, 2])
  with pytest.raises(ValueError, match="no error node"):
    g.error_node(2, 0)


def test_round_trip(tmp_path):
  g = _graph()
  path = g.save(tmp_path / "g.safetensors")
  back = circuits.Graph.load(path)
  for name in ("input_tokens", "active_features", "activation_values",
               "selected_features", "logit_tokens", "logit_probabilities",
               "edges"):
    a, b = getattr(g, name), getattr(back, name)
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  assert (back.num_layers, back.vocab_size) == (2, 10)


def test_tables_that_disagree_are_errors():
  with pytest.raises(ValueError, match="edges has shape"):
    circuits.Graph(**{**_fields(_graph()),
                      "selected_features": np.array([0, 1])})
  with pytest.raises(ValueError, match="selected_features must be sorted"):
    circuits.Graph(**{**_fields(_graph()),
                      "selected_features": np.array([0, 3, 2])})
  with pytest.raises(ValueError, match="activation_values"):
    circuits.Graph(**{**_fields(_graph()),
                      "activation_values": np.ones(3, np.float32)})


def _fields(g):
  return {name: getattr(g, name) for name in (
      "input_tokens", "active_features", "activation_values",
      "selected_features", "logit_tokens", "logit_probabilities",
      "edges", "num_layers", "vocab_size")}


def test_bad_files_are_clear_errors(tmp_path):
  path = _graph().save(tmp_path / "g.safetensors")
  arrays = load_file(str(path))
  meta = {"format": "penzai_lm.circuits.Graph", "version": 2,
          "num_layers": 2, "vocab_size": 10}
  cases = [
      ({}, "has no 'penzai_lm.circuits' metadata"),
      ({"penzai_lm.circuits": "{"}, "is not JSON"),
      ({"penzai_lm.circuits": json.dumps({**meta, "version": 9})},
       "version 9"),
      ({"penzai_lm.circuits": json.dumps({**meta, "num_layers": "2"})},
       "'num_layers' must be a positive int"),
  ]
  for metadata, match in cases:
    save_file(arrays, str(path), metadata=metadata)
    with pytest.raises(ValueError, match=match):
      circuits.Graph.load(path)
  good = {"penzai_lm.circuits": json.dumps(meta)}
  save_file({k: v for k, v in arrays.items() if k != "logit_tokens"},
            str(path), metadata=good)
  with pytest.raises(ValueError, match=r"lacks the arrays \['logit_tokens'\]"):
    circuits.Graph.load(path)
  save_file({**arrays, "edges": arrays["edges"].astype(np.float64)},
            str(path), metadata=good)
  with pytest.raises(ValueError, match="edges must be float32"):
    circuits.Graph.load(path)
  path.write_bytes(b"not a safetensors file")
  with pytest.raises(ValueError, match="not a readable safetensors"):
    circuits.Graph.load(path)
  with pytest.raises(FileNotFoundError):
    circuits.Graph.load(tmp_path / "missing.safetensors")


def test_edges_are_the_square_matrix_without_its_zero_rows_and_columns():
  g = _graph()
  square = g.adjacency_matrix
  assert square.shape == (g.n_nodes, g.n_nodes)
  assert not square[g.error_start:g.logit_start].any()
  assert not square[:, g.logit_start:].any()
  np.testing.assert_array_equal(square[g.target_nodes()][:, :g.n_sources],
                                g.edges)
  back = circuits.Graph.from_adjacency(adjacency_matrix=square, **{
      k: v for k, v in _fields(g).items() if k != "edges"})
  np.testing.assert_array_equal(back.edges, g.edges)
  square[g.error_start, 0] = 1.0  # An edge into an error node.
  with pytest.raises(ValueError, match="edges into error or token nodes"):
    circuits.Graph.from_adjacency(adjacency_matrix=square, **{
        k: v for k, v in _fields(g).items() if k != "edges"})


def test_version_1_files_with_the_square_matrix_still_load(tmp_path):
  g = _graph()
  path = g.save(tmp_path / "g.safetensors")
  arrays = load_file(str(path))
  del arrays["edges"]
  arrays["adjacency_matrix"] = g.adjacency_matrix
  meta = {"format": "penzai_lm.circuits.Graph", "version": 1,
          "num_layers": 2, "vocab_size": 10}
  save_file(arrays, str(path),
            metadata={"penzai_lm.circuits": json.dumps(meta)})
  back = circuits.Graph.load(path)
  np.testing.assert_array_equal(back.edges, g.edges)
