"""Interpretability tools on the real checkpoints against transformers.

Each test does the same thing twice, once with penzai_lm's tools (captures,
interventions, the logit lens, saliency) and once by hand on the Hugging Face
model loaded from the same GGUF file (forward hooks / pre-hooks on the
matching ``torch.nn`` modules, ``output_hidden_states``,
``output_attentions`` with eager attention, autograd), and compares.

Tolerances. Logits and attention weights: absolute 1e-3. Activations whose
size varies with the model (the residual stream, Gemma's in particular, MLP
neurons, head outputs): the max absolute difference divided by
``max(1, max |reference|)`` must stay under 1e-3 (absolute for values up to
1, relative to the largest entry above that). Saliency gradients: the max
absolute difference divided by the largest |gradient| under 1e-3.

Run with ``-s`` to see a table of the measured differences at the end.
"""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import penzai_lm  # pylint: disable=g-import-not-at-top
from penzai_lm import interp  # pylint: disable=g-import-not-at-top
from tests import real_models  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.slow

MODELS = real_models.NAMES
CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"  # Same token count, both models.
TOL = 1e-3
NEW_TOKENS = 8

# Per model:
# * layer: the block to steer; layers: blocks whose activations are compared;
# * ablate_layer, heads: the heads to zero (Hugging Face order), chosen so
#   that HF's greedy continuation changes at a decode step (2nd token for
#   SmolLM2, 4th for Gemma), not only in the prefill; SmolLM2's two heads are
#   in different key/value groups. Along HF's ablated and steered greedy
#   paths the top-2 logit gap is at least 0.029, far above the ~1e-4
#   differences, so the token comparisons are not decided by rounding;
# * patch_layer, patch_pos: where activation patching replaces resid_pre
#   (the last token of the subject, which differs between the prompts).
SETTINGS = {
    "smollm2-135m-instruct": dict(
        layer=3, layers=(0, 3, 14, 28), ablate_layer=3, heads=(1, 3),
        patch_layer=6, patch_pos=3),
    "gemma3-270m": dict(
        layer=3, layers=(0, 3, 9, 16), ablate_layer=4, heads=(1, 3),
        patch_layer=6, patch_pos=3),
}

_MEASURED: dict[tuple[str, str], float] = {}
_NOTES: list[str] = []


def _record(test: str, name: str, value: float) -> float:
  _MEASURED[(test, name)] = max(_MEASURED.get((test, name), 0.0), value)
  return value


@pytest.fixture(scope="module", autouse=True)
def _report():
  yield
  if _MEASURED:
    print("\nmeasured max differences (penzai_lm vs transformers):")
    for (test, name), value in sorted(_MEASURED.items()):
      print(f"  {test:<40s} {name:<24s} {value:.3e}")
    for note in _NOTES:
      print(f"  {note}")


