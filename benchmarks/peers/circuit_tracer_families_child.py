"""circuit-tracer 0.5's side of circuits_families_vs_circuit_tracer.py.

A child process in the virtualenv of ``setup_circuit_tracer.sh``
(transformers 4.57, transformer_lens, nnsight, torch), offline throughout.
The model is a local Hugging Face Gemma 2 or Gemma 3 directory:

* ``--backend transformerlens`` (Gemma 2, Gemma 3): TransformerLens keys
  Gemma configs on the official hub names, so the `HookedTransformerConfig`
  is written here from the directory's ``config.json`` (as TransformerLens
  writes it for google/gemma-2-* and google/gemma-3-1b: RMS norms before and
  after attention and MLP, soft-caps, ``attn_scale = sqrt(
  query_pre_attn_scalar)``, query and key norms for Gemma 3), the weights go
  through TransformerLens' own ``convert_gemma_weights`` (which folds
  Gemma's ``sqrt(d_model)`` embedding scale into ``W_E`` and adds 1 to the
  norm weights), and the `TransformerLensReplacementModel` is built as
  ``from_config`` builds it, the weights loaded first;
* ``--backend nnsight`` (Gemma 3): circuit-tracer's own
  ``NNSightReplacementModel.from_pretrained_and_transcoders`` on the
  directory.

The transcoders: the set's ``config.yaml`` with its ``transcoders`` paths
made absolute, through circuit-tracer's ``load_transcoders``. Then
``attribute`` (twice: cold and warm), ``prune_graph`` and
``compute_graph_scores``; one safetensors file out (the scalars as JSON
metadata under "result"), the keys of `circuit_tracer_child.py`.

Usage (from circuits_families_vs_circuit_tracer.py):
  python circuit_tracer_families_child.py --backend transformerlens
      --model DIR --transcoders DIR/config.yaml --prompt 2,5,9 --out FILE
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
from transformer_lens import HookedTransformerConfig
from transformer_lens.pretrained.weight_conversions.gemma import (
    convert_gemma_weights)
from transformers import AutoModelForCausalLM
from transformers import PreTrainedTokenizerFast

from circuit_tracer import attribute
from circuit_tracer.graph import compute_graph_scores
from circuit_tracer.graph import prune_graph
from circuit_tracer.replacement_model.replacement_model_transformerlens import (
    TransformerLensReplacementModel)
from circuit_tracer.utils.hf_utils import load_transcoders

try:  # circuit-tracer 0.5's nnsight backend needs nnsight 0.6-0.7's layout.
  from circuit_tracer.replacement_model.replacement_model_nnsight import (
      NNSightReplacementModel)
  NNSIGHT_ERROR = None
except ImportError as e:
  NNSightReplacementModel, NNSIGHT_ERROR = None, e


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tl_config(hf_config) -> HookedTransformerConfig:
  """TransformerLens' Gemma 2 / Gemma 3 config for a local directory."""
  c = hf_config
  gemma3 = c.model_type.startswith("gemma3")
  kinds = getattr(c, "layer_types", None) or [
      "sliding_attention" if (i + 1) % 2 else "full_attention"
      for i in range(c.num_hidden_layers)]
  cfg = dict(
      d_model=c.hidden_size, d_head=c.head_dim,
      n_heads=c.num_attention_heads, d_mlp=c.intermediate_size,
      n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings,
      eps=c.rms_norm_eps, d_vocab=c.vocab_size, act_fn="gelu_pytorch_tanh",
      normalization_type="RMS", positional_embedding_type="rotary",
      rotary_dim=c.head_dim, rotary_base=float(c.rope_theta),
      use_attn_scale=True, attn_scale=float(c.query_pre_attn_scalar) ** 0.5,
      n_key_value_heads=c.num_key_value_heads, window_size=c.sliding_window,
      use_local_attn=True,
      attn_types=["local" if k == "sliding_attention" else "global"
                  for k in kinds],
      gated_mlp=True, final_rms=True,
      use_normalization_before_and_after=True,
      original_architecture=("Gemma3ForCausalLM" if gemma3
                             else "Gemma2ForCausalLM"),
      tokenizer_prepends_bos=True, device="cpu", dtype=torch.float32)
  if c.attn_logit_softcapping:
    cfg["attn_scores_soft_cap"] = float(c.attn_logit_softcapping)
  if c.final_logit_softcapping:
    cfg["output_logits_soft_cap"] = float(c.final_logit_softcapping)
  if gemma3:
    cfg.update(use_qk_norm=True,
               rotary_base_local=float(c.rope_local_base_freq))
  return HookedTransformerConfig(**cfg)


