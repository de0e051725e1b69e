"""Attribution targets (`circuits.attribute(..., attribution_targets=)`):
token ids and `CustomTarget` directions, checked against circuit-tracer
0.5's `AttributionTargets` on the same logits and unembedding, forward-mode
derivatives of the real targets, the real model's values, the salient
graph's rows, and circuit-tracer's graph files; save/load of the labels and
clear errors for bad targets.

circuit-tracer's whole `attribute` is not run here (it needs its
TransformerLens replacement model, built in `benchmarks/peers`): its target
processing is compared directly, and the rows against jvp and the model.
"""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from penzai_lm import circuits
from penzai_lm.circuits import neuronpedia
from penzai_lm.circuits import rows
from penzai_lm.circuits.targets import resolve_targets
from penzai_lm.tokenizer import Tokenizer
from tests.circuits import small_graphs
from tests.circuits.test_attribute import LAYERS
from tests.circuits.test_attribute import PROMPT
from tests.circuits.test_attribute import WIDTH
from tests.circuits.test_attribute import _flat
from tests.circuits.test_attribute import _graph
from tests.circuits.test_attribute import _jvp_all
from tests.circuits.test_attribute import _model
from tests.circuits.test_attribute import _reference
from tests.circuits.test_attribute import _sources
from tests.circuits.test_attribute import _transcoders
from tests.circuits.test_neuronpedia import SCAN
from tests.circuits.test_neuronpedia import _as_circuit_tracer
from tests.circuits.test_neuronpedia import _circuit_tracer
from tests.circuits.test_neuronpedia import _without_influence

V = 97  # The test model's vocabulary.


def _attribute(targets, **kwargs):
  return circuits.attribute(_model(), list(_transcoders()), PROMPT,
                            batch_size=32, zero_positions=0,
                            attribution_targets=targets, **kwargs)


def _custom():
  """``logit(3) - logit(5)`` and a random direction."""
  diff = np.zeros(V, np.float32)
  diff[3], diff[5] = 1.0, -1.0
  rand = np.random.default_rng(1).standard_normal(V).astype(np.float32)
  return [circuits.CustomTarget("logit(3)-logit(5)", diff, 0.7),
          circuits.CustomTarget("random", rand, 0.2)]


def test_resolved_targets_are_circuit_tracers():
  """Same logits and unembedding in both: circuit-tracer's ids,
  probabilities and d_model vectors equal ours, its vectors ``W_U^T @``
  our logit cotangents (custom targets: its vec = W_U^T @ our vector)."""
  ct = _circuit_tracer()
  torch = ct["torch"]
  # pylint: disable-next=g-import-not-at-top
  from circuit_tracer.attribution import targets as ct_targets

  rng = np.random.default_rng(0)
  logits = (3 * rng.standard_normal(V)).astype(np.float32)
  w_u = rng.standard_normal((WIDTH, V)).astype(np.float32)  # TL's layout.

  class Decoder:  # circuit-tracer decodes ids for labels; not compared.

    def decode(self, i):
      return str(i)

  custom = _custom()
  cases = [(None, None),
           ([40, 3, 96], torch.tensor([40, 3, 96])),
           (custom, [ct_targets.CustomTarget(
               c.label, c.probability, torch.tensor(w_u @ c.vector))
                     for c in custom])]
  for ours_spec, theirs_spec in cases:
    ours = resolve_targets(ours_spec, logits, 10, 0.95)
    theirs = ct_targets.AttributionTargets(
        theirs_spec, torch.tensor(logits), torch.tensor(w_u), Decoder(),
        max_n_logits=10, desired_logit_prob=0.95)
    np.testing.assert_array_equal(ours.ids, theirs.token_ids.numpy())
    np.testing.assert_allclose(ours.probabilities,
                               theirs.logit_probabilities.numpy(), rtol=1e-5)
    np.testing.assert_allclose(ours.cotangents @ w_u.T,
                               theirs.logit_vectors.numpy(), atol=1e-5)
    if ours_spec is custom:
      assert list(ours.labels) == theirs.tokens
    else:
      assert set(ours.labels) == {""}
  assert len(resolve_targets(None, logits, 10, 0.95).ids) > 1
  with pytest.raises(ValueError, match=r"\[0, 97\)"):
    ct_targets.AttributionTargets(torch.tensor([V]), torch.tensor(logits),
                                  torch.tensor(w_u), Decoder())
  with pytest.raises(ValueError, match=r"\[0, 97\)"):
    resolve_targets([V], logits, 10, 0.95)