@pytest.fixture(scope="module")
def _one_torch_thread():
  """torch on one thread: with the CPU shared (by XLA's threads, other
  jobs), its multi-threaded kernels spend most of their time waiting for
  each other (a 135M forward pass: 2.4 s on 2 threads, 0.16 s on one)."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=MODELS)
def models(request, _one_torch_thread):
  name = request.param
  model, tokenizer = real_models.ours(name)
  return name, model, tokenizer, real_models.theirs(name)


# ---------------------------------------------------------------- helpers


@jax.jit
def _jit_logits(model, tokens):
  return model(tokens)


def _ours(model, ids) -> np.ndarray:
  """``(seq, vocabulary)`` logits of a (patched) model."""
  tokens = pz.nx.wrap(jnp.asarray([ids], jnp.int32)).tag("batch", "seq")
  # Loaded models hold frozen weights (`pz.ParameterValue`): plain
  # `jax.jit` takes them as arguments, with no `pz.freeze_params` first.
  out = _jit_logits(model, tokens)
  return np.asarray(out.unwrap("batch", "seq", "vocabulary"))[0]


@contextlib.contextmanager
def _hooks(*registrations):
  handles = list(registrations)
  try:
    yield
  finally:
    for h in handles:
      h.remove()


def _theirs(hf, ids, **kwargs):
  with torch.no_grad():
    return hf(torch.tensor([ids]), **kwargs)


def _hf_generate(hf, ids) -> list[int]:
  with torch.no_grad():
    out = hf.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                       dtype=torch.long),
        do_sample=False, max_new_tokens=NEW_TOKENS, top_k=None, top_p=None,
    )
  return out[0, len(ids):].tolist()


def _our_generate(model, ids) -> list[int]:
  result = penzai_lm.generate(model, ids, max_new_tokens=NEW_TOKENS,
                              temperature=0.0, stop_tokens=[])
  return list(result.tokens[0])


def _note_generation(what, name, hf, ids, ours, theirs):
  """Records the continuations; checks that the intervention changes
  HF's (else the comparison would not show it acting while decoding)."""
  plain = _hf_generate(hf, ids)  # Cheap on the HF side.
  _NOTES.append(
      f"greedy {what} [{name}]: penzai_lm {ours}, transformers {theirs}"
      f" (transformers without the intervention: {plain})")
  assert theirs != plain, (
      f"{what} does not change the greedy continuation of {name}; pick"
      " another setting so that this comparison means something", plain)


def _scaled_diff(ours, theirs) -> tuple[float, float]:
  """(max |diff|, max |diff| / max(1, max |theirs|))."""
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
  diff = float(np.abs(ours - theirs).max())
  return diff, diff / max(1.0, float(np.abs(theirs).max()))


def _head_slices(config, heads):
  return [slice(h * config.head_dim, (h + 1) * config.head_dim)
          for h in heads]


def _zero_heads_pre_hook(config, heads):
  def hook(_module, args):
    x = args[0].clone()
    for s in _head_slices(config, heads):
      x[..., s] = 0.0
    return (x,) + tuple(args[1:])
  return hook


def _add_vector_hook(vector):
  def hook(_module, _args, output):
    if isinstance(output, tuple):
      return (output[0] + vector,) + tuple(output[1:])
    return output + vector
  return hook


def _layer_output_hidden(output):
  return output[0] if isinstance(output, tuple) else output


# ------------------------------------------------------------------ tests


def _branch_modules(decoder_layer):
  """HF modules whose (input, output) are our attn_out / resid_mid /
  mlp_out: Gemma normalizes each branch's output (post norms), Llama does
  not."""
  if hasattr(decoder_layer, "post_feedforward_layernorm"):  # Gemma 2/3
    return dict(attn_out=decoder_layer.post_attention_layernorm,
                resid_mid=decoder_layer.pre_feedforward_layernorm,
                mlp_out=decoder_layer.post_feedforward_layernorm)
  return dict(attn_out=decoder_layer.self_attn.o_proj,
              resid_mid=decoder_layer.post_attention_layernorm,
              mlp_out=decoder_layer.mlp)


