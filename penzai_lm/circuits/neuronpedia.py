"""Attribution graphs as Neuronpedia's graph JSON (circuit-tracer 0.5's files).

`graph_json(graph, slug=...)` gives the object circuit-tracer 0.5's
``create_graph_files`` writes to ``<slug>.json``, the file Neuronpedia's
graph viewer (and circuit-tracer's local server) opens: the graph pruned by
`prune_graph` with the same thresholds, as nodes and links::

    {"metadata": {slug, scan, transcoder_list, prompt_tokens, prompt,
                  node_threshold, schema_version},
     "qParams": {pinnedIds, supernodes, linkType, clickedId, sg_pos},
     "nodes": [...], "links": [{"source", "target", "weight"}, ...]}

Nodes, in node order (`Graph`'s), each with the keys ``node_id, feature,
layer, ctx_idx, feature_type, token_prob, is_target_logit, run_idx,
reverse_ctx_idx, jsNodeId, clerp, influence, activation``:

* feature ``(layer, pos, f)``: ``node_id`` ``"{layer}_{f}_{pos}"``,
  ``feature`` the Cantor pairing of ``(layer, f)``, ``feature_type``
  ``"cross layer transcoder"`` (circuit-tracer's name for every
  transcoder), ``activation`` its activation;
* error ``(layer, pos)``: ``"0_{layer}_{pos}"``, ``feature`` -1,
  ``"mlp reconstruction error"``. This id equals that of the layer-0
  feature ``layer`` at ``pos`` when it is a node (circuit-tracer issue 78;
  its later versions write ``"{layer}_-1_{pos}"``, as
  ``distinct_error_ids=True`` does); links name nodes by id, so such a
  pair is ambiguous in the file, as in circuit-tracer's;
* token ``(pos, id)``: ``"E_{id}_{pos}"``, ``layer`` ``"E"``, ``feature``
  ``pos``, ``"embedding"``;
* logit ``k`` (token ``id``): ``"{num_layers + 1}_{id}_{n_pos - 1}"``,
  ``feature`` ``id``, ``"logit"``, ``token_prob``, ``is_target_logit`` for
  the first, ``clerp`` ``'Output "{token}" (p=0.123)'``; a custom
  target (`penzai_lm.circuits.targets`, id ``vocab_size + i``) shows its
  label in place of the token, as circuit-tracer does.

``influence`` is `PruneResult.cumulative_scores` (the fraction of all
influence held by the nodes at least as influential: small is important),
null on logits. Kept nodes without a kept link are left out, except tokens
and logits. Links are the kept edges, ordered by target node, then source
node; ``weight`` is the edge's direct effect. `export_graph` gives the
same nodes with the links as positions in the node list (unambiguous),
for `graph_html`.

Token strings (``prompt_tokens`` and the logits' ``clerp``) are the
tokenizer's decoding of each id alone, or the id in decimal without a
tokenizer. Files are written atomically (`penzai_lm.file_access`).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import hashlib
import json
import os
from pathlib import Path
import re

import numpy as np

from penzai_lm.circuits.graph import Graph
from penzai_lm.circuits.prune import PruneResult
from penzai_lm.circuits.prune import prune_graph
from penzai_lm.file_access import read_regular
from penzai_lm.file_access import write_atomic
from penzai_lm.tokenizer import Tokenizer

SCHEMA_VERSION = 1
METADATA_FILE = "graph-metadata.json"
_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


def _cantor(x: int, y: int) -> int:
  return (x + y) * (x + y + 1) // 2 + y


def _node(node_id: str, feature: int, layer: str, ctx_idx: int,
          feature_type: str, js_node_id: str, *, influence=None,
          activation=None, token_prob: float = 0.0,
          is_target_logit: bool = False, clerp: str = "") -> dict:
  """A node with circuit-tracer's keys in its order."""
  return {"node_id": node_id, "feature": feature, "layer": layer,
          "ctx_idx": ctx_idx, "feature_type": feature_type,
          "token_prob": token_prob, "is_target_logit": is_target_logit,
          "run_idx": 0, "reverse_ctx_idx": 0, "jsNodeId": js_node_id,
          "clerp": clerp, "influence": influence, "activation": activation}


