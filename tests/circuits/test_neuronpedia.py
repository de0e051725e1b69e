"""Neuronpedia graph JSON: the files circuit-tracer 0.5's own
``create_graph_files`` writes for the same graph (run on it, converted to
its ``Graph``, with a transformers tokenizer read offline from a local
directory), its pydantic schema, and clear errors for bad input."""

import dataclasses
import json

import numpy as np
import pytest

from penzai_lm import circuits
from penzai_lm.circuits import neuronpedia
from penzai_lm.tokenizer import Tokenizer
from tests.circuits import small_graphs

SCAN = "test-scan"


def _circuit_tracer():
  try:
    # pylint: disable=g-import-not-at-top
    import torch
    from circuit_tracer import graph as ct_graph
    from circuit_tracer.attribution.targets import LogitTarget
    from circuit_tracer.frontend import graph_models
    from circuit_tracer.utils.create_graph_files import create_graph_files
    from circuit_tracer.utils.tl_nnsight_mapping import UnifiedConfig
    import transformers
  except ImportError as e:
    pytest.skip(f"circuit-tracer 0.5 is not importable ({e}); the parity"
                " tests need it (tests/sae/conftest.py installs it).")
  return dict(torch=torch, Graph=ct_graph.Graph, LogitTarget=LogitTarget,
              models=graph_models, create=create_graph_files,
              UnifiedConfig=UnifiedConfig,
              AutoTokenizer=transformers.AutoTokenizer)


@pytest.fixture(name="tok_dir", scope="module")
def _tok_dir(tmp_path_factory):
  return small_graphs.write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(name="tok", scope="module")
def _tok(tok_dir):
  return Tokenizer.from_hf(tok_dir)


def _as_circuit_tracer(ct, g, tok_dir):
  """Our graph as circuit-tracer's, its tokenizer named by a local
  directory (``create_graph_files`` loads it with AutoTokenizer)."""
  torch = ct["torch"]
  hf = ct["AutoTokenizer"].from_pretrained(str(tok_dir))
  cfg = ct["UnifiedConfig"](
      n_layers=g.num_layers, d_model=32, d_head=12, n_heads=4, d_mlp=48,
      d_vocab=g.vocab_size, tokenizer_name=str(tok_dir), model_name="random",
      original_architecture="LlamaForCausalLM")
  return ct["Graph"](
      input_string=small_graphs.PROMPT,
      input_tokens=torch.tensor(g.input_tokens),
      active_features=torch.tensor(g.active_features),
      adjacency_matrix=torch.tensor(g.adjacency_matrix), cfg=cfg,
      selected_features=torch.tensor(g.selected_features),
      activation_values=torch.tensor(g.activation_values),
      logit_targets=[ct["LogitTarget"](token_str=hf.decode(int(i)),
                                       vocab_idx=int(i))
                     for i in g.logit_tokens],
      logit_probabilities=torch.tensor(g.logit_probabilities), scan=SCAN,
      vocab_size=g.vocab_size)


def _without_influence(text: str) -> list[str]:
  return [line for line in text.splitlines() if '"influence"' not in line]


def test_files_are_circuit_tracers(tmp_path, tok_dir, tok):
  ct = _circuit_tracer()
  g = small_graphs.graph()
  theirs, ours = tmp_path / "theirs", tmp_path / "ours"
  for slug, thresholds in (("a", (0.8, 0.98)), ("b", (0.5, 0.7)),
                           ("a", (0.6, 0.9))):  # "a" again: replaced.
    ct["create"](_as_circuit_tracer(ct, g, tok_dir), slug, str(theirs),
                 node_threshold=thresholds[0], edge_threshold=thresholds[1])
    neuronpedia.save_graph_files(
        g, ours, slug=slug, tokenizer=tok, scan=SCAN,
        prompt=small_graphs.PROMPT, node_threshold=thresholds[0],
        edge_threshold=thresholds[1])
    text_theirs = (theirs / f"{slug}.json").read_text()
    text_ours = (ours / f"{slug}.json").read_text()
    # The same bytes except the influences (float32 sums in another order).
    assert _without_influence(text_ours) == _without_influence(text_theirs)
    a, b = json.loads(text_theirs), json.loads(text_ours)
    assert b["metadata"] == a["metadata"] and b["qParams"] == a["qParams"]
    assert [n["node_id"] for n in b["nodes"]] == [
        n["node_id"] for n in a["nodes"]]
    for n, m in zip(a["nodes"], b["nodes"]):
      assert {**n, "influence": 0} == {**m, "influence": 0}
      if n["influence"] is None:
        assert m["influence"] is None
      else:
        assert m["influence"] == pytest.approx(n["influence"], rel=1e-5)
    assert [(l["source"], l["target"]) for l in b["links"]] == [
        (l["source"], l["target"]) for l in a["links"]]
    np.testing.assert_allclose([l["weight"] for l in b["links"]],
                               [l["weight"] for l in a["links"]], atol=1e-6)
    types = {n["feature_type"] for n in b["nodes"]}
    assert types == {"cross layer transcoder", "mlp reconstruction error",
                     "embedding", "logit"}
    features = sum(n["feature_type"] == "cross layer transcoder"
                   for n in b["nodes"])
    assert 0 < features < g.n_features and len(b["links"]) > features
  assert ((ours / "graph-metadata.json").read_bytes()
          == (theirs / "graph-metadata.json").read_bytes())


