"""SAELens parity: the same weights give the same numbers.

For every architecture SAELens runs at inference (standard, jumprelu, topk
with and without decoder-norm rescaling, the four transcoders), its input
normalizations ("none", "constant_norm_rescale", "layer_norm") and
``hook_z`` SAEs on a grouped-query model: files written by SAELens
(``save_model``) load here, files written here load in SAELens
(``SAE.load_from_disk``), and encode / decode / forward agree within 1e-5
(float32). Spliced into a tiny random Llama, the model's logits equal
transformers' with a forward hook doing the same splice (error term plus a
clamped feature, replacement, a transcoder replacing the MLP).

Run with ``-s`` for a table of the measured max absolute differences.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import sae_lens  # The test extra has it.  pylint: disable=g-bad-import-order
import torch
import transformers

from penzai_lm import interp  # pylint: disable=g-import-not-at-top
from penzai_lm import sae as sae_lib  # pylint: disable=g-import-not-at-top
from penzai_lm.loading import load_model  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import logits  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top
from tests.model.configs import config  # pylint: disable=g-import-not-at-top
from tests.sae.random_saes import ARCHITECTURES  # pylint: disable=g-import-not-at-top
from tests.sae.random_saes import K  # pylint: disable=g-import-not-at-top
from tests.sae.random_saes import random_arrays  # pylint: disable=g-import-not-at-top
from tests.sae.random_saes import random_sae  # pylint: disable=g-import-not-at-top

TOL = 1e-5
D, F = 32, 128
_MEASURED: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
  yield
  if _MEASURED:
    print("\nmax |penzai_lm - SAELens| (float32):")
    for (case, what), value in sorted(_MEASURED.items()):
      print(f"  {case:<44s} {what:<10s} {value:.2e}")


def _close(case, what, ours, theirs, tol=TOL):
  diff = float(np.max(np.abs(np.asarray(ours, np.float64)
                             - np.asarray(theirs, np.float64))))
  _MEASURED[(case, what)] = max(_MEASURED.get((case, what), 0.0), diff)
  assert diff <= tol, f"{case} {what}: {diff:.3e}"


# (architecture, normalize_activations, rescale_acts_by_decoder_norm,
#  apply_b_dec_to_input)
CASES = [
    ("standard", "none", False, True),
    ("standard", "none", False, False),
    ("standard", "constant_norm_rescale", False, True),
    ("standard", "layer_norm", False, True),
    ("jumprelu", "none", False, False),
    ("jumprelu", "layer_norm", False, True),
    ("topk", "none", False, True),
    ("topk", "none", True, True),
    ("topk", "constant_norm_rescale", True, False),
    ("topk", "layer_norm", False, True),
    ("transcoder", "none", False, False),
    ("skip_transcoder", "none", False, False),
    ("jumprelu_transcoder", "none", False, False),
    ("jumprelu_skip_transcoder", "none", False, False),
]


def _case_id(case):
  arch, norm, rescale, b_dec_in = case
  return f"{arch}-{norm}" + ("-rescale" if rescale else "") + (
      "-bdec" if b_dec_in else "")


def _theirs(arch, norm, rescale, b_dec_in, d_in=D, hook="blocks.1",
            reshape="none", seed=0):
  """A SAELens SAE of ``arch`` with random weights (every tensor)."""
  activation, transcoder, skip = ARCHITECTURES[arch]
  cfg = {"architecture": arch, "d_in": d_in, "d_sae": F,
         "apply_b_dec_to_input": b_dec_in, "normalize_activations": norm,
         "reshape_activations": reshape,
         "metadata": {"hook_name": (f"{hook}.mlp.hook_in"
                                    if transcoder else f"{hook}.hook_resid_post"
                                    if reshape == "none"
                                    else f"{hook}.attn.hook_z")}}
  if transcoder:
    cfg["d_out"] = d_in
    cfg["metadata"]["hook_name_out"] = f"{hook}.hook_mlp_out"
  if activation == "topk":
    cfg.update(k=K, rescale_acts_by_decoder_norm=rescale)
  theirs = sae_lens.SAE.from_dict(cfg)
  a = random_arrays(d_in, F, d_in, seed=seed,
                    threshold=activation == "jumprelu", skip=skip)
  state = {"W_enc": a["w_enc"], "b_enc": a["b_enc"], "W_dec": a["w_dec"],
           "b_dec": a["b_dec"]}
  if "threshold" in a:
    state["threshold"] = a["threshold"]
  if skip:
    state["W_skip"] = a["w_skip"].T.copy()
  theirs.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
  return theirs.eval()


def _compare(case, ours, theirs, x):
  """encode, decode (theirs' features through our decoder, and each its
  own) and forward on ``x`` (numpy, SAELens's layout: batch, seq, then the
  input flat or as heads x d_head)."""
  names = ("batch", "seq", *ours.input_names)
  xs = pz.nx.wrap(jnp.asarray(x.reshape(x.shape[:2] + tuple(
      n for _, n in ours.config.input_axes)))).tag(*names)
  out_names = ("batch", "seq", *ours.output_names)
  with torch.no_grad():
    xt = torch.from_numpy(x)
    f_t = theirs.encode(xt)
    y_t = theirs.decode(f_t)
    out_t = theirs(xt)
  f_o, stats = ours.encode_with_stats(xs)
  _close(case, "encode", f_o.unwrap("batch", "seq", "features"), f_t)
  f_named = pz.nx.wrap(jnp.asarray(f_t.numpy())).tag("batch", "seq",
                                                    "features")
  shape = y_t.shape
  _close(case, "decode", np.asarray(ours.decode(f_named, stats).unwrap(
      *out_names)).reshape(shape), y_t)
  _close(case, "forward", np.asarray(ours.forward(xs).unwrap(
      *out_names)).reshape(out_t.shape), out_t)
  active = np.asarray(f_t) > 0
  assert 0 < active.mean() < 1  # Some features fire, not all.


def _inputs(shape, seed=3):
  rng = np.random.default_rng(seed)
  # An offset and a scale, so that the normalizations do something.
  return (0.5 + 2.0 * rng.standard_normal(shape)).astype(np.float32)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_files_written_by_saelens_load_here(tmp_path, case):
  theirs = _theirs(*case)
  theirs.save_model(tmp_path)
  ours = sae_lib.load_sae(tmp_path)
  arch = case[0]
  transcoder = ARCHITECTURES[arch][1]
  assert ours.config.hook_point == (
      "blocks.1.mlp_in" if transcoder else "blocks.1.resid_post")
  assert ours.config.output_point == (
      "blocks.1.mlp_out" if transcoder else None)
  _compare(f"saelens->ours {_case_id(case)}", ours, theirs,
           _inputs((2, 5, D)))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_files_written_here_load_in_saelens(tmp_path, case):
  arch, norm, rescale, b_dec_in = case
  ours = random_sae(arch, d_in=D, d_sae=F, norm=norm, rescale=rescale,
                    b_dec_in=b_dec_in, seed=5)
  sae_lib.save_sae(ours, tmp_path)
  theirs = sae_lens.SAE.load_from_disk(tmp_path)
  assert theirs.cfg.architecture() == arch
  assert theirs.cfg.normalize_activations == norm
  _compare(f"ours->saelens {_case_id(case)}", ours, theirs,
           _inputs((2, 5, D)))


@pytest.mark.parametrize("norm", ["none", "layer_norm"])
def test_hook_z_sae_on_a_grouped_query_model(tmp_path, norm):
  """SAELens flattens ``(n_heads d_head)`` in Hugging Face head order;
  penzai_lm's head axes (2 groups x 2 query heads) flatten the same way."""
  model_config = config("llama_gqa")
  d_in = model_config.num_heads * model_config.head_dim
  theirs = _theirs("jumprelu", norm, False, True, d_in=d_in,
                   reshape="hook_z")
  theirs.save_model(tmp_path / "theirs")
  ours = sae_lib.load_sae(tmp_path / "theirs", model=model_config)
  assert ours.config.input_axes == (("head_groups", 2), ("query_heads", 2),
                                    ("projection", 12))
  assert ours.config.hook_point == "blocks.1.attn.head_out"
  x = _inputs((2, 5, model_config.num_heads, model_config.head_dim))
  _compare(f"saelens->ours hook_z-{norm}", ours, theirs, x)
  sae_lib.save_sae(ours, tmp_path / "ours")
  again = sae_lens.SAE.load_from_disk(tmp_path / "ours")
  assert again.cfg.reshape_activations == "hook_z"
  _compare(f"ours->saelens hook_z-{norm}", ours, again, x)