def _token_text(tokenizer: Tokenizer | None, token: int) -> str:
  return str(token) if tokenizer is None else tokenizer.decode([token])


def _nodes(graph: Graph, node_mask: np.ndarray, cumulative: np.ndarray,
           tokenizer: Tokenizer | None, distinct_error_ids: bool
           ) -> dict[int, dict]:
  """Node index -> node, for the kept nodes."""
  features = graph.feature_nodes
  activations = graph.activation_values[graph.selected_features]
  logit_layer = str(graph.num_layers + 1)
  nodes = {}
  for index in np.flatnonzero(node_mask).tolist():
    influence = float(cumulative[index])
    if index < graph.error_start:
      layer, pos, f = features[index].tolist()
      nodes[index] = _node(
          f"{layer}_{f}_{pos}", _cantor(layer, f), str(layer), pos,
          "cross layer transcoder", f"{layer}_{f}-0", influence=influence,
          activation=float(activations[index]))
    elif index < graph.token_start:
      layer, pos = divmod(index - graph.error_start, graph.n_pos)
      node_id = (f"{layer}_-1_{pos}" if distinct_error_ids
                 else f"0_{layer}_{pos}")
      nodes[index] = _node(node_id, -1, str(layer), pos,
                           "mlp reconstruction error", f"{layer}_{pos}-0",
                           influence=influence)
    elif index < graph.logit_start:
      pos = index - graph.token_start
      token = int(graph.input_tokens[pos])
      nodes[index] = _node(f"E_{token}_{pos}", pos, "E", pos, "embedding",
                           f"E_{token}-{pos}", influence=influence)
    else:
      k = index - graph.logit_start
      token = int(graph.logit_tokens[k])
      prob = float(graph.logit_probabilities[k])
      pos = graph.n_pos - 1
      text = (graph.logit_labels[k] if token >= graph.vocab_size
              else _token_text(tokenizer, token))
      nodes[index] = _node(
          f"{logit_layer}_{token}_{pos}", token, logit_layer, pos, "logit",
          f"L_{token}-{pos}", token_prob=prob, is_target_logit=k == 0,
          clerp=f'Output "{text}" (p={prob:.3f})')
  return nodes


