"""penzai_lm.circuits against circuit-tracer 0.5 on Gemma 2 and Gemma 3.

A small random Gemma 2 (post-attention and post-MLP norms, soft-capped
attention scores and logits, embeddings scaled by sqrt(hidden)) or Gemma 3
(post norms, query and key norms, local and global RoPE bases) is built
with transformers, every weight perturbed (so that the norms' gains are not
1), and saved as a Hugging Face directory with a word-level tokenizer
(``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, as Gemma's config numbers them).
Random per-layer transcoders are saved in circuit-tracer's layout reading
``mlp.hook_in`` (the pre-MLP norm's output, penzai_lm's ``mlp_in``) and
writing ``hook_mlp_out`` (after the post-MLP norm, penzai_lm's
``mlp_out``), by `circuits_vs_circuit_tracer.write_transcoders`.

* circuit-tracer: `benchmarks/peers/circuit_tracer_families_child.py` in
  the virtualenv of `benchmarks/peers/setup_circuit_tracer.sh`, with the
  TransformerLens backend (Gemma 2, Gemma 3) or the nnsight backend
  (Gemma 3);
* penzai_lm: `circuits_vs_circuit_tracer.py`'s own penzai_lm side
  (``--side penzai``: ``load_model``, ``load_transcoders``, ``attribute``
  twice, ``prune_graph``, ``compute_graph_scores``), a child process.

The table is `circuits_vs_circuit_tracer.compare`'s, plus the adjacency
without the token-embedding columns and the ratio of the token columns:
circuit-tracer's nnsight backend reads a token's gradient at
``embed_tokens``' output, which for Gemma 3 is already scaled by
sqrt(hidden), but dots it with the unscaled ``embed_tokens.weight`` row, so
its token edges are the model's divided by sqrt(hidden) (its
TransformerLens backend folds the scale into ``W_E``: no such factor).
circuit-tracer's nnsight backend does not import with the nnsight of the
peer virtualenv (0.8.1; circuit-tracer 0.5 imports
``nnsight.intervention.tracing``, gone there), so ``--backend nnsight``
stops with that error.

Gemma 3 on circuit-tracer's TransformerLens backend: its
``_deduplicate_attention_buffers`` gives every block the last block's RoPE
``rotary_sin`` / ``rotary_cos``, so with local and global layers of
different RoPE bases (real Gemma 3: 1e4 and 1e6) its model is no longer
Gemma 3 (the script prints its logits against transformers'). The
default here gives both kinds of layer one base (``--local-rope-base`` to
change it).

Not part of CI. Usage:
  bash benchmarks/peers/setup_circuit_tracer.sh   # once
  python benchmarks/circuits_families_vs_circuit_tracer.py
      [--family gemma2|gemma3] [--backend transformerlens|nnsight]
      [--activation relu] [--skip] [--layers 4] [--hidden 64]
      [--features 256] [--seq 8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers

from circuits_vs_circuit_tracer import PEER_PYTHON
from circuits_vs_circuit_tracer import _child
from circuits_vs_circuit_tracer import _read
from circuits_vs_circuit_tracer import compare
from circuits_vs_circuit_tracer import write_transcoders

HERE = Path(__file__).resolve().parent
PENZAI_SIDE = HERE / "circuits_vs_circuit_tracer.py"
CHILD = HERE / "peers/circuit_tracer_families_child.py"
SPECIAL = ("<pad>", "<eos>", "<bos>")  # ids 0, 1, 2 (BOS)


def hf_config(args):
  """The family's transformers config."""
  common = dict(
      vocab_size=args.vocab, hidden_size=args.hidden,
      intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      max_position_embeddings=128, sliding_window=args.window,
      initializer_range=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=2,
      tie_word_embeddings=True)
  if args.family == "gemma2":
    return transformers.Gemma2Config(
        **common, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
        final_logit_softcapping=args.final_softcap)
  kinds = ["sliding_attention", "full_attention"] * args.layers
  return transformers.Gemma3TextConfig(
      **common, query_pre_attn_scalar=16, rope_theta=args.rope_base,
      rope_local_base_freq=args.local_rope_base or args.rope_base,
      layer_types=kinds[:args.layers],
      final_logit_softcapping=None, attn_logit_softcapping=None)