def test_token_targets_are_the_salient_rows_in_their_order():
  salient = _graph()
  ids = salient.logit_tokens[::-1]
  graph = _attribute(ids.tolist())
  np.testing.assert_array_equal(graph.logit_tokens, ids)
  np.testing.assert_allclose(graph.logit_probabilities,
                             salient.logit_probabilities[::-1], rtol=1e-6)
  np.testing.assert_allclose(graph.edges[graph.n_features:],
                             salient.edges[salient.n_features:][::-1],
                             atol=1e-6)
  np.testing.assert_array_equal(graph.edges[:graph.n_features],
                                salient.edges[:salient.n_features])
  # An improbable token: its probability is the real model's softmax.
  last = _reference()["logits"][-1].astype(np.float64)
  least = int(np.argmin(last))
  graph = _attribute(np.array([least]))
  expected = np.exp(last[least] - last.max()) / np.exp(last - last.max()).sum()
  assert graph.logit_probabilities[0] == pytest.approx(expected, rel=1e-4)
  assert graph.logit_labels == ("",)


def test_custom_rows_are_derivatives_and_add_up_to_the_values():
  """A custom target's row is the jvp of ``vector . target_logits`` along
  each source; with the b_dec terms it adds up to ``vector . logits`` of
  the real model. Feature rows do not depend on the logit targets."""
  transcoders = _transcoders()
  custom = _custom()
  salient = _graph()
  programs = rows._batch_rows._cache_size()
  graph = _attribute(custom)
  # Other targets, same batch shapes: no program compiled.
  assert rows._batch_rows._cache_size() == programs
  assert graph.logit_tokens.tolist() == [V, V + 1]
  assert graph.logit_labels == ("logit(3)-logit(5)", "random")
  np.testing.assert_allclose(graph.logit_probabilities, [0.7, 0.2])
  np.testing.assert_array_equal(graph.edges[:graph.n_features],
                                salient.edges[:salient.n_features])
  vectors = np.stack([c.vector for c in custom])
  linear = circuits.linearize(_model(), transcoders, np.asarray(PROMPT))
  embed, mlp = _sources(graph, transcoders)
  _, d_logits = _jvp_all(linear, jnp.asarray(embed), jnp.asarray(mlp))
  expected = vectors @ np.asarray(d_logits).T
  got = graph.edges[graph.n_features:]
  assert np.abs(expected).max() > 0.1
  np.testing.assert_allclose(got, expected,
                             atol=2e-5 * np.abs(expected).max(), rtol=1e-4)
  b_dec = np.stack([_flat(t)["b_dec"] for t in transcoders])
  tangent = np.broadcast_to(b_dec[:, None], (LAYERS, len(PROMPT), WIDTH))
  _, d_bias = _jvp_all(linear, jnp.zeros((1, len(PROMPT), WIDTH)),
                       jnp.asarray(tangent)[None])
  values = vectors @ _reference()["logits"][-1]
  np.testing.assert_allclose(got.sum(axis=1) + vectors @ np.asarray(
      d_bias[0]), values, atol=2e-5 * np.abs(values).max())


def test_capped_custom_graph_is_the_full_one_restricted():
  custom = _custom()
  full, capped = _attribute(custom), _attribute(custom, max_feature_nodes=9)
  assert capped.n_features == 9
  keep = np.concatenate([capped.selected_features,
                         np.arange(full.n_features, full.n_sources)])
  np.testing.assert_allclose(
      capped.edges[capped.n_features:],
      full.edges[full.n_features:][:, keep], atol=1e-6)


