"""`Graph`: an attribution graph, its node tables and its adjacency matrix.

Node order (circuit-tracer 0.5's): the selected features, then the error
nodes, then the token-embedding nodes, then the logit nodes::

    [features (n_features), errors (num_layers * n_pos, layer-major:
     (layer 0, pos 0), (layer 0, pos 1), ...), tokens (n_pos),
     logits (n_logits, most probable first)]

Edges are stored by target: ``edges[row, source]`` is the direct effect of
source node ``source`` on the row's target node in the prompt's local
replacement model. Rows are the feature nodes, then the logit nodes (the
nodes with inputs: error and token nodes have none); columns are the
features, errors and tokens (``logit_start`` of them: logits feed nothing).
A feature target's row holds contributions to its pre-activation (without
``b_enc``), a logit target's row contributions to its demeaned logit (the
logit minus the mean over the vocabulary). ``adjacency_matrix`` builds
circuit-tracer's square ``[n_nodes, n_nodes]`` matrix from it (row = target,
column = source, zero rows and columns included): for small graphs only,
as its size grows with the square of the prompt's length, where ``edges``
grows linearly (``n_features + n_logits`` rows).

Logit nodes are token targets (``logit_tokens`` below ``vocab_size``, a
label ``""``) or custom targets (`penzai_lm.circuits.targets`: virtual
ids ``vocab_size + i``, as circuit-tracer's, with their labels in
``logit_labels``). A custom target's row holds contributions to its
``vector . logits`` (not demeaned).

``active_features`` lists every feature active on the prompt; the graph's
feature nodes are ``active_features[selected_features]`` (all of them
unless ``max_feature_nodes`` capped them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.numpy import save_file

FORMAT = "penzai_lm.circuits.Graph"
FORMAT_VERSION = 2
_META_KEY = "penzai_lm.circuits"

# (name, dtype, number of dimensions) of each array field.
_ARRAYS = (
    ("input_tokens", np.int32, 1),
    ("active_features", np.int32, 2),
    ("activation_values", np.float32, 1),
    ("selected_features", np.int32, 1),
    ("logit_tokens", np.int32, 1),
    ("logit_probabilities", np.float32, 1),
    ("edges", np.float32, 2),
)
_NAMES = tuple(name for name, _, _ in _ARRAYS)


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
  """An attribution graph (see the module docstring for the node order).

  Attributes:
    input_tokens: ``[n_pos]`` int32 prompt token ids.
    active_features: ``[n_active, 3]`` int32 ``(layer, position,
      feature id)`` of every active feature, sorted lexicographically.
    activation_values: ``[n_active]`` float32 activations.
    selected_features: ``[n_features]`` int32 sorted indices into
      ``active_features``: the graph's feature nodes.
    logit_tokens: ``[n_logits]`` int32 token ids of the logit nodes
      (``vocab_size + i`` for the ``i``-th custom target).
    logit_probabilities: ``[n_logits]`` float32 softmax probabilities of
      those tokens at the last position (a custom target's given weight).
    edges: ``[n_features + n_logits, logit_start]`` float32, row =
      target (features, then logits), column = source (features, errors,
      tokens).
    num_layers: Blocks of the model (error nodes per position).
    vocab_size: The model's vocabulary size.
    logit_labels: ``n_logits`` labels of the logit nodes: a custom
      target's label, ``""`` for a token target; None (the default) is
      every node ``""``. A logit node with an id from ``vocab_size`` on is
      a custom target, shown by its label (not decoded).
  """

  input_tokens: np.ndarray
  active_features: np.ndarray
  activation_values: np.ndarray
  selected_features: np.ndarray
  logit_tokens: np.ndarray
  logit_probabilities: np.ndarray
  edges: np.ndarray
  num_layers: int
  vocab_size: int
  logit_labels: tuple[str, ...] | None = None

  def __post_init__(self):
    _check(self, "Graph")
    labels = self.logit_labels
    if labels is None:
      labels = ("",) * self.n_logits
    if (not isinstance(labels, (tuple, list)) or not all(
        isinstance(x, str) for x in labels) or len(labels) != self.n_logits):
      raise ValueError(f"Graph: logit_labels must be {self.n_logits} str"
                       " (one per logit node, \"\" for a token target), got"
                       f" {labels!r}.")
    object.__setattr__(self, "logit_labels", tuple(labels))

  @property
  def n_pos(self) -> int:
    return len(self.input_tokens)

  @property
  def n_features(self) -> int:
    return len(self.selected_features)

  @property
  def n_errors(self) -> int:
    return self.num_layers * self.n_pos

  @property
  def n_logits(self) -> int:
    return len(self.logit_tokens)

  @property
  def n_nodes(self) -> int:
    return self.n_features + self.n_errors + self.n_pos + self.n_logits

  @property
  def error_start(self) -> int:
    return self.n_features

  @property
  def token_start(self) -> int:
    return self.n_features + self.n_errors

  @property
  def logit_start(self) -> int:
    return self.token_start + self.n_pos

  @property
  def feature_nodes(self) -> np.ndarray:
    """``[n_features, 3]`` ``(layer, position, feature id)`` of the feature
    nodes, in node order."""
    return self.active_features[self.selected_features]

  @property
  def n_sources(self) -> int:
    """Columns of ``edges``: the features, errors and tokens."""
    return self.logit_start

  def target_nodes(self) -> np.ndarray:
    """``[n_features + n_logits]`` int64: the node of each row of
    ``edges``."""
    return np.concatenate([np.arange(self.n_features),
                           np.arange(self.logit_start, self.n_nodes)])

  @property
  def adjacency_matrix(self) -> np.ndarray:
    """circuit-tracer's square ``[n_nodes, n_nodes]`` float32 matrix (row =
    target, column = source), built from ``edges`` (a new array each
    call)."""
    matrix = np.zeros((self.n_nodes, self.n_nodes), np.float32)
    matrix[:self.n_features, :self.n_sources] = self.edges[:self.n_features]
    matrix[self.logit_start:, :self.n_sources] = self.edges[self.n_features:]
    return matrix

  @classmethod
  def from_adjacency(cls, *, adjacency_matrix, **fields) -> Graph:
    """A graph from circuit-tracer's square matrix and the other fields.

    Raises:
      ValueError: if the matrix has the wrong shape, or edges into error or
        token nodes or out of logit nodes (which a graph cannot hold).
    """
    matrix = np.asarray(adjacency_matrix)
    n_features = len(fields["selected_features"])
    n_pos = len(fields["input_tokens"])
    sources = n_features + (fields["num_layers"] + 1) * n_pos
    n = sources + len(fields["logit_tokens"])
    if matrix.ndim != 2 or matrix.shape != (n, n):
      raise ValueError(
          f"adjacency_matrix has shape {matrix.shape}, but the node tables"
          f" give {n} nodes ({n_features} features +"
          f" {fields['num_layers']} layers x {n_pos} positions errors +"
          f" {n_pos} tokens + {len(fields['logit_tokens'])} logits).")
    if matrix[n_features:sources].any() or matrix[:, sources:].any():
      raise ValueError(
          "adjacency_matrix has edges into error or token nodes, or out of"
          " logit nodes; an attribution graph has none (their rows and the"
          " logit columns must be zero).")
    targets = np.concatenate([np.arange(n_features), np.arange(sources, n)])
    return cls(**fields, edges=matrix[targets][:, :sources])

  def error_node(self, layer: int, position: int) -> int:
    """The node index of the error node at ``(layer, position)``."""
    if not (0 <= layer < self.num_layers and 0 <= position < self.n_pos):
      raise ValueError(
          f"no error node at layer {layer}, position {position}: the graph"
          f" has {self.num_layers} layers and {self.n_pos} positions.")
    return self.error_start + layer * self.n_pos + position

  def save(self, path) -> Path:
    """Writes the graph to one safetensors file (arrays, plus the scalar
    fields as JSON in its metadata, with ``logit_labels`` when a label is
    not empty: a file without them reads as all ``""``). Returns the
    path."""
    path = Path(path)
    meta = {"format": FORMAT, "version": FORMAT_VERSION,
            "num_layers": self.num_layers, "vocab_size": self.vocab_size}
    if any(self.logit_labels):  # Absent: every label "".
      meta["logit_labels"] = list(self.logit_labels)
    arrays = {name: np.ascontiguousarray(getattr(self, name))
              for name in _NAMES}
    tmp = path.with_name(path.name + ".tmp")
    save_file(arrays, str(tmp), metadata={_META_KEY: json.dumps(meta)})
    os.replace(tmp, path)
    return path

  @classmethod
  def load(cls, path) -> Graph:
    """Reads a graph written by `save` (no code is executed).

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: naming the file and field that is missing or malformed.
    """
    path = Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"{path} does not exist or is not a file.")
    try:
      with safe_open(str(path), framework="np") as f:
        metadata = f.metadata() or {}
        arrays = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
      raise ValueError(f"{path} is not a readable safetensors file: {e}"
                       ) from e
    meta = _read_meta(path, metadata)
    # Version 1 stored circuit-tracer's square matrix instead of edges.
    names = _NAMES if meta["version"] == FORMAT_VERSION else (
        *_NAMES[:-1], "adjacency_matrix")
    missing = sorted(set(names) - set(arrays))
    if missing:
      raise ValueError(f"{path} lacks the arrays {missing} of a {FORMAT}"
                       f" version {meta['version']}.")
    fields = {name: arrays[name] for name in names}
    if meta["version"] == 1:
      square = _checked_array(str(path), "adjacency_matrix",
                              fields.pop("adjacency_matrix"), np.float32, 2)
      for name, dtype, ndim in _ARRAYS[:-1]:
        _checked_array(str(path), name, fields[name], dtype, ndim)
      try:
        return cls.from_adjacency(adjacency_matrix=square, **fields,
                                  num_layers=meta["num_layers"],
                                  vocab_size=meta["vocab_size"])
      except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return _checked(str(path), fields, meta)


def _read_meta(path: Path, metadata: dict) -> dict:
  if _META_KEY not in metadata:
    raise ValueError(f"{path} has no {_META_KEY!r} metadata: it was not"
                     f" written by {FORMAT}.save.")
  try:
    meta = json.loads(metadata[_META_KEY])
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: metadata {_META_KEY!r} is not JSON: {e}"
                     ) from e
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ValueError(f"{path}: metadata {_META_KEY!r} does not describe a"
                     f" {FORMAT}.")
  if meta.get("version") not in (1, FORMAT_VERSION):
    raise ValueError(f"{path}: format version {meta.get('version')!r},"
                     f" this penzai_lm reads versions 1 and"
                     f" {FORMAT_VERSION}.")
  for key in ("num_layers", "vocab_size"):
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{path}: metadata field {key!r} must be a positive"
                       f" int, got {value!r}.")
  return meta


def _checked_array(where: str, name: str, value: np.ndarray, dtype,
                   ndim: int) -> np.ndarray:
  """``value``, if it has exactly ``dtype`` and ``ndim`` (files are not
  cast)."""
  if value.dtype != dtype or value.ndim != ndim:
    raise ValueError(f"{where}: {name} must be {np.dtype(dtype).name} with"
                     f" {ndim} dimensions, got {value.dtype} with shape"
                     f" {value.shape}.")
  return value


def _checked(where: str, fields: dict, meta: dict) -> Graph:
  for name, dtype, ndim in _ARRAYS:
    _checked_array(where, name, fields[name], dtype, ndim)
  try:
    return Graph(**fields, num_layers=meta["num_layers"],
                 vocab_size=meta["vocab_size"],
                 logit_labels=meta.get("logit_labels"))
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from e


def _check(graph: Graph, where: str) -> None:
  """Checks the tables against each other and the adjacency matrix."""
  for name, dtype, ndim in _ARRAYS:
    value = np.asarray(getattr(graph, name))
    if value.ndim != ndim or not np.can_cast(value.dtype, dtype,
                                             "same_kind"):
      raise ValueError(f"{where}: {name} must be {np.dtype(dtype).name} with"
                       f" {ndim} dimensions, got {value.dtype} with shape"
                       f" {value.shape}.")
    object.__setattr__(graph, name, value.astype(dtype, copy=False))
  n_active = len(graph.active_features)
  if graph.active_features.shape[1:] != (3,):
    raise ValueError(f"{where}: active_features must be [n_active, 3]"
                     f" (layer, position, feature), got"
                     f" {graph.active_features.shape}.")
  if graph.activation_values.shape != (n_active,):
    raise ValueError(f"{where}: activation_values has shape"
                     f" {graph.activation_values.shape}, expected"
                     f" ({n_active},) (one per active feature).")
  selected = graph.selected_features
  if selected.size and (selected.min() < 0 or selected.max() >= n_active
                        or np.any(np.diff(selected) <= 0)):
    raise ValueError(f"{where}: selected_features must be sorted, distinct"
                     f" indices into active_features [0, {n_active}).")
  if graph.logit_probabilities.shape != graph.logit_tokens.shape:
    raise ValueError(f"{where}: logit_probabilities has shape"
                     f" {graph.logit_probabilities.shape}, logit_tokens"
                     f" {graph.logit_tokens.shape}; they must match.")
  shape = (graph.n_features + graph.n_logits, graph.n_sources)
  if graph.edges.shape != shape:
    raise ValueError(
        f"{where}: edges has shape {graph.edges.shape}, but the node tables"
        f" give {shape}: rows for {graph.n_features} features +"
        f" {graph.n_logits} logits, columns for {graph.n_features} features"
        f" + {graph.num_layers} layers x {graph.n_pos} positions errors +"
        f" {graph.n_pos} tokens.")