def write_model(out: Path, args) -> None:
  """The random model (every weight perturbed) and a word-level
  tokenizer, as a Hugging Face directory."""
  torch.manual_seed(args.seed)
  config = hf_config(args)
  cls = (transformers.Gemma2ForCausalLM if args.family == "gemma2"
         else transformers.Gemma3ForCausalLM)
  model = cls(config).float().eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(out, safe_serialization=True)
  vocab = {t: i for i, t in enumerate(SPECIAL)}
  vocab.update({f"t{i}": i for i in range(len(SPECIAL), args.vocab)})
  core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "<pad>"))
  core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=core, unk_token="<pad>", bos_token="<bos>",
      eos_token="<eos>", pad_token="<pad>", add_bos_token=True)
  fast.save_pretrained(out)
  # transformers 4.57 (the peer's) knows neither 5's "TokenizersBackend"
  # nor its "rope_parameters" (it would take its default RoPE bases).
  _update_json(out / "tokenizer_config.json",
               tokenizer_class="PreTrainedTokenizerFast")
  if args.family == "gemma3":
    _update_json(out / "config.json", rope_theta=args.rope_base,
                 rope_local_base_freq=args.local_rope_base or args.rope_base)
  else:
    _update_json(out / "config.json", rope_theta=10000.0)


def _update_json(path: Path, **entries) -> None:
  path.write_text(json.dumps({**json.loads(path.read_text()), **entries},
                             indent=2))