def test_labels_survive_save_and_load(tmp_path):
  graph = _attribute(_custom())
  back = circuits.Graph.load(graph.save(tmp_path / "g.safetensors"))
  assert back.logit_labels == graph.logit_labels
  np.testing.assert_array_equal(back.logit_tokens, graph.logit_tokens)
  # Token targets only: no labels written, a version 2 file as before.
  path = _graph().save(tmp_path / "plain.safetensors")
  with safe_open(str(path), framework="np") as f:
    meta = json.loads(f.metadata()["penzai_lm.circuits"])
  assert meta["version"] == 2 and "logit_labels" not in meta
  assert circuits.Graph.load(path).logit_labels == ("",) * _graph().n_logits
  with pytest.raises(ValueError, match="logit_labels"):
    dataclasses.replace(graph, logit_labels=("one",))


def _with_custom_first(graph, label):
  """``graph`` with its first logit node turned into a custom target."""
  ids = graph.logit_tokens.copy()
  ids[0] = graph.vocab_size
  return dataclasses.replace(
      graph, logit_tokens=ids,
      logit_labels=(label,) + ("",) * (graph.n_logits - 1))


def test_exports_show_custom_labels_as_circuit_tracer(tmp_path):
  """The virtual id is not decoded: the label shows, in the Neuronpedia
  files (byte for byte circuit-tracer's, influences aside) and the page."""
  ct = _circuit_tracer()
  tok_dir = small_graphs.write_tokenizer_dir(tmp_path)
  tok = Tokenizer.from_hf(tok_dir)
  label = "x<b>-y"
  graph = _with_custom_first(small_graphs.graph(), label)
  theirs = _as_circuit_tracer(ct, graph, tok_dir)
  theirs.logit_targets[0] = ct["LogitTarget"](label, graph.vocab_size)
  ct["create"](theirs, "s", str(tmp_path / "theirs"))
  neuronpedia.save_graph_files(graph, tmp_path / "ours", slug="s",
                               tokenizer=tok, scan=SCAN,
                               prompt=small_graphs.PROMPT)
  text_ours = (tmp_path / "ours" / "s.json").read_text()
  assert _without_influence(text_ours) == _without_influence(
      (tmp_path / "theirs" / "s.json").read_text())
  logits = [n for n in json.loads(text_ours)["nodes"]
            if n["feature_type"] == "logit"]
  assert logits[0]["clerp"].startswith(f'Output "{label}" (p=')
  assert logits[0]["node_id"].split("_")[1] == str(graph.vocab_size)
  assert logits[1]["clerp"].startswith(
      f'Output "{tok.decode([int(graph.logit_tokens[1])])}"')
  page = circuits.graph_html(graph, tokenizer=tok)
  assert label not in page  # Markup escaped inside the data block.
  data = json.loads(re.search(r'id="graph-data">(.*?)</script>', page,
                              re.S).group(1))
  assert [n["clerp"] for n in data["nodes"]
          if n["feature_type"] == "logit"][0].startswith(f'Output "{label}"')


def _target(**kwargs):
  fields = dict(label="t", vector=np.ones(V, np.float32), probability=0.5)
  return circuits.CustomTarget(**{**fields, **kwargs})


@pytest.mark.parametrize("targets, error, match", [
    ("hello", TypeError, "tokenize"),
    (["he", "llo"], TypeError, "tokenize"),
    ([], ValueError, "attribution_targets is empty"),
    (np.array([], np.int32), ValueError, "attribution_targets is empty"),
    ([3, V], ValueError, r"attribution_targets ids \[97\] are outside"),
    ([-1], ValueError, "outside"),
    ([3, 4, 3], ValueError, r"repeats the ids \[3\]"),
    (np.array([[3, 4]]), ValueError, "1-D"),
    ([3, 1.5], TypeError, "all token ids"),
    ([3, _target()], TypeError, "all token ids"),
    (5, TypeError, "attribution_targets must be None"),
    ([_target(vector=np.ones(V - 1))], ValueError,
     r"attribution_targets\[0\].vector has shape \(96,\)"),
    ([_target(), _target(vector=np.full(V, np.nan))], ValueError,
     r"attribution_targets\[1\].vector is not finite"),
    ([_target(probability=float("nan"))], ValueError,
     r"attribution_targets\[0\].probability must be a finite"),
    ([_target(probability="0.5")], TypeError,
     r"attribution_targets\[0\].probability must be a real number"),
    ([_target(label=3)], TypeError, r"attribution_targets\[0\].label"),
])
def test_bad_targets_are_clear_errors(targets, error, match):
  with pytest.raises(error, match=match):
    _attribute(targets)