def test_captures_match_transformers(models):
  """Every kind of point against the matching HF tensor."""
  name, model, tokenizer, hf = models
  config = model.config
  s = SETTINGS[name]
  n = config.num_layers
  ids = tokenizer.encode(CLEAN)
  layers = s["layers"]
  names = ["embed", "final_norm"]
  for i in layers:
    names += [f"blocks.{i}.{p}" for p in (
        "resid_pre", "attn.pattern", "attn.head_out", "attn_out",
        "resid_mid", "mlp.neurons", "mlp_out", "resid_post")]
  cache = interp.run_with_cache(model, ids, names=names)

  theirs_at = {}  # (point, layer) -> HF tensor (batch, seq, ...)

  def keep_input(key):
    def hook(_module, args):
      theirs_at[key] = args[0].detach().clone()
    return hook

  def keep_output(key):
    def hook(_module, _args, output):
      theirs_at[key] = _layer_output_hidden(output).detach().clone()
    return hook

  regs = []
  for i in layers:
    decoder_layer = hf.model.layers[i]
    branches = _branch_modules(decoder_layer)
    regs += [
        decoder_layer.mlp.down_proj.register_forward_pre_hook(
            keep_input(("mlp.neurons", i))),
        decoder_layer.self_attn.o_proj.register_forward_pre_hook(
            keep_input(("attn.head_out", i))),
        branches["attn_out"].register_forward_hook(
            keep_output(("attn_out", i))),
        branches["resid_mid"].register_forward_pre_hook(
            keep_input(("resid_mid", i))),
        branches["mlp_out"].register_forward_hook(
            keep_output(("mlp_out", i))),
    ]
  with _hooks(*regs):
    out = _theirs(hf, ids, output_hidden_states=True, output_attentions=True)
  hidden = [h[0].numpy() for h in out.hidden_states]
  attentions = [a[0].numpy() for a in out.attentions]  # (heads, q, k)
  assert len(hidden) == n + 1 and len(attentions) == n

  def check(what, ours, theirs, scaled=True):
    diff, rel = _scaled_diff(ours, theirs)
    measure = rel if scaled else diff
    _record(f"captures/{what}", name, measure)
    assert measure < TOL, (name, what, diff, rel)

  check("embed", cache["embed"].unwrap("batch", "seq", "embedding")[0],
        hidden[0])
  # final_norm vs HF's last hidden state (HF applies the final norm there).
  check("final_norm",
        cache["final_norm"].unwrap("batch", "seq", "embedding")[0],
        hidden[-1])
  seq = len(ids)
  for i in layers:
    check("resid_pre",
          cache[f"blocks.{i}.resid_pre"].unwrap(
              "batch", "seq", "embedding")[0], hidden[i])
    if i < n - 1:  # hidden_states[n] is normed: compared above instead.
      check("resid_post",
            cache[f"blocks.{i}.resid_post"].unwrap(
                "batch", "seq", "embedding")[0], hidden[i + 1])
    for point in ("attn_out", "resid_mid", "mlp_out"):
      check(point,
            cache[f"blocks.{i}.{point}"].unwrap(
                "batch", "seq", "embedding")[0],
            theirs_at[(point, i)][0].numpy())
    pattern = cache[f"blocks.{i}.attn.pattern"]
    head_out = cache[f"blocks.{i}.attn.head_out"]
    theirs_heads = theirs_at[("attn.head_out", i)][0].numpy().reshape(
        seq, config.num_heads, config.head_dim)
    for h in range(config.num_heads):
      coords = interp.head_coordinates(config, h)
      check("attn.pattern",
            np.asarray(pattern[coords].unwrap("batch", "seq", "kv_seq"))[0],
            attentions[i][h], scaled=False)
      check("attn.head_out",
            np.asarray(head_out[coords].unwrap(
                "batch", "seq", "projection"))[0],
            theirs_heads[:, h])
    check("mlp.neurons",
          cache[f"blocks.{i}.mlp.neurons"].unwrap(
              "batch", "seq", "neurons")[0],
          theirs_at[("mlp.neurons", i)][0].numpy())
  # And the logits of the same pass.
  check("logits", cache.logits.unwrap("batch", "seq", "vocabulary")[0],
        out.logits[0].numpy(), scaled=False)


