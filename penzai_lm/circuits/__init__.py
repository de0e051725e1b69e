"""Attribution graphs (circuit tracing) with transcoders, as circuit-tracer.

`attribute(model, transcoders, prompt)` builds a prompt's `Graph`: the
direct effects between active transcoder features, error nodes, token
embeddings and logits in the prompt's local replacement model
(`penzai_lm.circuits.replacement`); `prune_graph` and
`compute_graph_scores` prune and score it as circuit-tracer 0.5 does.
"""

from penzai_lm.circuits.attribute import attribute
from penzai_lm.circuits.attribute import salient_logits
from penzai_lm.circuits.graph import Graph
from penzai_lm.circuits.prune import PruneResult
from penzai_lm.circuits.prune import compute_graph_scores
from penzai_lm.circuits.prune import prune_graph
from penzai_lm.circuits.replacement import LinearizedModel
from penzai_lm.circuits.replacement import linearize

__all__ = [
    "Graph",
    "LinearizedModel",
    "PruneResult",
    "attribute",
    "compute_graph_scores",
    "linearize",
    "prune_graph",
    "salient_logits",
]
