"""``penzai-lm graph``: a saved attribution graph as files people can open.

    penzai-lm graph prompt.safetensors --html prompt.html
    penzai-lm graph prompt.safetensors --json prompt.json --scan gemma-2-2b
    penzai-lm graph prompt.safetensors --folder graphs/ --tokenizer model.gguf

Reads a graph written by `Graph.save` and writes, pruned with the
thresholds as circuit-tracer prunes: ``--json``, Neuronpedia's graph JSON
(`neuronpedia.graph_json`); ``--folder``, circuit-tracer's
``create_graph_files`` output (``<slug>.json`` and ``graph-metadata.json``,
which its local server serves); ``--html``, the self-contained page
(`graph_html`). ``--tokenizer`` (a GGUF file or a Hugging Face directory)
shows tokens as text instead of ids. The graph is pruned once for all
outputs. `penzai_lm.cli` defines the command's arguments and imports this
module only when the command runs (the circuits package and what it
imports are not needed to generate or chat).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys

from penzai_lm.circuits.graph import Graph
from penzai_lm.circuits.graph_page import export_html
from penzai_lm.circuits.neuronpedia import check_slug
from penzai_lm.circuits.neuronpedia import dumps
from penzai_lm.circuits.neuronpedia import export_graph
from penzai_lm.circuits.neuronpedia import write_graph_files
from penzai_lm.file_access import write_atomic
from penzai_lm.tokenizer import Tokenizer

def _tokenizer(path: Path | None) -> Tokenizer | None:
  if path is None:
    return None
  if path.is_dir():
    return Tokenizer.from_hf(path)
  if path.is_file():
    return Tokenizer.from_gguf(path)
  raise FileNotFoundError(f"--tokenizer {path} does not exist; give a GGUF"
                          " file or a Hugging Face directory.")


def run_graph_command(args: argparse.Namespace) -> int:
  """Writes the requested files; returns the exit code (0).

  Raises:
    ValueError: for no output, a bad slug, scan or threshold, or a file
      that is not a graph.
    FileNotFoundError: for a missing graph or tokenizer.
  """
  if args.json is None and args.html is None and args.folder is None:
    raise ValueError("nothing to write: give --json FILE, --folder FOLDER"
                     " and/or --html FILE.")
  slug = args.slug if args.slug is not None else Path(args.graph).stem
  try:
    check_slug(slug)
  except ValueError as e:
    raise ValueError(f"{e} Give one with --slug.") from e
  graph = Graph.load(args.graph)
  options = dict(tokenizer=_tokenizer(args.tokenizer), scan=args.scan,
                 node_threshold=args.node_threshold,
                 edge_threshold=args.edge_threshold, prompt=args.prompt,
                 distinct_error_ids=args.distinct_error_ids)
  export = export_graph(graph, slug=slug, **options)
  summary = f"{len(export.nodes)} nodes, {len(export.links)} links"
  if args.json is not None:
    write_atomic(args.json, dumps(export.to_json()))
    print(f"[wrote {args.json}: {summary}]", file=sys.stderr)
  if args.folder is not None:
    path = write_graph_files(export, args.folder)
    print(f"[wrote {path}: {summary}]", file=sys.stderr)
  if args.html is not None:
    write_atomic(args.html, export_html(export).encode())
    print(f"[wrote {args.html}: {summary}]", file=sys.stderr)
  return 0