def test_edge_masks_of_either_shape_give_the_same_links():
  g = small_graphs.graph()
  pruned = circuits.prune_graph(g)
  rows = g.target_nodes()
  if pruned.edge_mask.shape == (g.n_nodes, g.n_nodes):
    other = pruned.edge_mask[rows][:, :g.n_sources]
  else:
    other = np.zeros((g.n_nodes, g.n_nodes), bool)
    other[rows, :g.n_sources] = pruned.edge_mask
  one = neuronpedia.kept_edges(g, pruned)
  two = neuronpedia.kept_edges(g, pruned._replace(edge_mask=other))
  for x, y in zip(one, two):
    np.testing.assert_array_equal(x, y)
  dense = g.adjacency_matrix
  np.testing.assert_array_equal(one[2], dense[one[0], one[1]])
  assert np.all(one[2] != 0) and len(one[2]) > 10


def test_schema_without_a_tokenizer():
  ct = _circuit_tracer()
  g = small_graphs.graph()
  data = neuronpedia.graph_json(g, slug="no-tokenizer")
  ct["models"].Model.model_validate(data)  # circuit-tracer's schema.
  fields = list(ct["models"].Node.model_fields)
  assert all(list(n) == fields for n in data["nodes"])
  ids = g.input_tokens.tolist()
  assert data["metadata"]["prompt_tokens"] == [str(i) for i in ids]
  assert data["metadata"]["prompt"] == " ".join(map(str, ids))
  assert data["metadata"]["scan"] == ""
  logits = [n for n in data["nodes"] if n["feature_type"] == "logit"]
  assert [n["feature"] for n in logits] == g.logit_tokens.tolist()
  top = g.logit_tokens[0]
  assert logits[0]["clerp"] == (
      f'Output "{top}" (p={g.logit_probabilities[0]:.3f})')
  assert [n["is_target_logit"] for n in logits] == [True] + [False] * (
      len(logits) - 1)
  tokens = [n for n in data["nodes"] if n["feature_type"] == "embedding"]
  assert [n["node_id"] for n in tokens] == [
      f"E_{t}_{p}" for p, t in enumerate(ids)]
  assert {l["source"] for l in data["links"]} | {
      l["target"] for l in data["links"]} <= {n["node_id"] for n in
                                               data["nodes"]}


def test_distinct_error_ids():
  """0.5's error ids equal those of some layer-0 features (circuit-tracer
  issue 78); ``distinct_error_ids`` gives its later ids, all distinct."""
  g = small_graphs.graph()
  same = neuronpedia.graph_json(g, slug="s")
  fixed = neuronpedia.graph_json(g, slug="s", distinct_error_ids=True)
  ids = [n["node_id"] for n in same["nodes"]]
  twins = {i for i in ids if ids.count(i) > 1}
  assert twins  # This graph has such pairs, e.g. "0_1_3".
  for node in same["nodes"]:
    if node["node_id"] in twins:
      layer, f, pos = map(int, node["node_id"].split("_"))
      assert layer == 0 and f < g.num_layers and pos == node["ctx_idx"]
  new_ids = [n["node_id"] for n in fixed["nodes"]]
  assert len(set(new_ids)) == len(new_ids)
  for a, b in zip(same["nodes"], fixed["nodes"]):
    if a["feature_type"] == "mlp reconstruction error":
      assert b["node_id"] == f"{a['layer']}_-1_{a['ctx_idx']}"
    else:
      assert a == b
  assert len(fixed["links"]) == len(same["links"])


def test_scan_lists_and_single_files(tmp_path):
  g = small_graphs.graph()
  data = neuronpedia.graph_json(g, slug="s", scan=["tc-0", "tc-1"])
  assert data["metadata"]["transcoder_list"] == ["tc-0", "tc-1"]
  scan = data["metadata"]["scan"]
  assert scan.startswith("custom-")
  assert neuronpedia.graph_json(g, slug="s", scan=("tc-0", "tc-1"))[
      "metadata"]["scan"] == scan  # Stable, unlike Python's hash().
  path = neuronpedia.save_graph_json(g, tmp_path / "g.json", slug="s",
                                     scan="x")
  assert json.loads(path.read_text()) == neuronpedia.graph_json(
      g, slug="s", scan="x")
  assert [p.name for p in tmp_path.iterdir()] == ["g.json"]  # No temp left.


@pytest.mark.parametrize("kwargs, message", [
    (dict(slug="../up"), "slug must be"),
    (dict(slug=""), "slug must be"),
    (dict(slug=7), "slug must be"),
    (dict(slug="s", scan=3), "scan must be"),
    (dict(slug="s", scan=[]), "scan must be"),
    (dict(slug="s", scan=["a", 2]), "scan must be"),
    (dict(slug="s", node_threshold=1.5), "node_threshold"),
    (dict(slug="s", edge_threshold=-0.1), "edge_threshold"),
    (dict(slug="s", prompt=b"bytes"), "prompt must be"),
])
def test_bad_arguments_are_clear_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    neuronpedia.graph_json(small_graphs.graph(), **kwargs)


def test_non_finite_weights_are_refused():
  g = small_graphs.graph()
  edges = g.edges.copy()
  edges[0, np.flatnonzero(edges[0])[0]] = np.nan
  with pytest.raises(ValueError, match="non-finite"):
    neuronpedia.graph_json(dataclasses.replace(g, edges=edges), slug="s")


def test_bad_folders_are_clear_errors(tmp_path):
  g = small_graphs.graph()
  file = tmp_path / "file"
  file.write_text("x")
  with pytest.raises(ValueError, match="not a folder"):
    neuronpedia.save_graph_files(g, file, slug="s")
  (tmp_path / "graph-metadata.json").write_text("{not json")
  with pytest.raises(ValueError, match="is not JSON"):
    neuronpedia.save_graph_files(g, tmp_path, slug="s")
  (tmp_path / "graph-metadata.json").write_text('{"graphs": 3}')
  with pytest.raises(ValueError, match="not a graph index"):
    neuronpedia.save_graph_files(g, tmp_path, slug="s")
  assert not (tmp_path / "s.json").exists()
