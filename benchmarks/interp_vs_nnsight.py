"""Ten interpretability tasks in penzai_lm and in nnsight, side by side.

The same SmolLM2-135M-Instruct weights on both sides, in float32: penzai_lm
loads the GGUF file, transformers dequantizes the same file (as the parity
tests do), and nnsight wraps that transformers model. Token ids come from
penzai_lm's tokenizer on both sides, so every task sees the same inputs.

Per task the table gives the lines of code of each side's function (its
body without docstring, comments and blank lines: what a user writes), the
wall time of the first call (compilation included for penzai_lm) and the
median of ``--rounds`` more, and how far the two results agree (max
absolute difference of the numbers, or whether the generated texts are
equal).

Tasks: a plain forward pass (last-token logits; the other side is plain
torch under ``no_grad``, not nnsight), ablation (two heads of block 10,
last-token logits), captures while generating (resid_post of 3 blocks over
16 greedy tokens), batched steering
(3 rows at strengths 0/4/8 in one generate call), logit lens (30 blocks,
last token), patching sweep (resid_pre, every block x position),
attribution patching (the same cells from gradients), linear probe (mean
resid_post of 8 ragged prompts, least squares), control-vector interop (a
`ControlVector` over 6 blocks; nnsight adds the same vectors), patched chat
(two steered turns), treescope display (rendering the model).

nnsight and torch are not test dependencies: install the ``peers`` extra
(``pip install -e .[peers]``) to run this. Not part of CI.

Usage:
  python benchmarks/interp_vs_nnsight.py [--rounds 3] [--tasks a,b]
      [--torch-threads N]  (default: every core, as JAX uses)
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
import torch
import treescope

import penzai_lm
from penzai_lm import interp
from penzai_lm.fetch import resolve_model_path

MODEL = "smollm2-135m-instruct"
CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
HEADS, ABLATE_LAYER, STEER_LAYER, NEW = (1, 3), 10, 12, 16
LENS_LAYERS = (3, 14, 28)
LOVE = ["I love you", "I love this", "Love is wonderful", "I adore it"]
HATE = ["I hate you", "I hate this", "Hate is terrible", "I despise it"]
# transformers' greedy settings with no stop token (penzai_lm: stop_tokens=[]).
GREEDY = dict(do_sample=False, top_k=None, top_p=None, eos_token_id=None,
              pad_token_id=0)
QUESTIONS = ["How was your day?", "What do you think of Mondays?"]


class Setup:
  """Both models and the shared inputs."""

  def __init__(self):
    import nnsight  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    t = time.perf_counter()
    self.model, self.tok = penzai_lm.load(MODEL)
    self.load_ours = time.perf_counter() - t
    path = resolve_model_path(MODEL)
    t = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name)
    self.nn = nnsight.TransformersModel(hf, tokenizer=hf_tok,
                                        task="text-generation")
    self.load_theirs = time.perf_counter() - t
    self.hf = hf
    self.config = self.model.config
    self.ids = self.tok.encode(CLEAN)
    self.corrupt = self.tok.encode(CORRUPT)
    assert len(self.ids) == len(self.corrupt)
    self.paris = self.tok.encode(" Paris")[0]
    self.rome = self.tok.encode(" Rome")[0]
    rng = np.random.default_rng(0)
    direction = rng.standard_normal(self.config.hidden_size)
    self.direction = (direction / np.linalg.norm(direction) * 4).astype(
        np.float32)
    self.cv = interp.ControlVector(directions={
        i: (rng.standard_normal(self.config.hidden_size) * 0.5).astype(
            np.float32) for i in range(10, 16)})


# ------------------------------------------------------------ penzai_lm


def ours_forward(s):
  tokens = pz.nx.wrap(jnp.asarray(s.ids)).tag("seq")
  return np.asarray(s.model(tokens)[{"seq": -1}].unwrap("vocabulary"))


def ours_ablation(s):
  patched = interp.insert_at(s.model, f"blocks.{ABLATE_LAYER}.attn.head_out",
                             interp.Ablate.heads(s.config, list(HEADS)))
  tokens = pz.nx.wrap(jnp.asarray(s.ids)).tag("seq")
  return np.asarray(patched(tokens)[{"seq": -1}].unwrap("vocabulary"))


def ours_captures(s):
  names = [f"blocks.{i}.resid_post" for i in LENS_LAYERS]
  result = penzai_lm.generate(s.model, [s.ids], max_new_tokens=NEW,
                              temperature=0.0, stop_tokens=[], capture=names)
  caps = [np.asarray(result.captures[n][0].unwrap("seq", "embedding"))
          for n in names]
  return result.tokens[0], caps


def ours_steering(s):
  steered = interp.insert_at(s.model, f"blocks.{STEER_LAYER}.resid_post",
                             interp.AddVector.build(s.direction, [0, 4, 8]))
  return penzai_lm.generate(steered, [s.ids] * 3, max_new_tokens=NEW,
                            temperature=0.0, stop_tokens=[]).tokens


def ours_lens(s):
  names = [f"blocks.{i}.resid_post" for i in range(s.config.num_layers)]
  cache = interp.run_with_cache(s.model, s.ids, names=names)
  resid = pz.nx.stack([cache[n][{"batch": 0, "seq": -1}] for n in names],
                      "layer")
  lens = interp.unembed(s.model, resid)
  return np.asarray(jax.nn.log_softmax(lens.unwrap("layer", "vocabulary")))


def ours_sweep(s):
  result = interp.patching_sweep(s.model, s.ids, s.corrupt,
                                 metric=interp.LogitDiff(s.paris, s.rome))
  return result.values


def ours_attribution(s):
  result = interp.attribution_patching(
      s.model, s.ids, s.corrupt, interp.LogitDiff(s.paris, s.rome),
      names=["resid_pre"])
  return result.values("resid_pre")


def ours_probe(s):
  point = f"blocks.{STEER_LAYER}.resid_post"
  cache = interp.run_with_cache(s.model, [s.tok.encode(p) for p in LOVE + HATE],
                                names=[point])
  x = np.stack([np.asarray(cache.row(r, point).unwrap("seq", "embedding"))
                .mean(0) for r in range(len(LOVE + HATE))])
  y = np.array([1.0] * len(LOVE) + [-1.0] * len(HATE))
  w = np.linalg.lstsq(np.c_[x, np.ones(len(x))], y, rcond=None)[0]
  return x, w


def ours_control_vector(s):
  return penzai_lm.generate(s.cv.apply(s.model, 2.0), [s.ids],
                            max_new_tokens=NEW, temperature=0.0,
                            stop_tokens=[]).tokens[0]


def ours_chat(s):
  steered = interp.insert_at(s.model, f"blocks.{STEER_LAYER}.resid_post",
                             interp.AddVector.build(s.direction, 2.0))
  chat = penzai_lm.ChatSession(steered, s.tok, system="Be brief.")
  return [chat.reply(q, max_new_tokens=24, temperature=0.0)
          for q in QUESTIONS]


def ours_treescope(s):
  return len(treescope.render_to_text(s.model))


# --------------------------------------------------------------- nnsight


def theirs_forward(s):
  with torch.no_grad():  # Plain torch: what nnsight's trace wraps.
    return s.hf(torch.tensor([s.ids])).logits[0, -1].numpy()


def theirs_ablation(s):
  d = s.config.head_dim
  with s.nn.trace(torch.tensor([s.ids])):
    o_proj = s.nn.model.layers[ABLATE_LAYER].self_attn.o_proj
    x = o_proj.input.clone()
    for h in HEADS:
      x[..., h * d:(h + 1) * d] = 0
    o_proj.input = x
    logits = s.nn.output.logits[0, -1].save()
  return logits.detach().numpy()


def theirs_captures(s):
  import nnsight  # pylint: disable=g-import-not-at-top
  with s.nn.generate(torch.tensor([s.ids]), max_new_tokens=NEW,
                     **GREEDY) as tracer:
    steps = nnsight.save([])
    for _ in tracer.iter[:NEW]:
      steps.append([s.nn.model.layers[i].output[0] for i in LENS_LAYERS])
    out = tracer.result.save()
  caps = [torch.cat([st[k] for st in steps]).numpy()
          for k in range(len(LENS_LAYERS))]
  return out[0, len(s.ids):].tolist(), caps


def theirs_steering(s):
  add = torch.tensor([0.0, 4.0, 8.0])[:, None, None] * torch.tensor(
      s.direction)
  with s.nn.generate(torch.tensor([s.ids] * 3), max_new_tokens=NEW,
                     **GREEDY) as tracer:
    for _ in tracer.iter[:NEW]:
      layer = s.nn.model.layers[STEER_LAYER]
      layer.output = layer.output + add
    out = tracer.result.save()
  return out[:, len(s.ids):].tolist()


def theirs_lens(s):
  with s.nn.trace(torch.tensor([s.ids])):
    resid = torch.stack([layer.output[0, -1] for layer in s.nn.model.layers]
                        ).save()
  with torch.no_grad():
    logits = s.hf.lm_head(s.hf.model.norm(resid))
  return torch.log_softmax(logits, -1).numpy()


def theirs_sweep(s):
  layers, seq = s.nn.model.layers, len(s.ids)
  with s.nn.trace(torch.tensor([s.ids])):
    clean = torch.stack([layer.input for layer in layers]).save()
  values = np.zeros((len(layers), seq))
  for l in range(len(layers)):
    with s.nn.trace(torch.tensor([s.corrupt] * seq)):
      x = layers[l].input.clone()
      for p in range(seq):
        x[p, p] = clean[l][0, p]
      layers[l].input = x
      logits = s.nn.output.logits[:, -1].save()
    values[l] = (logits[:, s.paris] - logits[:, s.rome]).detach().numpy()
  return values


def theirs_attribution(s):
  layers = s.nn.model.layers
  with s.nn.trace(torch.tensor([s.ids])):
    clean = torch.stack([layer.input for layer in layers]).save()
  with s.nn.trace(torch.tensor([s.corrupt])):
    acts = [layer.input for layer in layers]
    corrupted = torch.stack(acts).save()
    logits = s.nn.output.logits
    metric = logits[0, -1, s.paris] - logits[0, -1, s.rome]
    with metric.backward():
      grads = torch.stack([acts[l].grad for l in reversed(range(len(layers)))]
                          ).flip(0).save()
  return ((clean - corrupted) * grads).sum(-1)[:, 0].detach().numpy()


def theirs_probe(s):
  feats = []
  for p in LOVE + HATE:
    with s.nn.trace(torch.tensor([s.tok.encode(p)])):
      h = s.nn.model.layers[STEER_LAYER].output[0].mean(0).save()
    feats.append(h.detach().numpy())
  x = np.stack(feats)
  y = np.array([1.0] * len(LOVE) + [-1.0] * len(HATE))
  w = np.linalg.lstsq(np.c_[x, np.ones(len(x))], y, rcond=None)[0]
  return x, w


def theirs_control_vector(s):
  with s.nn.generate(torch.tensor([s.ids]), max_new_tokens=NEW,
                     **GREEDY) as tracer:
    for _ in tracer.iter[:NEW]:
      for i, v in s.cv.directions.items():
        layer = s.nn.model.layers[i]
        layer.output = layer.output + 2.0 * torch.tensor(v)
    out = tracer.result.save()
  return out[0, len(s.ids):].tolist()


def theirs_chat(s):
  import nnsight  # pylint: disable=g-import-not-at-top
  messages, replies = [{"role": "system", "content": "Be brief."}], []
  for q in QUESTIONS:
    messages.append({"role": "user", "content": q})
    ids = s.tok.encode_chat(messages)
    with s.nn.generate(torch.tensor([ids]), max_new_tokens=24,
                       do_sample=False, top_k=None, top_p=None,
                       eos_token_id=list(s.tok.stop_ids)) as tracer:
      # Code after an open-ended loop does not run: keep each step's token.
      new = nnsight.save([])
      for _ in tracer.all():
        layer = s.nn.model.layers[STEER_LAYER]
        layer.output = layer.output + 2.0 * torch.tensor(s.direction)
        new.append(s.nn.lm_head.output[0, -1].argmax().item())
    new = new[:next((i for i, t in enumerate(new) if t in s.tok.stop_ids),
                    len(new))]
    replies.append(s.tok.decode(new))
    messages.append({"role": "assistant", "content": replies[-1]})
  return replies


def theirs_treescope(s):
  return len(str(s.nn))


# ----------------------------------------------------------- comparison


def _max_diff(a, b) -> str:
  """Max |a - b| over the rows both have (a generation's captures: the
  last generated token is fed on one side only), and relative to max |b|
  (residual streams reach hundreds at the first token)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  n = min(a.shape[0], b.shape[0])
  diff = np.abs(a[:n] - b[:n]).max()
  return (f"max |diff| {diff:.1e} (relative"
          f" {diff / max(1.0, np.abs(b[:n]).max()):.1e})")


