"""Attribution graphs (circuit tracing) with transcoders, as circuit-tracer.

`attribute(model, transcoders, prompt)` builds a prompt's `Graph` (for the
salient logits, given token ids or `CustomTarget` directions): the
direct effects between active transcoder features, error nodes, token
embeddings and logits in the prompt's local replacement model
(`penzai_lm.circuits.replacement`); `prune_graph` and
`compute_graph_scores` prune and score it as circuit-tracer 0.5 does;
`graph_json` / `save_graph_files` write it for Neuronpedia's graph viewer
(circuit-tracer's ``create_graph_files`` schema), `graph_html` as one
self-contained page (also ``penzai-lm graph``).
"""

from penzai_lm.circuits.attribute import attribute
from penzai_lm.circuits.graph import Graph
from penzai_lm.circuits.graph_page import graph_html
from penzai_lm.circuits.graph_page import save_graph_html
from penzai_lm.circuits.neuronpedia import GraphExport
from penzai_lm.circuits.neuronpedia import export_graph
from penzai_lm.circuits.neuronpedia import graph_json
from penzai_lm.circuits.neuronpedia import save_graph_files
from penzai_lm.circuits.neuronpedia import save_graph_json
from penzai_lm.circuits.prune import PruneResult
from penzai_lm.circuits.prune import compute_graph_scores
from penzai_lm.circuits.prune import prune_graph
from penzai_lm.circuits.qk import QKAttribution
from penzai_lm.circuits.qk import QKContribution
from penzai_lm.circuits.qk import qk_attribution
from penzai_lm.circuits.qk_terms import QKTerms
from penzai_lm.circuits.replacement import LinearizedModel
from penzai_lm.circuits.replacement import linearize
from penzai_lm.circuits.targets import CustomTarget
from penzai_lm.circuits.targets import salient_logits

__all__ = [
    "CustomTarget",
    "Graph",
    "GraphExport",
    "LinearizedModel",
    "PruneResult",
    "QKAttribution",
    "QKContribution",
    "QKTerms",
    "attribute",
    "compute_graph_scores",
    "export_graph",
    "graph_html",
    "graph_json",
    "linearize",
    "prune_graph",
    "qk_attribution",
    "salient_logits",
    "save_graph_files",
    "save_graph_html",
    "save_graph_json",
]