def kept_edges(graph: Graph, pruned: PruneResult
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(targets, sources, weights)`` of the kept edges: node indices and
  float32 direct effects, ordered by target node, then source node.

  ``pruned.edge_mask`` may be square (``[n_nodes, n_nodes]``) or shaped as
  ``graph.edges`` (rows `Graph.target_nodes`, columns the sources).
  """
  mask = pruned.edge_mask
  rows_of_nodes = graph.target_nodes()
  if mask.shape == (graph.n_nodes, graph.n_nodes):
    targets, sources = np.nonzero(mask)
    rows = np.searchsorted(rows_of_nodes, targets)
  else:
    rows, sources = np.nonzero(mask)
    targets = rows_of_nodes[rows]
  return targets, sources, graph.edges[rows, sources]


def _scan(scan) -> tuple[str, list[str]]:
  """``(scan, transcoder_list)`` as circuit-tracer writes them."""
  if scan is None:
    return "", []
  if isinstance(scan, str):
    return scan, []
  if (isinstance(scan, Sequence) and scan
      and all(isinstance(s, str) for s in scan)):
    # circuit-tracer names a list by Python's hash() of the joined names,
    # which changes between processes; this one is stable.
    digest = hashlib.sha256("-".join(scan).encode()).hexdigest()[:16]
    return f"custom-{int(digest, 16)}", list(scan)
  raise ValueError(f"scan must be a string (the transcoders' Neuronpedia"
                   f" scan id, e.g. 'gemma-2-2b'), a non-empty list of"
                   f" transcoder ids, or None; got {scan!r}.")


def check_slug(slug) -> str:
  """Returns ``slug`` if it can name a graph (and its file).

  Raises:
    ValueError: unless it is 1 to 200 letters, digits, ``_``, ``.`` or
      ``-``, starting with a letter or digit.
  """
  if not isinstance(slug, str) or not _SLUG.fullmatch(slug):
    raise ValueError(
        f"slug must be 1 to 200 letters, digits, '_', '.' or '-', starting"
        f" with a letter or digit (it names the graph and its file), got"
        f" {slug!r}.")
  return slug


@dataclasses.dataclass(frozen=True, eq=False)
class GraphExport:
  """A pruned graph as its exported nodes and links (`export_graph`).

  Attributes:
    metadata: The JSON's ``metadata`` object.
    nodes: The node objects (module docstring), in node order.
    links: ``[n_links, 2]`` int64 ``(source, target)`` positions in
      ``nodes``, ordered by target node, then source node.
    weights: ``[n_links]`` float32 direct effects.
  """

  metadata: dict
  nodes: list[dict]
  links: np.ndarray
  weights: np.ndarray

  def to_json(self) -> dict:
    """The Neuronpedia graph JSON object (module docstring)."""
    ids = [n["node_id"] for n in self.nodes]
    links = [{"source": ids[s], "target": ids[t], "weight": w}
             for (s, t), w in zip(self.links.tolist(), self.weights.tolist())]
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both",
               "clickedId": "", "sg_pos": ""}
    return {"metadata": self.metadata, "qParams": qparams,
            "nodes": self.nodes, "links": links}


def export_graph(graph: Graph, *, slug: str = "graph",
                 tokenizer: Tokenizer | None = None,
                 node_threshold: float = 0.8, edge_threshold: float = 0.98,
                 scan: str | Sequence[str] | None = None,
                 prompt: str | None = None,
                 distinct_error_ids: bool = False) -> GraphExport:
  """The graph pruned and labelled for export (see `graph_json`)."""
  check_slug(slug)
  scan_id, transcoder_list = _scan(scan)
  if prompt is not None and not isinstance(prompt, str):
    raise ValueError(f"prompt must be a string or None, got {prompt!r}.")
  if not np.isfinite(graph.edges).all():
    raise ValueError("the graph has non-finite edge weights (NaN or inf):"
                     " it cannot be pruned, and JSON cannot hold them."
                     " Rebuild it (a model or transcoder with non-finite"
                     " values gives them).")
  pruned = prune_graph(graph, node_threshold, edge_threshold)
  nodes = _nodes(graph, pruned.node_mask, pruned.cumulative_scores,
                 tokenizer, distinct_error_ids)
  targets, sources, weights = kept_edges(graph, pruned)
  keep = pruned.node_mask[sources] & pruned.node_mask[targets]
  targets, sources, weights = targets[keep], sources[keep], weights[keep]
  # Nodes without links go, by node_id as circuit-tracer does (module
  # docstring: ids may collide).
  linked = {nodes[i]["node_id"] for i in np.concatenate(
      [sources, targets]).tolist()}
  used = [i for i, n in nodes.items() if n["node_id"] in linked
          or n["feature_type"] in ("embedding", "logit")]
  position = np.zeros(graph.n_nodes, np.int64)
  position[used] = np.arange(len(used))
  ids = graph.input_tokens.tolist()
  if prompt is None:
    prompt = (" ".join(map(str, ids)) if tokenizer is None
              else tokenizer.decode(ids))
  metadata = {"slug": slug, "scan": scan_id,
              "transcoder_list": transcoder_list,
              "prompt_tokens": [_token_text(tokenizer, t) for t in ids],
              "prompt": prompt, "node_threshold": float(node_threshold),
              "schema_version": SCHEMA_VERSION}
  return GraphExport(
      metadata, [nodes[i] for i in used],
      np.stack([position[sources], position[targets]], 1).reshape(-1, 2),
      weights.astype(np.float32))


def graph_json(graph: Graph, *, slug: str,
               tokenizer: Tokenizer | None = None,
               node_threshold: float = 0.8, edge_threshold: float = 0.98,
               scan: str | Sequence[str] | None = None,
               prompt: str | None = None,
               distinct_error_ids: bool = False) -> dict:
  """The graph as Neuronpedia's graph JSON (see the module docstring).

  Args:
    graph: The attribution graph.
    slug: The graph's name (`check_slug`).
    tokenizer: Decodes the prompt and logit tokens; without it they show
      as ids.
    node_threshold: `prune_graph`'s node threshold.
    edge_threshold: `prune_graph`'s edge threshold.
    scan: The transcoders' Neuronpedia scan id (needed to upload the graph
      to Neuronpedia, which reads feature details by it), or a list of
      transcoder ids; None writes ``""`` (a local viewer shows no feature
      details).
    prompt: ``metadata.prompt``; None decodes the prompt's tokens (the ids
      joined by spaces without a tokenizer).
    distinct_error_ids: Error node ids ``"{layer}_-1_{pos}"`` (circuit-
      tracer after its issue 78) instead of 0.5's ``"0_{layer}_{pos}"``,
      which equals the id of the layer-0 feature ``layer`` at ``pos``.

  Raises:
    ValueError: for a bad slug, scan, prompt or threshold, or non-finite
      weights.
  """
  return export_graph(
      graph, slug=slug, tokenizer=tokenizer, node_threshold=node_threshold,
      edge_threshold=edge_threshold, scan=scan, prompt=prompt,
      distinct_error_ids=distinct_error_ids).to_json()


def dumps(data: dict) -> bytes:
  """A graph JSON object as circuit-tracer writes it (2-space indent,
  UTF-8)."""
  return json.dumps(data, indent=2, ensure_ascii=False,
                    allow_nan=False).encode()


def save_graph_json(graph: Graph, path: str | os.PathLike, *, slug: str,
                    **kwargs) -> Path:
  """Writes `graph_json` (same arguments) to ``path``; returns the path."""
  path = Path(path)
  write_atomic(path, dumps(graph_json(graph, slug=slug, **kwargs)))
  return path


def save_graph_files(graph: Graph, folder: str | os.PathLike, *, slug: str,
                     **kwargs) -> Path:
  """circuit-tracer's ``create_graph_files``: `write_graph_files` of
  `export_graph` (same keyword arguments). Returns the JSON's path."""
  return write_graph_files(export_graph(graph, slug=slug, **kwargs), folder)


