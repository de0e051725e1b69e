"""circuit-tracer 0.5's side of circuits_vs_circuit_tracer.py (a child process).

Runs in the virtualenv of ``setup_circuit_tracer.sh`` (transformers 4.57,
transformer_lens, torch), never in the project's. Offline throughout:

* the model: a local Hugging Face Llama directory (``config.json``,
  safetensors, ``tokenizer.json``). TransformerLens reads its config from
  the directory (``get_pretrained_model_config`` takes a local path and
  reads its ``architectures``; the path must not contain "llama", which
  sends TransformerLens down its hub-name branch), the weights go through
  TransformerLens' own ``convert_llama_weights``, and the
  `TransformerLensReplacementModel` is built as ``from_config`` builds it,
  with the weights loaded before the replacement hooks are installed
  (``from_config`` installs them at once, and
  ``from_pretrained_and_transcoders`` needs a hub name);
* the transcoders: the set's ``config.yaml`` with its ``transcoders`` paths
  made absolute, through circuit-tracer's own ``load_transcoders``; a
  cross-layer transcoder's directory (``model_kind:
  cross_layer_transcoder``) through its ``load_clt`` (``load_transcoders``
  would download it from the hub).

Then ``circuit_tracer.attribute`` (``--runs`` times, default twice: a cold
and a warm run), and circuit-tracer's ``prune_graph`` and
``compute_graph_scores`` on its graph. The peak RSS (``ru_maxrss``) and the
wall-clock time (``done_at``, seconds since the epoch) are taken right
after the scores, before anything is converted for the output. Writes one
safetensors file (arrays; the scalars as JSON metadata under "result"); no
pickle.

Usage (from circuits_vs_circuit_tracer.py and attribution_graphs.py):
  python circuit_tracer_child.py --model DIR --transcoders DIR/config.yaml
      --prompt 1,5,9 --out FILE [--max-n-logits 10] [--batch-size 512]
      [--max-feature-nodes N] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file
from transformer_lens.loading_from_pretrained import get_pretrained_model_config
from transformer_lens.pretrained.weight_conversions import llama as tl_llama
from transformers import LlamaForCausalLM
from transformers import PreTrainedTokenizerFast

from circuit_tracer import attribute
from circuit_tracer.graph import compute_graph_scores
from circuit_tracer.graph import prune_graph
from circuit_tracer.replacement_model.replacement_model_transformerlens import (
    TransformerLensReplacementModel)
from circuit_tracer.transcoder.cross_layer_transcoder import load_clt
from circuit_tracer.utils.hf_utils import load_transcoders


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_model(model_dir: Path, transcoder_config: Path):
  """The replacement model of the local Llama directory and transcoders
  (a set or a CLT), in float32 on the CPU."""
  config = yaml.safe_load(transcoder_config.read_text())
  cpu = dict(device=torch.device("cpu"), dtype=torch.float32,
             lazy_encoder=False, lazy_decoder=False)
  if config["model_kind"] == "cross_layer_transcoder":
    transcoders = load_clt(
        str(transcoder_config.parent.resolve()),
        feature_input_hook=config["feature_input_hook"],
        feature_output_hook=config["feature_output_hook"],
        scan=config["scan"], **cpu)
  else:
    config["transcoders"] = [str((transcoder_config.parent / p).resolve())
                             for p in config["transcoders"]]
    transcoders = load_transcoders(config, **cpu)
  hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  cfg = get_pretrained_model_config(str(model_dir), device="cpu",
                                    dtype=torch.float32)
  # TransformerLens' Llama branch leaves rotary_base at its default.
  cfg.rotary_base = float(hf.config.rope_theta)
  # The directory was written by transformers 5 (tokenizer_class
  # "TokenizersBackend", unknown to 4.57's AutoTokenizer): name the class.
  # add_bos_token=True keeps TransformerLens from reloading it.
  tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir,
                                                      add_bos_token=True)
  model = TransformerLensReplacementModel(cfg, tokenizer=tokenizer)
  model.load_and_process_state_dict(
      tl_llama.convert_llama_weights(hf, cfg), fold_ln=False,
      center_writing_weights=False, center_unembed=False,
      fold_value_biases=False, refactor_factored_attn_matrices=False)
  model._configure_replacement_model(transcoders)  # As from_config does.
  return model, hf


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", type=Path, required=True)
  parser.add_argument("--transcoders", type=Path, required=True)
  parser.add_argument("--prompt", required=True)
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--max-n-logits", type=int, default=10)
  parser.add_argument("--desired-logit-prob", type=float, default=0.95)
  parser.add_argument("--batch-size", type=int, default=512)
  parser.add_argument("--max-feature-nodes", type=int, default=None)
  parser.add_argument("--threads", type=int, default=0)
  parser.add_argument("--runs", type=int, default=2,
                      help="attribute calls (the graph is the last one's)")
  args = parser.parse_args()
  if args.runs < 1:
    parser.error(f"--runs must be at least 1, got {args.runs}.")
  if args.threads:
    torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  prompt = torch.tensor([int(t) for t in args.prompt.split(",")])
  model, hf = build_model(args.model, args.transcoders)
  with torch.no_grad():  # Cross-check TransformerLens against transformers.
    tl_logits = model(prompt[None])[0, -1]
    hf_logits = hf(prompt[None]).logits[0, -1]
  del hf
  rss_before = _rss_mb()
  times, cpu = [], []
  for _ in range(args.runs):
    start, start_cpu = time.perf_counter(), time.process_time()
    graph = attribute(prompt, model, max_n_logits=args.max_n_logits,
                      desired_logit_prob=args.desired_logit_prob,
                      batch_size=args.batch_size,
                      max_feature_nodes=args.max_feature_nodes)
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  pruned = prune_graph(graph)
  replacement, completeness = compute_graph_scores(graph)
  peak_rss, done_at = _rss_mb(), time.time()
  arrays = {
      "input_tokens": graph.input_tokens.to(torch.int32),
      "active_features": graph.active_features.to(torch.int32),
      "activation_values": graph.activation_values.float(),
      "selected_features": graph.selected_features.to(torch.int32),
      "logit_tokens": torch.tensor(
          [t.vocab_idx for t in graph.logit_targets], dtype=torch.int32),
      "logit_probabilities": graph.logit_probabilities.float(),
      "adjacency_matrix": graph.adjacency_matrix.float(),
      "node_mask": pruned.node_mask.to(torch.uint8),
      "edge_mask": pruned.edge_mask.to(torch.uint8),
      "cumulative_scores": pruned.cumulative_scores.float(),
  }
  result = {
      "replacement": replacement, "completeness": completeness,
      "seconds": times, "cpu_seconds": cpu, "rss_before_mb": rss_before,
      "peak_rss_mb": peak_rss, "done_at": done_at,
      "tl_vs_hf_max_abs_logit": float((tl_logits - hf_logits).abs().max()),
      "torch": torch.__version__, "threads": torch.get_num_threads(),
  }
  save_file({k: v.contiguous() for k, v in arrays.items()}, str(args.out),
            metadata={"result": json.dumps(result)})


if __name__ == "__main__":
  main()
