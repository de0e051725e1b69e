"""qk_attribution: the scores are the model's (a float64 numpy recomputation
from the residual stream, whose softmax is the model's captured pattern),
the terms add up to them, and every term's query and key vectors equal an
independent float64 numpy propagation of its source through the frozen
model (patterns and norm denominators from the real run, the transcoders'
own arithmetic for features and errors), for Llama with grouped-query
heads and Gemma 3 (multi-query, post norms, QK norms, a local layer); the
labels are the graph's nodes; bad arguments are clear errors."""

import functools

import numpy as np
import pytest

import penzai_lm
from penzai_lm import circuits
from penzai_lm import interp
from penzai_lm.circuits.qk import qk_attribution
from penzai_lm.sae import CrossLayerTranscoder
from penzai_lm.sae import SAEConfig
from penzai_lm.sae import SparseAutoencoder
from tests.model.configs import config
from tests.model.reference import _head_names
from tests.model.reference import _layer_param
from tests.model.reference import _params
from tests.model.reference import _rope
from tests.sae.random_saes import random_arrays

PROMPT = [1, 5, 9, 13, 2, 7]
FEATURES = 64


@functools.cache
def _model(name):
  return penzai_lm.build_transformer(config(name, True), seed=3)


@functools.cache
def _arrays(name, kind):
  """Random transcoder arrays (per block: ``w_enc [D, F]``, ``w_dec [F, D]``
  or, for a CLT, ``[F, L - l, D]``, ``b_enc``, ``b_dec``, ``threshold``,
  ``w_skip`` with kind "skip")."""
  cfg = _model(name).config
  width, n_layers = cfg.hidden_size, cfg.num_layers
  out = []
  for layer in range(n_layers):
    a = random_arrays(width, FEATURES, width, seed=10 + layer,
                      threshold=True, skip=kind == "skip")
    if kind == "clt":
      rng = np.random.default_rng(20 + layer)
      a["w_dec"] = (rng.standard_normal((FEATURES, n_layers - layer, width))
                    / np.sqrt(FEATURES)).astype(np.float32)
    out.append(a)
  return tuple(out)


@functools.cache
def _transcoders(name, kind):
  """Per-layer transcoders (kind "plain" or "skip") or a CLT ("clt")."""
  arrays = _arrays(name, kind)
  width = _model(name).config.hidden_size
  if kind == "clt":
    stacked = {k: np.stack([a[k] for a in arrays])
               for k in ("b_enc", "b_dec", "threshold")}
    return CrossLayerTranscoder.from_arrays(
        w_enc=np.stack([a["w_enc"].T for a in arrays]),
        w_dec=[a["w_dec"] for a in arrays], **stacked,
        input_point="mlp_in", output_point="mlp_out")
  out = []
  for layer, a in enumerate(arrays):
    sae_config = SAEConfig(
        activation="jumprelu", num_features=FEATURES,
        input_axes=(("embedding", width),),
        output_axes=(("embedding", width),),
        hook_point=f"blocks.{layer}.mlp_in",
        output_point=f"blocks.{layer}.mlp_out")
    out.append(SparseAutoencoder.from_arrays(sae_config, **a))
  return out


# (model, transcoders, layer, head, query, keys, zero_positions): Llama GQA
# head 3 is group 1's second head; Gemma 3 has one key/value head, layer 1
# is local (window 4), layer 2 global.
CASES = {
    "llama": ("llama_gqa", "plain", 2, 3, 5, None, 0),
    "llama_skip_bos": ("llama_gqa", "skip", 2, 0, 4, (0, 2, 4), 1),
    "llama_clt": ("llama_gqa", "clt", 2, 1, 5, None, 0),
    "gemma3_global": ("gemma3", "plain", 2, 1, 5, None, 0),
    "gemma3_local_skip": ("gemma3", "skip", 1, 2, 5, None, 0),
}


@functools.cache
def _result(case):
  name, kind, layer, head, query, keys, zero = CASES[case]
  return qk_attribution(_model(name), _transcoders(name, kind), PROMPT,
                        layer=layer, head=head, query_position=query,
                        key_positions=keys, zero_positions=zero,
                        batch_size=128)