def write_graph_files(export: GraphExport, folder: str | os.PathLike
                      ) -> Path:
  """Writes ``<slug>.json`` in ``folder`` (created if missing) and adds its
  metadata to the folder's ``graph-metadata.json`` (replacing an entry of
  the same slug), as circuit-tracer's ``create_graph_files``: the folder
  its local server serves. Returns the JSON's path.

  Raises:
    ValueError: if ``folder`` is not a folder, or its
      ``graph-metadata.json`` is not such an index.
  """
  folder = Path(folder)
  slug = check_slug(export.metadata["slug"])
  if folder.exists() and not folder.is_dir():
    raise ValueError(f"{folder} exists and is not a folder; give a folder"
                     " for the graph files.")
  folder.mkdir(parents=True, exist_ok=True)
  index_path = folder / METADATA_FILE
  index = {"graphs": []}
  if index_path.exists():
    try:
      index = json.loads(read_regular(index_path, what=METADATA_FILE))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{index_path} is not JSON ({e}); remove it or"
                       " choose another folder.") from e
    if not (isinstance(index, dict) and isinstance(index.get("graphs"), list)
            and all(isinstance(g, dict) for g in index["graphs"])):
      raise ValueError(f"{index_path} is not a graph index (an object whose"
                       " 'graphs' is a list of objects); remove it or choose"
                       " another folder.")
  path = folder / f"{slug}.json"
  write_atomic(path, dumps(export.to_json()))
  index["graphs"] = [g for g in index["graphs"] if g.get("slug") != slug]
  index["graphs"].append(export.metadata)
  write_atomic(index_path, json.dumps(index, indent=2).encode())
  return path
