"""A pruned attribution graph as one self-contained HTML page.

`graph_html(graph)` draws the nodes and links of `export_graph` (the graph
pruned as circuit-tracer prunes it: `graph_json`'s nodes and links) as an
SVG, with a short inline script and inline CSS: no network, no external
file, so the page opens from disk.

Layout: one column per prompt position (its token below it); rows from the
bottom: the token embeddings, then one row per layer (its features and
error nodes), then the logits. Dots are sized by influence (the more
influential, the larger: ``1 - influence`` of `graph_json`, a logit by its
probability); features are orange circles, errors grey squares, tokens
grey bars, logits green circles. Links are lines whose width grows with
``|weight|`` (relative to the largest), red for positive, blue for
negative. Hovering a node shows its label; clicking it lists its incoming
and outgoing links (largest ``|weight|`` first, 12 each) in the side panel
and highlights them; clicking the background clears the selection.

The DOM is part of the contract (the tests read it): each node is an SVG
element ``[data-node="<i>"]`` (``i`` its position in the exported node
list; ``data-node-id`` its ``node_id``, which need not be unique), each
link a ``line[data-link]``; the panel ``#info`` holds ``data-node`` of the
selected node, its label in ``#info-title``, and tables ``#incoming`` and
``#outgoing`` with one row per link shown (``data-node``: the node at the
other end), whose headers ``#incoming-count`` / ``#outgoing-count`` give
the full counts.

Text from the vocabulary (tokens, the prompt) reaches the page as JSON in
the data block, with ``<``, ``>`` and ``&`` escaped, put into the DOM as
text (``textContent``), never as markup; and the prompt HTML-escaped in
the title and heading.
"""

from __future__ import annotations

from collections.abc import Mapping
import html
import json
import os
from pathlib import Path

import numpy as np

from penzai_lm.circuits.graph import Graph
from penzai_lm.circuits.neuronpedia import GraphExport
from penzai_lm.circuits.neuronpedia import export_graph
from penzai_lm.file_access import write_atomic
from penzai_lm.tokenizer import Tokenizer

_STYLE = """
body { font-family: system-ui, sans-serif; font-size: 13px; margin: 8px; }
#main { display: flex; gap: 12px; align-items: flex-start; }
#plot { overflow: auto; border: 1px solid #ddd; flex: 1 1 auto; }
#info { width: 340px; flex: 0 0 auto; }
#info table { border-collapse: collapse; width: 100%; }
#info td { padding: 1px 4px; font-family: monospace; cursor: pointer; }
#info tr:hover { background: #eee; }
.pos { color: #b2182b; } .neg { color: #2166ac; }
line { stroke-opacity: 0.45; }
line.dim { stroke-opacity: 0.06; } line.on { stroke-opacity: 0.95; }
[data-node] { cursor: pointer; stroke: #333; stroke-width: 0.5; }
[data-node].sel { stroke: #000; stroke-width: 2.5; }
.axis { fill: #555; font-size: 11px; }
"""