@functools.cache
def _run(name):
  """The real model's values on the prompt, float64 numpy."""
  cfg = _model(name).config
  points = ["embed"] + [f"blocks.{i}.{p}" for i in range(cfg.num_layers)
                        for p in ("resid_pre", "resid_mid", "mlp_in",
                                  "mlp_out", "attn.pattern")]
  cache = interp.run_with_cache(_model(name), PROMPT, names=points)
  q_axes, _ = _head_names(cfg)
  out = {"embed": np.asarray(cache["embed"].unwrap(
      "batch", "seq", "embedding")[0], np.float64)}
  for p in ("resid_pre", "resid_mid", "mlp_in", "mlp_out"):
    out[p] = np.stack([np.asarray(cache[f"blocks.{i}.{p}"].unwrap(
        "batch", "seq", "embedding")[0], np.float64)
                       for i in range(cfg.num_layers)])
  patterns = [cache[f"blocks.{i}.attn.pattern"].unwrap(
      "batch", "seq", *q_axes, "kv_seq")[0] for i in range(cfg.num_layers)]
  seq = len(PROMPT)
  out["pattern"] = np.stack([  # [L, H, T, T]
      np.asarray(p, np.float64).reshape(seq, -1, seq).transpose(1, 0, 2)
      for p in patterns])
  return out


@functools.cache
def _weights(name):
  return _Weights(name)


class _Weights:
  """Block ``layer``'s weights as float64 numpy (``[D, H, d]`` projections,
  ``[H, d, D]`` output)."""

  def __init__(self, name):
    self.model = _model(name)
    self.cfg = self.model.config
    self.params = _params(self.model)
    self.q_axes, self.kv_axes = _head_names(self.cfg)

  def get(self, what, layer, *axes):
    return _layer_param(self.params, what, layer, True, *axes)

  def norm_scale(self, what, layer):
    return self.get(f"{what}/scale.weights", layer, "embedding")

  def projection(self, what, layer):
    axes = self.kv_axes if what in ("key", "value") else self.q_axes
    w = self.get(f"attention/{what}.weights", layer, "embedding", *axes,
                 "projection")
    return w.reshape(w.shape[0], -1, self.cfg.head_dim)

  def output(self, layer):
    w = self.get("attention/output.weights", layer, *self.q_axes,
                 "projection", "embedding")
    return w.reshape(-1, self.cfg.head_dim, w.shape[-1])


def _inv_rms(x, eps):
  return 1.0 / np.sqrt(np.mean(x * x, -1) + eps)


def _propagate(name, kind, layer, embed_src, mlp_src):
  """The residual stream entering ``layer`` moved by sources ``embed_src``
  (``[N, T, D]``) and ``mlp_src`` (``[N, L, T, D]``) in the frozen model,
  float64 (``[N, T, D]``)."""
  w, run = _weights(name), _run(name)
  cfg, eps = w.cfg, w.cfg.norm_eps
  per_group = cfg.num_heads // cfg.num_kv_heads
  kv_of = np.arange(cfg.num_heads) // per_group
  d = embed_src.copy()
  for b in range(layer):
    h = d * (_inv_rms(run["resid_pre"][b], eps)[:, None]
             * w.norm_scale("pre_attention_norm", b))
    v = np.einsum("ntd,dke->ntke", h, w.projection("value", b))[:, :, kv_of]
    z = np.einsum("hqk,nkhe->nqhe", run["pattern"][b], v)
    attn = np.einsum("nqhe,hed->nqd", z, w.output(b))
    if cfg.post_norms:  # Frozen at the real attention output's RMS.
      real_h = run["resid_pre"][b] * (
          _inv_rms(run["resid_pre"][b], eps)[:, None]
          * w.norm_scale("pre_attention_norm", b))
      real_v = np.einsum("td,dke->tke", real_h,
                         w.projection("value", b))[:, kv_of]
      real = np.einsum("hed,qhe->qd", w.output(b), np.einsum(
          "hqk,khe->qhe", run["pattern"][b], real_v))
      attn = attn * (_inv_rms(real, eps)[:, None]
                     * w.norm_scale("post_attention_norm", b))
    d = d + attn
    if kind == "skip":
      h2 = d * (_inv_rms(run["resid_mid"][b], eps)[:, None]
                * w.norm_scale("pre_ffw_norm", b))
      d = d + h2 @ _arrays(name, kind)[b]["w_skip"].astype(np.float64)
    d = d + mlp_src[:, b]
  return d