# ------------------------------------------------- spliced into a model


HIDDEN = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """A tiny random Llama (GQA), in transformers and in penzai_lm."""
  torch.set_num_threads(1)
  path = tmp_path_factory.mktemp("llama")
  hf_config = transformers.LlamaConfig(
      vocab_size=101, hidden_size=HIDDEN, intermediate_size=48,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=64)
  hf = save_perturbed(transformers.LlamaForCausalLM, hf_config, path)
  return hf, load_model(path, use_layer_stack=False, freeze=False)


IDS = [5, 17, 42, 3, 99, 64, 8, 23, 77, 1]
LAYER = 1


def _hf_logits(hf, module, hook):
  handle = module.register_forward_hook(hook)
  try:
    with torch.no_grad():
      return hf(torch.tensor([IDS])).logits[0].numpy()
  finally:
    handle.remove()


def _our_logits(model):
  tokens = pz.nx.wrap(jnp.asarray(IDS)).tag("seq")
  return np.asarray(logits(pz.freeze_params(model), tokens).unwrap(
      "seq", "vocabulary"))


def _hidden(output):
  """A decoder layer's hidden states (a tuple's first entry in older
  transformers, the tensor itself in newer ones)."""
  return output[0] if isinstance(output, tuple) else output


def _captured(hf, module, of_input=False):
  """The value a hook on ``module`` sees (its input or output)."""
  seen = []

  def hook(m, inputs, output):
    seen.append(inputs[0] if of_input else _hidden(output))

  _hf_logits(hf, module, hook)
  return seen[0]