def test_head_ablation_matches_transformers(models):
  name, model, tokenizer, hf = models
  config = model.config
  s = SETTINGS[name]
  layer, heads = s["ablate_layer"], list(s["heads"])
  ids = tokenizer.encode(CLEAN)
  patched = interp.insert_at(model, f"blocks.{layer}.attn.head_out",
                             interp.ZeroHeads.build(config, heads))
  o_proj = hf.model.layers[layer].self_attn.o_proj
  ours = _ours(patched, ids)
  with _hooks(o_proj.register_forward_pre_hook(
      _zero_heads_pre_hook(config, heads))):
    theirs = _theirs(hf, ids).logits[0].numpy()
    theirs_tokens = _hf_generate(hf, ids)
  baseline = _theirs(hf, ids).logits[0].numpy()
  effect = _record("head_ablation/effect", name,
                   float(np.abs(theirs - baseline).max()))
  assert effect > 0.1, f"ablation has no visible effect ({effect})"
  diff = _record("head_ablation/logits", name,
                 float(np.abs(ours - theirs).max()))
  assert diff < TOL, (name, diff, effect)
  ours_tokens = _our_generate(patched, ids)
  _note_generation("head ablation", name, hf, ids, ours_tokens, theirs_tokens)
  assert theirs_tokens, name
  assert ours_tokens[:len(theirs_tokens)] == theirs_tokens, (
      name, ours_tokens, theirs_tokens)


def _steering_vector(config, seed=0):
  v = np.random.default_rng(seed).standard_normal(config.hidden_size)
  return (v / np.linalg.norm(v) * math.sqrt(config.hidden_size)).astype(
      np.float32)


def test_steering_matches_transformers(models):
  name, model, tokenizer, hf = models
  config = model.config
  layer = SETTINGS[name]["layer"]
  ids = tokenizer.encode(CLEAN)
  v = _steering_vector(config)
  decoder_layer = hf.model.layers[layer]
  baseline = _theirs(hf, ids).logits[0].numpy()
  for strength in (4.0, 8.0):
    patched = interp.insert_at(model, f"blocks.{layer}.resid_post",
                               interp.AddVector.build(v, strength))
    ours = _ours(patched, ids)
    with _hooks(decoder_layer.register_forward_hook(
        _add_vector_hook(torch.from_numpy(strength * v)))):
      theirs = _theirs(hf, ids).logits[0].numpy()
      if strength == 8.0:
        theirs_tokens = _hf_generate(hf, ids)
    effect = float(np.abs(theirs - baseline).max())
    _record(f"steering/effect(s={strength:g})", name, effect)
    assert effect > 0.1, f"steering has no visible effect ({effect})"
    diff = _record(f"steering/logits(s={strength:g})", name,
                   float(np.abs(ours - theirs).max()))
    assert diff < TOL, (name, strength, diff, effect)
  ours_tokens = _our_generate(patched, ids)
  _note_generation("steering s=8", name, hf, ids, ours_tokens, theirs_tokens)
  assert theirs_tokens, name
  assert ours_tokens[:len(theirs_tokens)] == theirs_tokens, (
      name, ours_tokens, theirs_tokens)


def test_activation_patching_matches_transformers(models):
  name, model, tokenizer, hf = models
  s = SETTINGS[name]
  layer, pos = s["patch_layer"], s["patch_pos"]
  clean, corrupt = tokenizer.encode(CLEAN), tokenizer.encode(CORRUPT)
  assert len(clean) == len(corrupt), (clean, corrupt)
  assert clean[pos] != corrupt[pos]

  point = f"blocks.{layer}.resid_pre"
  cache = interp.run_with_cache(model, clean, names=[point])
  patched = interp.insert_at(model, point,
                             interp.PatchValue.build(cache[point], [pos]))
  ours = _ours(patched, corrupt)

  decoder_layer = hf.model.layers[layer]
  saved = {}

  def keep(_module, args, kwargs):
    hs = args[0] if args else kwargs["hidden_states"]
    saved["clean"] = hs.detach().clone()

  def patch(_module, args, kwargs):
    if args:
      hs = args[0].clone()
      hs[:, pos] = saved["clean"][:, pos]
      return (hs,) + tuple(args[1:]), kwargs
    hs = kwargs["hidden_states"].clone()
    hs[:, pos] = saved["clean"][:, pos]
    return args, {**kwargs, "hidden_states": hs}

  with _hooks(decoder_layer.register_forward_pre_hook(keep, with_kwargs=True)):
    _theirs(hf, clean)
  # Our clean capture is HF's clean value too.
  cap_diff, cap_rel = _scaled_diff(
      cache[point].unwrap("batch", "seq", "embedding")[0],
      saved["clean"][0].numpy())
  _record("patching/clean resid_pre", name, cap_rel)
  assert cap_rel < TOL, (name, cap_diff, cap_rel)
  with _hooks(decoder_layer.register_forward_pre_hook(patch,
                                                       with_kwargs=True)):
    theirs = _theirs(hf, corrupt).logits[0].numpy()
  baseline = _theirs(hf, corrupt).logits[0].numpy()
  effect = float(np.abs(theirs[-1] - baseline[-1]).max())
  _record("patching/effect", name, effect)
  assert effect > 0.1, f"patching has no visible effect ({effect})"
  diff = _record("patching/logits", name, float(np.abs(ours - theirs).max()))
  assert diff < TOL, (name, diff, effect)