def _head_map(name, layer, head, which, resid, position, real_resid):
  """The head's query (or key) part of ``resid`` (``[N, D]`` at
  ``position``), with the norms frozen at ``real_resid`` (``[D]``): the
  linear map, float64 ``[N, d]``."""
  w = _weights(name)
  cfg, eps = w.cfg, w.cfg.norm_eps
  column = head if which == "query" else head // (
      cfg.num_heads // cfg.num_kv_heads)
  scale = _inv_rms(real_resid, eps) * w.norm_scale("pre_attention_norm",
                                                   layer)
  proj = w.projection(which, layer)[:, column]
  out = (resid * scale) @ proj
  if cfg.qk_norm:
    real = (real_resid * scale) @ proj
    out = out * _inv_rms(real, eps) * w.get(
        f"attention/{which}_norm/scale.weights", layer, "projection")
  base, scaling = cfg.rope_base, cfg.rope_scaling
  if cfg.resolved_layer_types[layer] == "local" and cfg.local_rope_base:
    base, scaling = cfg.local_rope_base, None
  out = _rope(out, np.full(len(out), float(position)), base, scaling)
  return out * cfg.query_scale if which == "query" else out


def _expected(case):
  """``(query vectors [n, d], key vectors [K, n, d], scores [K])`` of the
  result's terms (read from its labels), from the numpy model; the bias
  term's source is what the zeroed positions' MLPs write (less the skip
  path, which the frozen model keeps linear)."""
  name, kind, layer, head, query, _, zero = CASES[case]
  result, run = _result(case), _run(name)
  arrays = _arrays(name, kind)
  terms = result.terms
  n, (n_layers, seq, width) = len(terms), run["mlp_out"].shape
  acts, written = [], np.zeros((n_layers, seq, width))
  for b, a in enumerate(arrays):  # The transcoders' own arithmetic.
    pre = run["mlp_in"][b] @ a["w_enc"] + a["b_enc"]
    acts.append(np.where(pre > a["threshold"], pre, 0.0))
    acts[b][:zero] = 0.0
    if kind == "clt":
      written[b:] += np.einsum("pf,ftd->tpd", acts[b], a["w_dec"])
    else:
      written[b] += acts[b] @ a["w_dec"]
    written[b] += a["b_dec"]
  skip = np.zeros_like(written)
  if kind == "skip":
    skip = np.stack([run["mlp_in"][b] @ a["w_skip"]
                     for b, a in enumerate(arrays)])
  embed, mlp = np.zeros((n, seq, width)), np.zeros((n, n_layers, seq, width))
  for i in range(n):
    k, b, p = terms.kinds[i], terms.layers[i], terms.positions[i]
    if k == "feature":
      f = terms.feature_ids[i]
      if kind == "clt":
        mlp[i, b:, p] = acts[b][p, f] * arrays[b]["w_dec"][f]
      else:
        mlp[i, b, p] = acts[b][p, f] * arrays[b]["w_dec"][f]
    elif k == "error" and p >= zero:
      mlp[i, b, p] = run["mlp_out"][b, p] - written[b, p] - skip[b, p]
    elif k == "token":
      embed[i, p] = run["embed"][p]
    elif k == "b_dec":
      mlp[i, b, zero:] = arrays[b]["b_dec"]
    elif k == "bias":
      mlp[i, :, :zero] = run["mlp_out"][:, :zero] - skip[:, :zero]
  moved = _propagate(name, kind, layer, embed, mlp)
  real = run["resid_pre"][layer]
  q_vec = _head_map(name, layer, head, "query", moved[:, query], query,
                    real[query])
  k_vecs = np.stack([_head_map(name, layer, head, "key", moved[:, k], k,
                               real[k]) for k in result.key_positions])
  real_q = _head_map(name, layer, head, "query", real[query][None], query,
                     real[query])[0]
  real_k = np.stack([_head_map(name, layer, head, "key", real[k][None], k,
                               real[k])[0] for k in result.key_positions])
  return q_vec, k_vecs, real_k @ real_q


@pytest.mark.parametrize("case", sorted(CASES))
def test_scores_are_the_models_and_terms_add_up(case):
  name, _, layer, head, query, _, zero = CASES[case]
  result = _result(case)
  _, _, scores = _expected(case)
  np.testing.assert_allclose(result.scores, scores, rtol=1e-4, atol=1e-5)
  # The scores are the ones the model's softmax read: its pattern row.
  pattern = _run(name)["pattern"][layer, head, query]
  if CASES[case][5] is None:  # Every attended key: the softmax's support.
    e = np.exp(scores - scores.max())
    np.testing.assert_allclose(pattern[result.key_positions], e / e.sum(),
                               rtol=1e-4, atol=1e-6)
    assert pattern.sum() == pytest.approx(
        pattern[result.key_positions].sum(), abs=1e-6)
  for k, score in zip(result.key_positions, result.scores):
    assert result.contributions(int(k)).sum() == pytest.approx(
        score, rel=1e-4, abs=1e-5)
  if zero == 0:  # No model biases: the graph's sources explain it all.
    assert np.abs(result.query_vectors[-1]).max() < 1e-5
    assert np.abs(result.key_vectors[:, -1]).max() < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_term_is_its_sources_effect(case):
  result = _result(case)
  q_vec, k_vecs, _ = _expected(case)
  scale = np.abs(q_vec).max()
  np.testing.assert_allclose(result.query_vectors, q_vec, rtol=1e-3,
                             atol=1e-4 * scale)
  np.testing.assert_allclose(result.key_vectors, k_vecs, rtol=1e-3,
                             atol=1e-4 * np.abs(k_vecs).max())
  kinds = set(result.terms.kinds)
  assert {"feature", "error", "token", "b_dec", "bias"} <= kinds
  # Terms at other positions reach the query through earlier attention.
  far = (result.terms.kinds == "token") & (
      result.terms.positions < result.query_position)
  assert np.abs(result.query_vectors[far]).max() > 1e-3 * scale


