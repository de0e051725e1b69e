"""Nine interpretability tasks in penzai_lm and in TransformerLens 3.9.

Issue 40's "Why" tasks, side by side on the same weights in float32:
penzai_lm loads the GGUF file; transformers dequantizes the same file and
TransformerLens converts that model with its default processing
(``benchmarks/peers/transformerlens_models.py``, offline). Token ids come
from penzai_lm's tokenizer on both sides. The SAE is random (ReLU, 4x
expansion, at ``blocks.12.resid_post``): penzai_lm writes it in SAELens's
format and each side loads that directory (``sae.load_sae`` and SAELens's
``SAE.load_from_disk``, TransformerLens's SAE library). Causal tracing's
noise is drawn once and given to both sides, so the sweeps are comparable.

Tasks: (1) ``dashboard``: a feature's top activating tokens, frequency and
promoted logits over 8 texts; (2) ``sae_steering``: one feature clamped at
three strengths (one row each) while generating 12 greedy tokens; (3)
``sae_metrics``: explained variance and CE loss recovered on 4 windows of
64 tokens (penzai_lm's convention: position 0 left alone); (4) ``dla``:
direct logit attribution per head (logit diff " Paris" - " Rome"); (5)
``tracing``: ROME causal tracing (noised subject, mlp_out restored over a
window of 10 blocks, every 5th block x every position, 3 samples); (6)
``losses``: per-token loss of a steered model on two ragged texts; (7)
``patterns``: every block's attention pattern; (8) ``ig``: integrated
gradients of the logit diff on the input embeddings (16 steps); (9)
``dla_gemma3``: task 4 on Gemma 3 270M (penzai_lm's cached GGUF;
TransformerLens has Gemma 3 270M's config built in).

Per task: lines of each side's user code (the task function's body, and
the helpers it names, without docstring, comments and blank lines), the
first call's time (compilation included for penzai_lm), the median of
``--repeats`` more, and the agreement (max |diff| of the numbers, or
equal tokens). Both tools at their defaults on the CPU (torch's default
threads). Not part of CI.

Usage:
  python benchmarks/interp_vs_transformerlens.py [--repeats 3] [--tasks a,b]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
import sae_lens
import torch

import penzai_lm
from penzai_lm import interp
from penzai_lm import sae

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
from peers import transformerlens_models
from peers.common import TEXT
from peers.side_by_side import cpu_name
from peers.side_by_side import lines_of
from peers.side_by_side import load_average
from peers.side_by_side import max_diff
from peers.side_by_side import timed
# pylint: enable=g-import-not-at-top,wrong-import-position

MODEL = "smollm2-135m-instruct"
CLEAN = "The Eiffel Tower is in the city of"
LAYER = 12
POINT, HOOK = f"blocks.{LAYER}.resid_post", f"blocks.{LAYER}.hook_resid_post"
FEATURES, FEATURE, K = 4 * 576, 7, 5
STRENGTHS, NEW = [0.0, 50.0, 100.0], 12
SUBJECT, SAMPLES, WINDOW = [1, 2, 3, 4], 3, 10
TRACE_LAYERS = list(range(0, 30, 5))
STEPS = 16
LOSS_TEXTS = ["The Eiffel Tower is in Paris, the capital of France.",
              "Water boils at one hundred degrees Celsius at sea level."]


def _random_sae(d: int) -> sae.SparseAutoencoder:
  """A ReLU SAE at ``POINT`` whose features fire on about half the tokens."""
  rng = np.random.default_rng(0)
  arrays = {"w_enc": rng.standard_normal((d, FEATURES)) / np.sqrt(d),
            "b_enc": 0.1 * rng.standard_normal(FEATURES),
            "w_dec": rng.standard_normal((FEATURES, d)) / np.sqrt(FEATURES),
            "b_dec": 0.1 * rng.standard_normal(d)}
  config = sae.SAEConfig(activation="relu", num_features=FEATURES,
                         input_axes=(("embedding", d),),
                         output_axes=(("embedding", d),),
                         apply_b_dec_to_input=True, hook_point=POINT)
  return sae.SparseAutoencoder.from_arrays(
      config, **{k: v.astype(np.float32) for k, v in arrays.items()})


class Setup:
  """Both models, the SAE on both sides and the shared inputs."""

  def __init__(self, name=MODEL, tl_builder=transformerlens_models.smollm2,
               with_sae=True):
    t = time.perf_counter()
    self.model, self.tok = penzai_lm.load(name)
    self.load_ours = time.perf_counter() - t
    t = time.perf_counter()
    hf, hf_tok = transformerlens_models.hf_model(name)
    self.tl = tl_builder(hf, hf_tok)
    del hf
    self.load_theirs = time.perf_counter() - t
    self.config = self.model.config
    self.ids = self.tok.encode(CLEAN)
    self.paris = self.tok.token_id(" Paris")
    self.rome = self.tok.token_id(" Rome")
    logits = self.tl(torch.tensor([self.ids]))[0, -1].detach()
    self.logit_diff = float(logits[self.paris] - logits[self.rome])
    if not with_sae:
      return
    d = self.config.hidden_size
    self.autoencoder = _random_sae(d)
    directory = sae.save_sae(self.autoencoder,
                             os.path.join(tempfile.mkdtemp(), "sae"))
    self.sae_lens = sae_lens.SAE.load_from_disk(str(directory)).eval()
    texts = [TEXT[i:i + 240] for i in range(0, 8 * 240, 240)]
    self.texts = [self.tok.encode(t) for t in texts]
    corpus = self.tok.encode(TEXT)
    self.windows = np.asarray(corpus[:4 * 64]).reshape(4, 64)
    self.loss_rows = [self.tok.encode(t) for t in LOSS_TEXTS]
    rng = np.random.default_rng(1)
    direction = rng.standard_normal(d)
    self.direction = (direction / np.linalg.norm(direction) * 4).astype(
        np.float32)
    table = interp.weights(self.model, "embed.W_E")
    noise = interp.GaussianNoise(SUBJECT, samples=SAMPLES).noise(
        self.model, table, len(self.ids))
    self.noise = torch.tensor(np.asarray(
        noise.unwrap("noise", "seq", "embedding")))
    torch.set_grad_enabled(False)  # As TransformerLens's demos start.


# ------------------------------------------------------------ penzai_lm


def ours_dashboard(s):
  board = sae.dashboard(s.model, s.autoencoder, s.texts, features=[FEATURE],
                        tokenizer=s.tok, k=K)
  card = board.cards[0]
  return ([(e.prompt, e.position, e.activation) for e in card.examples],
          card.frequency, [t for t, _ in card.top_logits])


def ours_sae_steering(s):
  spliced = sae.splice(s.model, s.autoencoder)
  edit = sae.FeatureEdit.clamp(s.autoencoder, [FEATURE], STRENGTHS,
                               where="generated")
  steered = interp.insert_at(spliced, f"{POINT}.sae.features", edit)
  return penzai_lm.generate(steered, [s.ids] * len(STRENGTHS),
                            max_new_tokens=NEW, temperature=0.0,
                            stop_tokens=[]).tokens


def ours_sae_metrics(s):
  m = sae.evaluate_sae(s.model, s.autoencoder, s.windows)
  return [m.explained_variance, m.ce_clean, m.ce_spliced, m.ce_zero_ablated,
          m.ce_recovered]


def ours_dla(s):
  stack = interp.decompose_resid(s.model, s.ids, per_head=True)
  normed = interp.apply_final_norm(s.model, stack)
  effects = interp.logit_attribution(s.model, normed, s.paris, s.rome)
  return dict(zip(normed.labels,
                  np.asarray(effects.unwrap("component", "batch"))[:, 0]))


def ours_tracing(s):
  result = interp.patching_sweep(
      s.model, s.ids, corrupt=interp.GaussianNoise(SUBJECT, samples=SAMPLES),
      point="mlp_out", window=WINDOW, layers=TRACE_LAYERS,
      metric=interp.AnswerProb(s.paris))
  return result.values


def ours_losses(s):
  steered = interp.insert_at(s.model, POINT,
                             interp.AddVector.build(s.direction, 8.0))
  return interp.token_losses(steered, s.loss_rows)


def ours_patterns(s):
  names = [f"blocks.{i}.attn.pattern" for i in range(s.config.num_layers)]
  cache = interp.run_with_cache(s.model, s.ids, names=names)
  heads = [a for a in cache[names[0]].named_shape
           if a not in ("batch", "seq", "kv_seq")]  # Hugging Face order.
  return np.stack([np.asarray(cache[n][{"batch": 0}].unwrap(
      *heads, "seq", "kv_seq")).reshape(-1, len(s.ids), len(s.ids))
                   for n in names])


def _logit_diff(model, embeddings, paris, rome):
  logits = interp.logits_from_embeddings(model, embeddings)[{"seq": -1}]
  diff = logits[{"vocabulary": paris}] - logits[{"vocabulary": rome}]
  return diff.unwrap("batch").sum()


_logit_diff_grad = jax.jit(jax.grad(_logit_diff, argnums=1))


def ours_ig(s):
  embeddings = interp.embed(s.model, pz.nx.wrap(jnp.asarray(s.ids)).tag("seq"))
  alphas = pz.nx.wrap(jnp.linspace(0.0, 1.0, STEPS + 1)[1:]).tag("batch")
  grads = _logit_diff_grad(s.model, embeddings * alphas, s.paris, s.rome)
  mean = np.asarray(grads.unwrap("batch", "seq", "embedding")).mean(0)
  return (np.asarray(embeddings.unwrap("seq", "embedding")) * mean).sum(-1)


# ------------------------------------------------------- TransformerLens


def theirs_dashboard(s):
  acts = []
  for ids in s.texts:
    _, cache = s.tl.run_with_cache(torch.tensor([ids]), names_filter=HOOK)
    acts.append(s.sae_lens.encode(cache[HOOK][0])[:, FEATURE])
  flat = torch.cat(acts)
  where = [(p, t) for p, a in enumerate(acts) for t in range(len(a))]
  top = flat.topk(K)
  examples = []
  for value, i in zip(top.values.tolist(), top.indices.tolist()):
    p, t = where[i]
    context = s.tl.to_str_tokens(torch.tensor(s.texts[p][max(0, t - 8):t + 5]))
    examples.append((p, t, value, context))
  promoted = (s.sae_lens.W_dec[FEATURE] @ s.tl.W_U).topk(10).indices
  return ([e[:3] for e in examples], float((flat > 0).float().mean()),
          s.tl.to_str_tokens(promoted))


def theirs_sae_steering(s):
  strengths = torch.tensor(STRENGTHS)

  def clamp(x, hook):
    if x.shape[1] > 1:  # The prompt: only generated tokens are clamped.
      return x
    feats = s.sae_lens.encode(x)
    error = x - s.sae_lens.decode(feats)
    feats[:, :, FEATURE] = strengths[:, None]
    return s.sae_lens.decode(feats) + error

  with s.tl.hooks(fwd_hooks=[(HOOK, clamp)]):
    out = s.tl.generate(torch.tensor([s.ids] * len(STRENGTHS)),
                        max_new_tokens=NEW, do_sample=False,
                        stop_at_eos=False, verbose=False)
  return out[:, len(s.ids):].tolist()


def theirs_sae_metrics(s):
  tokens = torch.tensor(s.windows)

  def splice(x, hook):
    x[:, 1:] = s.sae_lens(x[:, 1:])  # Position 0 (the sink) left alone.
    return x

  def zero(x, hook):
    x[:, 1:] = 0.0
    return x

  ce = [s.tl.run_with_hooks(tokens, return_type="loss", loss_per_token=True,
                            fwd_hooks=hooks)[:, 1:].mean().item()
        for hooks in ([], [(HOOK, splice)], [(HOOK, zero)])]
  _, cache = s.tl.run_with_cache(tokens, names_filter=HOOK)
  x = cache[HOOK][:, 1:].reshape(-1, s.tl.cfg.d_model)
  explained = 1 - ((s.sae_lens(x) - x) ** 2).sum() / ((x - x.mean(0)) ** 2
                                                        ).sum()
  return [explained.item(), *ce, (ce[2] - ce[1]) / (ce[2] - ce[0])]


def theirs_dla(s):
  _, cache = s.tl.run_with_cache(torch.tensor([s.ids]))
  stack, labels = cache.get_full_resid_decomposition(
      expand_neurons=False, apply_ln=True, pos_slice=-1, return_labels=True)
  direction = (s.tl.tokens_to_residual_directions(s.paris)
               - s.tl.tokens_to_residual_directions(s.rome))
  return dict(zip(labels, (stack[:, 0] @ direction).tolist()))


def theirs_tracing(s):
  tokens = torch.tensor([s.ids] * SAMPLES)
  _, clean = s.tl.run_with_cache(tokens[:1],
                                 names_filter=lambda n: "mlp_out" in n)
  n_layers = s.tl.cfg.n_layers
  values = np.zeros((len(TRACE_LAYERS), len(s.ids)))
  for i, layer in enumerate(TRACE_LAYERS):
    near = range(max(0, layer - WINDOW // 2),
                 min(n_layers, layer + (WINDOW - 1) // 2 + 1))
    for p in range(len(s.ids)):
      def restore(x, hook, p=p):
        x[:, p] = clean[hook.name][0, p]
        return x
      hooks = [("hook_embed", lambda x, hook: x + s.noise)]
      hooks += [(f"blocks.{l}.hook_mlp_out", restore) for l in near]
      logits = s.tl.run_with_hooks(tokens, fwd_hooks=hooks)[:, -1]
      values[i, p] = logits.softmax(-1)[:, s.paris].mean().item()
  return values


def theirs_losses(s):
  add = lambda x, hook: x + 8.0 * torch.tensor(s.direction)
  return [s.tl.run_with_hooks(torch.tensor([row]), return_type="loss",
                              loss_per_token=True,
                              fwd_hooks=[(HOOK, add)])[0].numpy()
          for row in s.loss_rows]


def theirs_patterns(s):
  _, cache = s.tl.run_with_cache(torch.tensor([s.ids]),
                                 names_filter=lambda n: "pattern" in n)
  return torch.stack([cache["pattern", l][0]
                      for l in range(s.tl.cfg.n_layers)]).numpy()


def theirs_ig(s):
  embeddings = s.tl.embed(torch.tensor([s.ids]))[0]
  alphas = torch.linspace(0.0, 1.0, STEPS + 1)[1:, None, None]
  path = (alphas * embeddings).requires_grad_()
  with torch.enable_grad():
    logits = s.tl(path, start_at_layer=0)[:, -1]
    (logits[:, s.paris] - logits[:, s.rome]).sum().backward()
  return (embeddings * path.grad.mean(0)).sum(-1).numpy()


# ----------------------------------------------------------- comparison


def _dashboard(a, b) -> str:
  same = [e[:2] for e in a[0]] == [e[:2] for e in b[0]]
  acts = max_diff([e[2] for e in a[0]], [e[2] for e in b[0]])
  return (f"top {K} tokens {'same' if same else 'DIFFER'}, activations"
          f" {acts}; frequency {a[1]:.4f} / {b[1]:.4f}; promoted tokens"
          f" {len(set(a[2]) & set(b[2]))} of {len(b[2])} shared (TL's W_U"
          " has the final norm's weight folded in)")


def _dla(a, b, s) -> str:
  """Heads, MLPs and embeddings matched by name (TransformerLens: ``L3H2``,
  ``3_mlp_out``, ``embed``); its ``bias`` term is zero for Llama."""
  ours = {}
  for label, value in a.items():
    parts = label.split(".")
    if label == "embed":
      ours["embed"] = value
    elif parts[-1].startswith("head"):
      ours[f"L{parts[1]}H{parts[-1][4:]}"] = value
    elif parts[-1] == "mlp_out":
      ours[f"{parts[1]}_mlp_out"] = value
  matched = sorted(set(ours) & set(b))
  diff = max(abs(ours[k] - b[k]) for k in matched)
  return (f"{len(matched)} terms matched, max diff {diff:.1e}; sums"
          f" {sum(a.values()):.4f} / {sum(b.values()):.4f} (the model's logit"
          f" diff {s.logit_diff:.4f})")


def _equal(a, b) -> str:
  return "tokens equal" if a == b else f"DIFFER: {a!r} vs {b!r}"


# task -> agreement(ours, theirs, setup) -> text.
AGREEMENT = {
    "dashboard": lambda a, b, s: _dashboard(a, b),
    "sae_steering": lambda a, b, s: _equal(a, b),
    "sae_metrics": lambda a, b, s: (
        f"{max_diff(a, b)}; EV {a[0]:.4f}/{b[0]:.4f}, CE recovered"
        f" {a[4]:.4f}/{b[4]:.4f}"),
    "dla": _dla,
    "tracing": lambda a, b, s: max_diff(a, b),
    "losses": lambda a, b, s: max_diff(a, b),
    "patterns": lambda a, b, s: max_diff(a, b),
    "ig": lambda a, b, s: max_diff(a, b),
    "dla_gemma3": _dla,
}
HELPERS = {"ig": [_logit_diff, "_logit_diff_grad = jax.jit(...)"]}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--tasks", default=",".join(AGREEMENT))
  args = parser.parse_args()
  tasks = args.tasks.split(",")
  unknown = sorted(set(tasks) - set(AGREEMENT))
  if unknown:
    parser.error(f"unknown tasks {unknown}; tasks: {','.join(AGREEMENT)}")
  print(load_average())
  print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC;"
        f" CPU {cpu_name()} ({os.cpu_count()} cores); torch"
        f" {torch.__version__} ({torch.get_num_threads()} threads),"
        f" TransformerLens {importlib.metadata.version('transformer_lens')},"
        f" SAELens {importlib.metadata.version('sae_lens')}, JAX"
        f" {jax.__version__}")
  setups = {}
  rows = []
  for task in tasks:
    gemma = task == "dla_gemma3"
    key = "gemma3" if gemma else "smollm2"
    if key not in setups:
      setups[key] = (Setup("gemma3-270m", transformerlens_models.gemma3,
                           with_sae=False) if gemma else Setup())
      print(f"{key} load: penzai_lm {setups[key].load_ours:.1f} s,"
            f" transformers + TransformerLens"
            f" {setups[key].load_theirs:.1f} s", flush=True)
    s = setups[key]
    base = "dla" if gemma else task
    ours, theirs = globals()[f"ours_{base}"], globals()[f"theirs_{base}"]
    a, first_a, med_a = timed(ours, s, args.repeats)
    b, first_b, med_b = timed(theirs, s, args.repeats)
    rows.append(f"| {task} | {lines_of(ours, HELPERS.get(base, ()))} |"
                f" {lines_of(theirs)} | {first_a:.2f} / {first_b:.2f} |"
                f" {med_a:.3f} | {med_b:.3f} | {AGREEMENT[task](a, b, s)} |")
    print(rows[-1], flush=True)
  print(f"\nMedian of {args.repeats} after one warm-up call, seconds.\n")
  print("| task | lines penzai_lm | lines TL | first call s (ours / TL) |"
        " median s penzai_lm | median s TL | agreement |")
  print("|---|---|---|---|---|---|---|")
  print("\n".join(rows))
  print(load_average())


if __name__ == "__main__":
  main()