_SCRIPT = r"""
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const data = JSON.parse(document.getElementById("graph-data").textContent);
  const nodes = data.nodes, meta = data.metadata;
  nodes.forEach((n, i) => { n.index = i; });
  const links = data.links.map(([s, t, w]) => ({s: nodes[s], t: nodes[t], w}));
  const rowOf = n => n.layer === "E" ? 0 :
      n.feature_type === "logit" ? Number(n.layer) : Number(n.layer) + 1;
  const nRows = nodes.reduce((m, n) => Math.max(m, rowOf(n)), 1) + 1;
  const nCols = meta.prompt_tokens.length;
  const cells = new Map();  // "col,row" -> nodes
  for (const n of nodes) {
    const key = n.ctx_idx + "," + rowOf(n);
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(n);
  }
  const colWidth = Array.from({length: nCols}, () => 70);
  for (const [key, list] of cells) {
    const col = Number(key.split(",")[0]);
    colWidth[col] = Math.max(colWidth[col], 14 * list.length + 16);
  }
  const left = 60, rowH = 70, top = 20;
  const colX = [left];
  for (const w of colWidth) colX.push(colX[colX.length - 1] + w);
  const height = top + nRows * rowH + 40;
  for (const [key, list] of cells) {
    const [col, row] = key.split(",").map(Number);
    list.forEach((n, i) => {
      n.x = colX[col] + 8 + (i + 0.5) * (colWidth[col] - 16) / list.length;
      n.y = top + (nRows - 1 - row + 0.5) * rowH;
    });
  }
  function label(n) {
    const pos = " @" + n.ctx_idx + " " + JSON.stringify(
        meta.prompt_tokens[n.ctx_idx]);
    if (n.feature_type === "logit") return n.clerp;
    if (n.feature_type === "embedding") return "Token" + pos;
    if (n.feature_type === "mlp reconstruction error")
      return "Error L" + n.layer + pos;
    return "Feature L" + n.layer + " #" + n.node_id.split("_")[1] + pos;
  }
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", colX[nCols]);
  svg.setAttribute("height", height);
  const el = (tag, attrs, parent) => {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    parent.appendChild(e);
    return e;
  };
  for (let r = 0; r < nRows; r++) {
    const name = r === 0 ? "Emb" : r === nRows - 1 ? "Logit" : "L" + (r - 1);
    el("text", {x: 4, y: top + (nRows - 1 - r + 0.5) * rowH + 4,
                class: "axis"}, svg).textContent = name;
  }
  meta.prompt_tokens.forEach((t, c) => {
    el("text", {x: colX[c] + 4, y: height - 12, class: "axis"},
       svg).textContent = JSON.stringify(t);
  });
  const maxW = links.reduce((m, l) => Math.max(m, Math.abs(l.w)), 1e-30);
  const linkEls = links.map(({s, t, w}) =>
    el("line", {x1: s.x, y1: s.y, x2: t.x, y2: t.y, "data-link": "",
                stroke: w >= 0 ? "#d6604d" : "#4393c3",
                "stroke-width": 0.4 + 3.6 * Math.abs(w) / maxW}, svg));
  const nodeEls = new Map();
  nodes.forEach((n, i) => {
    const size = n.influence === null ? 3 + 6 * n.token_prob :
        3 + 6 * Math.max(0, 1 - n.influence);
    let e;
    if (n.feature_type === "embedding" || n.feature_type.includes("error")) {
      const h = n.feature_type === "embedding" ? size : 2 * size;
      e = el("rect", {x: n.x - size, y: n.y - h / 2, width: 2 * size,
                      height: h, fill: "#bbb"}, svg);
    } else {
      e = el("circle", {cx: n.x, cy: n.y, r: size, fill:
                        n.feature_type === "logit" ? "#5aae61" : "#f4a582"},
             svg);
    }
    e.setAttribute("data-node", i);
    e.setAttribute("data-node-id", n.node_id);
    el("title", {}, e).textContent = label(n);
    e.addEventListener("click", ev => { ev.stopPropagation(); select(n); });
    nodeEls.set(n, e);
  });
  svg.addEventListener("click", () => select(null));
  document.getElementById("plot").appendChild(svg);

  function fill(tableId, list, other) {
    const table = document.getElementById(tableId);
    table.replaceChildren();
    document.getElementById(tableId + "-count").textContent =
        (tableId === "incoming" ? "Incoming" : "Outgoing") + " links: " +
        list.length;
    list.sort((a, b) => Math.abs(b.w) - Math.abs(a.w));
    for (const l of list.slice(0, 12)) {
      const tr = table.insertRow();
      const w = tr.insertCell();
      w.textContent = (l.w >= 0 ? "+" : "") + l.w.toPrecision(3);
      w.className = l.w >= 0 ? "pos" : "neg";
      tr.insertCell().textContent = label(l[other]);
      tr.setAttribute("data-node", l[other].index);
      tr.addEventListener("click", ev => {
        ev.stopPropagation(); select(l[other]);
      });
    }
  }
  function select(n) {
    const info = document.getElementById("info");
    for (const e of nodeEls.values()) e.classList.remove("sel");
    links.forEach((l, i) => {
      const on = n !== null && (l.s === n || l.t === n);
      linkEls[i].setAttribute("class", n === null ? "" : on ? "on" : "dim");
    });
    if (n === null) {
      info.removeAttribute("data-node");
      document.getElementById("info-title").textContent = "Click a node";
      document.getElementById("info-details").textContent = "";
      for (const id of ["incoming", "outgoing"]) {
        document.getElementById(id).replaceChildren();
        document.getElementById(id + "-count").textContent = "";
      }
      return;
    }
    nodeEls.get(n).classList.add("sel");
    info.setAttribute("data-node", n.index);
    document.getElementById("info-title").textContent = label(n);
    const parts = [n.feature_type, "node " + n.node_id];
    if (n.activation !== null)
      parts.push("activation " + n.activation.toPrecision(4));
    if (n.influence !== null)
      parts.push("influence " + n.influence.toPrecision(3));
    document.getElementById("info-details").textContent = parts.join(" | ");
    fill("incoming", links.filter(l => l.t === n), "s");
    fill("outgoing", links.filter(l => l.s === n), "t");
  }
  document.getElementById("summary").textContent =
      nodes.length + " nodes, " + links.length + " links (node threshold " +
      meta.node_threshold + "); links red positive, blue negative;" +
      " click a node for its links";
  select(null);
})();
"""