def _captures(a, b) -> str:
  diffs = [_max_diff(x, y) for x, y in zip(a[1], b[1])]
  rows = [f"{len(x)}/{len(y)}" for x, y in zip(a[1], b[1])]
  return (f"tokens {_equal(a[0], b[0])}; captures ({rows[0]} tokens):"
          f" {max(diffs, key=lambda d: float(d.split()[2]))}")


def _equal(a, b) -> str:
  return "equal" if a == b else f"DIFFER: {a!r} vs {b!r}"


AGREEMENT = {
    "forward": _max_diff,
    "ablation": _max_diff,
    "captures": _captures,
    "steering": _equal,
    "lens": _max_diff,
    "sweep": _max_diff,
    "attribution": _max_diff,
    "probe": lambda a, b: f"features {_max_diff(a[0], b[0])}",
    "control_vector": _equal,
    "chat": _equal,
    "treescope": lambda a, b: f"{a} vs {b} characters",
}


def lines_of(fn) -> int:
  source = inspect.getsource(fn).splitlines()[1:]  # Without the def line.
  return sum(1 for line in source
             if line.strip() and not line.strip().startswith("#"))


def timed(fn, s, rounds):
  t = time.perf_counter()
  out = fn(s)
  first = time.perf_counter() - t
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    fn(s)
    times.append(time.perf_counter() - t)
  return out, first, statistics.median(times) if times else first


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--tasks", default=",".join(AGREEMENT))
  parser.add_argument("--torch-threads", type=int, default=os.cpu_count(),
                      help="torch's intra-op threads (JAX uses every core)")
  args = parser.parse_args()
  torch.set_num_threads(args.torch_threads)
  print(subprocess.run(["uptime"], capture_output=True, text=True,
                       check=False).stdout.strip())
  s = Setup()
  print(f"load: penzai_lm {s.load_ours:.1f} s, transformers + nnsight"
        f" {s.load_theirs:.1f} s")
  header = (f"{'task':<15} {'lines ours/nns':>14} {'first s ours/nns':>17}"
            f" {'median s ours/nns':>18}  agreement")
  print(header)
  for task in args.tasks.split(","):
    ours, theirs = globals()[f"ours_{task}"], globals()[f"theirs_{task}"]
    a, first_a, med_a = timed(ours, s, args.rounds)
    b, first_b, med_b = timed(theirs, s, args.rounds)
    print(f"{task:<15} {lines_of(ours):>6}/{lines_of(theirs):<7}"
          f" {first_a:>8.2f}/{first_b:<8.2f} {med_a:>8.2f}/{med_b:<9.2f}"
          f" {AGREEMENT[task](a, b)}", flush=True)
  print(subprocess.run(["uptime"], capture_output=True, text=True,
                       check=False).stdout.strip())


if __name__ == "__main__":
  main()