def test_terms_are_graph_nodes_and_top_is_sorted():
  result = _result("llama")
  graph = circuits.attribute(_model("llama_gqa"),
                             _transcoders("llama_gqa", "plain"), PROMPT,
                             batch_size=32, zero_positions=0)
  nodes = result.terms.graph_nodes(graph)
  terms = result.terms
  for i in np.flatnonzero(terms.kinds == "feature"):
    assert tuple(graph.feature_nodes[nodes[i]]) == (
        terms.layers[i], terms.positions[i], terms.feature_ids[i])
  errors = np.flatnonzero(terms.kinds == "error")
  assert list(nodes[errors]) == [graph.error_node(int(terms.layers[i]),
                                                  int(terms.positions[i]))
                                 for i in errors]
  tokens = np.flatnonzero(terms.kinds == "token")
  assert list(nodes[tokens]) == list(graph.token_start
                                     + terms.positions[tokens])
  assert (nodes[terms.kinds == "b_dec"] == -1).all()
  # Every feature the graph has that can reach the query is a term.
  reach = (graph.feature_nodes[:, 0] < result.layer) & (
      graph.feature_nodes[:, 1] <= result.query_position)
  assert reach.sum() == (terms.kinds == "feature").sum()
  top = result.top(5)
  values = [abs(t.value) for t in top]
  assert values == sorted(values, reverse=True)
  for t in top:
    matrix = result.contributions(t.key_position)
    assert matrix[t.query, t.key] == pytest.approx(t.value)
    assert np.abs(matrix).max() <= abs(top[0].value) + 1e-6
    assert t.query_label == terms.label(t.query)
  at_two = result.top(3, key_position=2)
  matrix = result.contributions(2)
  assert [t.key_position for t in at_two] == [2, 2, 2]
  assert at_two[0].value == pytest.approx(
      matrix.ravel()[np.abs(matrix).argmax()])
  with pytest.raises(ValueError, match="n must be a positive int"):
    result.top(0)


@pytest.mark.parametrize("changes, error, match", [
    (dict(layer=3), ValueError, r"layer is 3, it must be in \[0, 3\)"),
    (dict(layer=True), TypeError, "layer must be an int"),
    (dict(head=4), ValueError, r"head is 4, it must be in \[0, 4\)"),
    (dict(query_position=6), ValueError,
     r"query_position is 6, it must be in \[0, 6\)"),
    (dict(key_positions=[5]), ValueError,
     r"key position 5 is not attended to from query position 4"),
    (dict(key_positions=[]), ValueError, "non-empty 1-D list"),
    (dict(key_positions=[1, 1]), ValueError, "distinct ints"),
    (dict(prompt="hello"), TypeError, "tokenize the text first"),
    (dict(prompt=[1, 200]), ValueError, "token id 200 outside"),
])
def test_bad_arguments(changes, error, match):
  args = dict(prompt=PROMPT, layer=1, head=0, query_position=4)
  args.update(changes)
  prompt = args.pop("prompt")
  with pytest.raises(error, match=match):
    qk_attribution(_model("llama_gqa"), _transcoders("llama_gqa", "plain"),
                   prompt, **args)


def test_bad_arguments_gemma3():
  model = _model("gemma3")
  with pytest.raises(ValueError, match=r"local block: window 4\): key"
                     r" positions must be in \[2, 5\]"):
    qk_attribution(model, _transcoders("gemma3", "plain"), PROMPT,
                   layer=1, head=0, query_position=5, key_positions=[1])
  result = _result("gemma3_local_skip")
  with pytest.raises(ValueError, match="key position 0 was not attributed"):
    result.contributions(0)