def _data_block(export: GraphExport) -> str:
  """The page's data (nodes, links as ``[source, target, weight]`` node
  positions) as JSON safe inside a ``<script>`` element."""
  data = {"metadata": export.metadata, "nodes": export.nodes,
          "links": [[s, t, w] for (s, t), w in zip(export.links.tolist(),
                                                  export.weights.tolist())]}
  text = json.dumps(data, allow_nan=False)  # ASCII: U+2028 escaped too.
  return (text.replace("&", "\\u0026").replace("<", "\\u003c")
          .replace(">", "\\u003e"))


def export_html(export: GraphExport) -> str:
  """The page of an exported graph (`export_graph`)."""
  prompt = html.escape(str(export.metadata.get("prompt", "")))
  return (
      "<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
      f"<title>Attribution graph: {prompt}</title><style>{_STYLE}</style>"
      "</head><body>"
      f"<h2>Attribution graph</h2><p id=\"prompt\">{prompt}</p>"
      "<p id=\"summary\"></p><div id=\"main\"><div id=\"plot\"></div>"
      "<div id=\"info\"><h3 id=\"info-title\"></h3><p id=\"info-details\">"
      "</p><h4 id=\"incoming-count\"></h4><table id=\"incoming\"></table>"
      "<h4 id=\"outgoing-count\"></h4><table id=\"outgoing\"></table></div>"
      "</div><script type=\"application/json\" id=\"graph-data\">"
      f"{_data_block(export)}</script><script>{_SCRIPT}</script>"
      "</body></html>\n")


def json_html(data: Mapping) -> str:
  """The page of a graph JSON object (`graph_json`'s, or a file of
  circuit-tracer's ``create_graph_files``). A link names its nodes by
  id: where two nodes share an id (see `neuronpedia`), the first is
  drawn with the links.

  Raises:
    ValueError: if ``data`` is not a graph JSON object (``metadata`` with
      ``prompt_tokens``, ``nodes`` with ``node_id``, ``links`` between
      them).
  """
  try:
    nodes = list(data["nodes"])
    first = {}
    for i, n in enumerate(nodes):
      first.setdefault(n["node_id"], i)
    links = np.array([[first[l["source"]], first[l["target"]]]
                      for l in data["links"]], np.int64).reshape(-1, 2)
    weights = np.array([float(l["weight"]) for l in data["links"]],
                       np.float32)
    metadata = dict(data["metadata"])
    if not isinstance(metadata["prompt_tokens"], list):
      raise TypeError("prompt_tokens is not a list")
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"data is not a graph JSON object (metadata with"
                     f" prompt_tokens, nodes with node_id, links between"
                     f" them), as graph_json returns: {e!r}.") from e
  return export_html(GraphExport(metadata, nodes, links, weights))


def graph_html(graph: Graph, *, tokenizer: Tokenizer | None = None,
               node_threshold: float = 0.8, edge_threshold: float = 0.98,
               prompt: str | None = None) -> str:
  """The graph, pruned with the thresholds, as a self-contained HTML page
  (module docstring).

  Args:
    graph: The attribution graph.
    tokenizer: Decodes the tokens (else they show as ids).
    node_threshold: `prune_graph`'s node threshold.
    edge_threshold: `prune_graph`'s edge threshold.
    prompt: The prompt's text shown (None: decoded from the tokens).

  Raises:
    ValueError: as `graph_json`.
  """
  return export_html(export_graph(
      graph, tokenizer=tokenizer, node_threshold=node_threshold,
      edge_threshold=edge_threshold, prompt=prompt))


def save_graph_html(graph: Graph, path: str | os.PathLike, **kwargs) -> Path:
  """Writes `graph_html` (same keyword arguments) to ``path`` atomically;
  returns the path."""
  path = Path(path)
  write_atomic(path, graph_html(graph, **kwargs).encode())
  return path