def token_rows(ours: dict, theirs: dict, hidden: int) -> list:
  """Rows for the adjacency without the token columns, and the token
  columns' ratio."""
  a, b = ours["adjacency_matrix"], theirs["adjacency_matrix"]
  if a.shape != b.shape:
    return []
  n_logits, n_pos = len(theirs["logit_tokens"]), len(theirs["input_tokens"])
  tokens = np.arange(len(a) - n_logits - n_pos, len(a) - n_logits)
  rest = np.setdiff1d(np.arange(len(a)), tokens)
  scale = np.abs(b[:, rest]).max()
  rel = np.abs(a[:, rest] - b[:, rest]).max() / scale
  rows = [("adjacency without token columns, max |diff| / max |A|",
           f"{rel:.2e}", rel < 1e-4)]
  mask = np.abs(b[:, tokens]) > 1e-3 * np.abs(b[:, tokens]).max()
  ratio = a[:, tokens][mask] / b[:, tokens][mask]
  rows.append(("token columns: penzai_lm / circuit-tracer",
               f"{np.median(ratio):.4f} (min {ratio.min():.4f}, max"
               f" {ratio.max():.4f}); sqrt(hidden) = {hidden ** 0.5:.4f}",
               bool(np.allclose(ratio, 1, rtol=1e-3))))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--family", choices=("gemma2", "gemma3"),
                      default="gemma2")
  parser.add_argument("--backend", choices=("transformerlens", "nnsight"),
                      default="transformerlens")
  parser.add_argument("--activation", choices=("relu", "jumprelu"),
                      default="jumprelu")
  parser.add_argument("--skip", action="store_true",
                      help="transcoders with skip connections")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--features", type=int, default=256)
  parser.add_argument("--seq", type=int, default=8)
  parser.add_argument("--window", type=int, default=4,
                      help="sliding window of the local layers")
  parser.add_argument("--rope-base", type=float, default=1e4,
                      help="Gemma 3's RoPE base (global layers)")
  parser.add_argument("--local-rope-base", type=float, default=None,
                      help="Gemma 3's RoPE base of the local layers (default:"
                      " --rope-base; circuit-tracer's TransformerLens model"
                      " gives every layer one layer's RoPE tables)")
  parser.add_argument("--final-softcap", type=float, default=3.0,
                      help="Gemma 2's final logit soft-cap")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-n-logits", type=int, default=10)
  parser.add_argument("--batch-size", type=int, default=512)
  parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
  parser.add_argument("--keep", type=Path, default=None)
  args = parser.parse_args()
  if args.family == "gemma2" and args.backend == "nnsight":
    sys.exit("circuit-tracer's nnsight mapping for Gemma 2 has no"
             " mlp.hook_in (only ln2.hook_normalized, before the norm's"
             " gain): use --backend transformerlens.")
  if not args.peer_python.exists():
    sys.exit(f"{args.peer_python} not found: run"
             " `bash benchmarks/peers/setup_circuit_tracer.sh` first.")
  rng = np.random.default_rng(args.seed + 2)
  prompt = ",".join(map(str, [2, *rng.integers(3, args.vocab,
                                               args.seq - 1)]))
  with tempfile.TemporaryDirectory() as tmp:
    tmp = args.keep or Path(tmp)
    model_dir, tc_dir = tmp / f"tiny-{args.family}", tmp / "transcoders"
    model_dir.mkdir(parents=True, exist_ok=True)
    tc_dir.mkdir(exist_ok=True)
    write_model(model_dir, args)
    config = write_transcoders(tc_dir, args)
    common = ["--model", str(model_dir), "--transcoders", str(config),
              "--prompt", prompt, "--max-n-logits", str(args.max_n_logits),
              "--batch-size", str(args.batch_size)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    _child([str(args.peer_python), str(CHILD), "--backend", args.backend,
            *common, "--out", str(tmp / "theirs.safetensors")], env)
    _child([sys.executable, str(PENZAI_SIDE), "--side", "penzai", *common,
            "--out", str(tmp / "ours.safetensors")], env)
    theirs, their_result = _read(tmp / "theirs.safetensors")
    ours, our_result = _read(tmp / "ours.safetensors")
  rows = compare(ours, theirs) + token_rows(ours, theirs, args.hidden)
  _print(args, prompt, rows, our_result, their_result)


def _print(args, prompt, rows, ours: dict, theirs: dict) -> None:
  bases = (f", RoPE bases {args.rope_base:g} / "
           f"{args.local_rope_base or args.rope_base:g}"
           if args.family == "gemma3" else "")
  print(f"Random {args.family}: {args.layers} blocks, width {args.hidden},"
        f" vocab {args.vocab}, window {args.window}{bases}; {args.activation}"
        f" transcoders, {args.features} features"
        f"{', skip' if args.skip else ''}; prompt {prompt}; circuit-tracer's"
        f" {args.backend} backend")
  print(f"circuit-tracer's model vs transformers, last logits: max abs diff"
        f" {theirs['tl_vs_hf_max_abs_logit']:.2e}")
  for name in ("replacement", "completeness"):
    diff = abs(ours[name] - theirs[name])
    rows.append((f"{name} score", f"{ours[name]:.6f} vs {theirs[name]:.6f}"
                 f" ({diff:.1e})", diff < 1e-4))
  width = max(len(r[0]) for r in rows)
  print(f"\n{'check':<{width}}  {'measured':<60} same")
  for what, measured, ok in rows:
    print(f"{what:<{width}}  {measured:<60} {'yes' if ok else 'NO'}")
  print(f"\n{'side':<28} {'cold s':>8} {'warm s':>8} {'peak RSS MB':>12}")
  for side, r in (("penzai_lm (jax " + ours["jax"] + ")", ours),
                  (f"circuit-tracer 0.5 ({args.backend})", theirs)):
    print(f"{side:<28} {r['seconds'][0]:>8.2f} {r['seconds'][1]:>8.2f}"
          f" {r['peak_rss_mb']:>12.0f}")


if __name__ == "__main__":
  main()