def _active_feature(theirs, x):
  """A feature that fires on some tokens but not all."""
  with torch.no_grad():
    f = theirs.encode(x)
  fires = (f > 0).float().mean(dim=(0, 1))
  return int(torch.argmin((fires - 0.5).abs()))


@pytest.mark.parametrize("mode", ["error", "replace"])
def test_spliced_sae_logits_equal_transformers_hooks(tmp_path, llama, mode):
  """An SAE on resid_post of block 1: with the error term and feature j
  clamped to 3 (transformers: h + decode(f') - decode(f)), or replacing
  the residual stream (transformers: h -> sae(h))."""
  hf, model = llama
  theirs = _theirs("jumprelu", "layer_norm", False, True, d_in=HIDDEN)
  theirs.save_model(tmp_path)
  ours = sae_lib.load_sae(tmp_path, model=model)
  spliced = sae_lib.splice(model, ours, mode=mode)
  block = hf.model.layers[LAYER]
  j = _active_feature(theirs, _captured(hf, block))
  value = 3.0

  def hook(module, inputs, output):
    h = _hidden(output)
    f = theirs.encode(h)
    if mode == "replace":
      new = theirs.decode(f)
    else:
      clean = theirs.decode(f)
      edited = f.clone()
      edited[..., j] = value
      theirs.encode(h)  # Sets the normalization statistics again.
      new = h + theirs.decode(edited) - clean
    return (new, *output[1:]) if isinstance(output, tuple) else new

  if mode == "error":
    features = f"blocks.{LAYER}.resid_post.sae.features"
    spliced = interp.insert_at(spliced, features,
                               sae_lib.FeatureEdit.clamp(ours, [j], value))
  want = _hf_logits(hf, block, hook)
  plain = _hf_logits(hf, block, lambda m, i, o: None)
  assert np.abs(want - plain).max() > 1e-2  # The splice changes logits.
  _close(f"spliced logits sae-{mode}", "logits", _our_logits(spliced), want,
         tol=1e-4)


@pytest.mark.parametrize("mode", ["error", "replace"])
def test_spliced_transcoder_logits_equal_transformers_hooks(tmp_path, llama,
                                                            mode):
  """A skip transcoder from mlp_in to mlp_out of block 1: replacing the
  MLP's output (transformers: a hook on the MLP returning the transcoder
  of its input), or keeping the error with feature j clamped."""
  hf, model = llama
  theirs = _theirs("jumprelu_skip_transcoder", "none", False, False,
                   d_in=HIDDEN, seed=2)
  theirs.save_model(tmp_path)
  ours = sae_lib.load_sae(tmp_path, model=model)
  assert (ours.config.hook_point, ours.config.output_point) == (
      "blocks.1.mlp_in", "blocks.1.mlp_out")
  spliced = sae_lib.splice(model, ours, mode=mode)
  mlp = hf.model.layers[LAYER].mlp
  j = _active_feature(theirs, _captured(hf, mlp, of_input=True))

  def hook(module, inputs, output):
    x = inputs[0]
    if mode == "replace":
      return theirs(x)
    f = theirs.encode(x)
    edited = f.clone()
    edited[..., j] = 3.0
    return output + theirs.decode(edited) - theirs.decode(f)

  if mode == "error":
    features = f"blocks.{LAYER}.mlp_in.transcoder.features"
    spliced = interp.insert_at(spliced, features,
                               sae_lib.FeatureEdit.clamp(ours, [j], 3.0))
  want = _hf_logits(hf, mlp, hook)
  plain = _hf_logits(hf, mlp, lambda m, i, o: None)
  assert np.abs(want - plain).max() > 1e-2
  _close(f"spliced logits transcoder-{mode}", "logits",
         _our_logits(spliced), want, tol=1e-4)