def build_model(backend: str, model_dir: Path, transcoder_config: Path):
  """(replacement model, transformers model) in float32 on the CPU."""
  config = yaml.safe_load(transcoder_config.read_text())
  config["transcoders"] = [str((transcoder_config.parent / p).resolve())
                           for p in config["transcoders"]]
  transcoders = load_transcoders(config, device=torch.device("cpu"),
                                 dtype=torch.float32, lazy_encoder=False,
                                 lazy_decoder=False)
  hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                            attn_implementation="eager")
  if backend == "nnsight":
    if NNSIGHT_ERROR is not None:
      raise SystemExit("circuit-tracer's nnsight backend does not import in"
                       f" this virtualenv: {NNSIGHT_ERROR!r}")
    model = NNSightReplacementModel.from_pretrained_and_transcoders(
        str(model_dir), transcoders, device="cpu", dtype=torch.float32)
    return model, hf
  cfg = tl_config(hf.config)
  tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir,
                                                      add_bos_token=True)
  model = TransformerLensReplacementModel(cfg, tokenizer=tokenizer)
  model.load_and_process_state_dict(
      convert_gemma_weights(hf, cfg), fold_ln=False,
      center_writing_weights=False, center_unembed=False,
      fold_value_biases=False, refactor_factored_attn_matrices=False)
  model._configure_replacement_model(transcoders)  # As from_config does.
  return model, hf


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--backend", choices=("transformerlens", "nnsight"),
                      required=True)
  parser.add_argument("--model", type=Path, required=True)
  parser.add_argument("--transcoders", type=Path, required=True)
  parser.add_argument("--prompt", required=True)
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--max-n-logits", type=int, default=10)
  parser.add_argument("--desired-logit-prob", type=float, default=0.95)
  parser.add_argument("--batch-size", type=int, default=512)
  parser.add_argument("--max-feature-nodes", type=int, default=None)
  args = parser.parse_args()
  torch.manual_seed(0)
  prompt = torch.tensor([int(t) for t in args.prompt.split(",")])
  model, hf = build_model(args.backend, args.model, args.transcoders)
  with torch.no_grad():  # The replacement model against transformers.
    if args.backend == "nnsight":
      with model.trace(prompt[None]):
        peer = model.output.logits.save()
      peer_logits = peer[0, -1]
    else:
      peer_logits = model(prompt[None])[0, -1]
    hf_logits = hf(prompt[None]).logits[0, -1]
  del hf
  rss_before = _rss_mb()
  times, cpu = [], []
  for _ in range(2):
    start, start_cpu = time.perf_counter(), time.process_time()
    graph = attribute(prompt, model, max_n_logits=args.max_n_logits,
                      desired_logit_prob=args.desired_logit_prob,
                      batch_size=args.batch_size,
                      max_feature_nodes=args.max_feature_nodes)
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  pruned = prune_graph(graph)
  replacement, completeness = compute_graph_scores(graph)
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
      "peak_rss_mb": _rss_mb(),
      "tl_vs_hf_max_abs_logit": float((peer_logits - hf_logits).abs().max()),
      "backend": args.backend,
      "torch": torch.__version__, "threads": torch.get_num_threads(),
  }
  save_file({k: v.contiguous().cpu() for k, v in arrays.items()},
            str(args.out), metadata={"result": json.dumps(result)})


if __name__ == "__main__":
  main()