def test_logit_lens_matches_transformers(models):
  name, model, tokenizer, hf = models
  n = model.config.num_layers
  ids = tokenizer.encode(CLEAN)
  layers = [i for i in SETTINGS[name]["layers"] if i < n - 1]
  names = [f"blocks.{i}.resid_post" for i in (*layers, n - 1)]
  cache = interp.run_with_cache(model, ids, names=names)

  final = interp.unembed(model, cache[f"blocks.{n - 1}.resid_post"])
  diff = _record("logit_lens/last block vs logits", name, float(np.abs(
      np.asarray(final.unwrap("batch", "seq", "vocabulary"))
      - np.asarray(cache.logits.unwrap("batch", "seq", "vocabulary"))).max()))
  assert diff < 1e-4, (name, diff)

  out = _theirs(hf, ids, output_hidden_states=True)
  softcap = getattr(hf.config, "final_logit_softcapping", None)
  for i in layers:
    with torch.no_grad():
      theirs = hf.lm_head(hf.model.norm(out.hidden_states[i + 1]))
      if softcap is not None:
        theirs = torch.tanh(theirs / softcap) * softcap
    ours = interp.unembed(model, cache[f"blocks.{i}.resid_post"])
    diff = _record("logit_lens/intermediate", name, float(np.abs(
        np.asarray(ours.unwrap("batch", "seq", "vocabulary"))[0]
        - theirs[0].numpy()).max()))
    assert diff < TOL, (name, i, diff)


def test_saliency_matches_transformers(models):
  name, model, tokenizer, hf = models
  ids = tokenizer.encode(CLEAN)
  frozen = model  # As loaded: a plain pytree for jax.jit and jax.grad.
  target = int(_theirs(hf, ids).logits[0, -1].argmax())  # " Paris"
  last = len(ids) - 1

  emb = interp.embed(frozen, pz.nx.wrap(jnp.asarray(ids, jnp.int32)).tag(
      "seq"))

  def logit(m, e):
    logits = interp.logits_from_embeddings(m, e)
    return logits[{"seq": last, "vocabulary": target}].unwrap()

  # The model is an argument, not a closed-over constant: XLA would spend a
  # minute constant-folding the weights' part of the backward pass.
  grad = jax.jit(jax.grad(logit, argnums=1))(frozen, emb)
  ours = np.asarray(grad.unwrap("seq", "embedding"))

  embed_tokens = hf.model.embed_tokens
  scale = float(getattr(embed_tokens, "embed_scale", 1.0))
  with torch.no_grad():
    inputs = embed_tokens(torch.tensor([ids]))
  inputs.requires_grad_(True)
  hf(inputs_embeds=inputs).logits[0, -1, target].backward()
  # Our `embed` returns the raw table rows; HF's inputs are the rows times
  # the embedding scale (sqrt(hidden) in Gemma), so d/d(raw) = scale *
  # d/d(scaled).
  theirs = inputs.grad[0].numpy() * scale
  diff, _ = _scaled_diff(ours, theirs)
  rel = diff / float(np.abs(theirs).max())
  _record("saliency/grad (relative)", name, rel)
  assert rel < TOL, (name, diff, rel)
