"""SAELens interop on one tiny random Llama, in penzai_lm and TransformerLens.

``evaluate_sae(..., compatible="saelens")`` gives SAELens 6's own
``run_evals`` numbers (CE loss score, explained variance, L0, MSE) for the
same SAE (written by `save_sae`, read by ``SAE.load_from_disk``) on the
same windows, special tokens included; and what `train_sae` saves is
enough for SAELens's ``ActivationsStore.from_sae``, which then reads the
activations the SAE was trained on. TransformerLens builds the model from
the local directory (its config read from there, weights converted by its
``convert_llama_weights``): nothing is fetched.
"""

import tempfile

import numpy as np
import pytest

# The test extra has sae-lens, which brings these.
import datasets  # pylint: disable=g-bad-import-order
import sae_lens
from sae_lens import evals
from sae_lens.training.activation_scaler import ActivationScaler
from sae_lens.training.activations_store import ActivationsStore
import tokenizers
import torch
import transformers

from penzai_lm import sae as sae_lib
from penzai_lm.loading import load_model
from penzai_lm.sae.activations import PointActivations
from tests.loading.hf_models import save_perturbed
from tests.sae.random_saes import random_sae

POINT, HOOK = "blocks.1.resid_post", "blocks.1.hook_resid_post"
HIDDEN, VOCAB, LENGTH = 32, 101, 16
PAD, BOS, EOS = 0, 1, 2
REL = 1e-4


def _save_tokenizer(path):
  """A word-level tokenizer (``t3`` .. ``t100``) with BOS, EOS and PAD."""
  vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS,
           **{f"t{i}": i for i in range(3, VOCAB)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
      pad_token="<pad>").save_pretrained(path)


def _transformer_lens(path, hf):
  """The directory's model in TransformerLens, built offline."""
  # pylint: disable=g-import-not-at-top
  from transformer_lens import HookedTransformer
  from transformer_lens.loading_from_pretrained import (
      get_pretrained_model_config)
  from transformer_lens.pretrained.weight_conversions.llama import (
      convert_llama_weights)
  # pylint: enable=g-import-not-at-top
  cfg = get_pretrained_model_config(str(path), device="cpu",
                                    dtype=torch.float32)
  # TransformerLens's Llama branch leaves rotary_base at its default.
  rope = getattr(hf.config, "rope_parameters", None) or {}
  cfg.rotary_base = float(rope["rope_theta"] if "rope_theta" in rope
                          else hf.config.rope_theta)
  tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
      path, add_bos_token=True)  # add_bos_token: TL does not reload it.
  tl = HookedTransformer(cfg, tokenizer=tokenizer)
  tl.load_and_process_state_dict(
      convert_llama_weights(hf, cfg), fold_ln=False,
      center_writing_weights=False, center_unembed=False,
      fold_value_biases=False, refactor_factored_attn_matrices=False)
  return tl.eval()


@pytest.fixture(scope="module")
def models():
  """``(penzai_lm model, TransformerLens model)`` of one tiny Llama whose
  logits are peaked enough (unembedding x20) that zero-ablating a
  residual stream changes the loss by nats."""
  torch.set_num_threads(1)
  # TransformerLens treats a path holding "llama" as a hub name.
  path = tempfile.mkdtemp(prefix="tinylm-")
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS,
      pad_token_id=PAD)
  hf = save_perturbed(transformers.LlamaForCausalLM, config, path)
  with torch.no_grad():
    hf.lm_head.weight.mul_(20.0)
  hf.save_pretrained(path)
  _save_tokenizer(path)
  try:
    tl = _transformer_lens(path, hf)
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"TransformerLens cannot build the tiny Llama offline"
                f" ({type(e).__name__}: {e}): the SAELens parity is NOT"
                " checked.")
  ids = _windows()
  with torch.no_grad():
    diff = (tl(torch.tensor(ids)) - hf(torch.tensor(ids)).logits).abs()
  assert float(diff.max()) < 1e-4  # The same model in both.
  return load_model(path, use_layer_stack=False), tl


def _windows(rows=6, seed=0):
  """Windows starting with BOS, with BOS, EOS and PAD inside too."""
  ids = np.random.default_rng(seed).integers(3, VOCAB, (rows, LENGTH))
  ids[:, 0] = BOS
  ids[2, 7], ids[4, 9], ids[5, 3] = EOS, BOS, PAD
  return ids


def _store(tl, sae_dir, ids, **kwargs):
  dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
  return ActivationsStore.from_sae(
      model=tl, sae=sae_lens.SAE.load_from_disk(str(sae_dir)),
      dataset=dataset, streaming=False, store_batch_size_prompts=len(ids),
      **kwargs)


def _run_evals(tl, sae_dir, ids):
  theirs = sae_lens.SAE.load_from_disk(str(sae_dir))
  store = _store(tl, sae_dir, ids)
  config = evals.EvalConfig(
      batch_size_prompts=len(ids), n_eval_reconstruction_batches=1,
      n_eval_sparsity_variance_batches=1, compute_ce_loss=True,
      compute_sparsity_metrics=True, compute_variance_metrics=True)
  metrics, _ = evals.run_evals(theirs, store, tl, ActivationScaler(), config)
  return metrics


@pytest.mark.parametrize("arch", ["topk", "jumprelu"])
def test_saelens_mode_gives_run_evals_numbers(tmp_path, models, arch):
  model, tl = models
  ours = random_sae(arch, d_in=HIDDEN, d_sae=128, layer=1)
  ids = _windows()
  sae_lib.save_sae(ours, tmp_path, context_size=LENGTH, prepend_bos=False)
  theirs = _run_evals(tl, tmp_path, ids)
  got = sae_lib.evaluate_sae(model, ours, ids, compatible="saelens", rows=4)
  perf = theirs["model_performance_preservation"]
  quality = theirs["reconstruction_quality"]
  pairs = {
      "ce_clean": (got.ce_clean, perf["ce_loss_without_sae"]),
      "ce_spliced": (got.ce_spliced, perf["ce_loss_with_sae"]),
      "ce_zero_ablated": (got.ce_zero_ablated, perf["ce_loss_with_ablation"]),
      "ce_recovered": (got.ce_recovered, perf["ce_loss_score"]),
      "explained_variance": (got.explained_variance,
                             quality["explained_variance"]),
      "mse": (got.mse, quality["mse"]),
      "l0": (got.l0, theirs["sparsity"]["l0"]),
  }
  for name, (mine, want) in pairs.items():
    assert mine == pytest.approx(want, rel=REL), name
  # The ablation costs nats, so the score is not a ratio of noise.
  assert perf["ce_loss_without_sae"] - perf["ce_loss_with_ablation"] > 1
  # 7 BOS (6 at position 0), 1 EOS and 1 PAD of the 96 tokens are left out.
  assert got.tokens == ids.size - 9
  default = sae_lib.evaluate_sae(model, ours, ids, rows=4)
  assert abs(default.ce_recovered - got.ce_recovered) > 1e-3


def test_saelens_mode_ignore_tokens_override(models):
  """``ignore_tokens=[]`` counts the special tokens too (SAELens's
  ``exclude_special_tokens=False``)."""
  model, _ = models
  ours = random_sae("topk", d_in=HIDDEN, d_sae=128, layer=1)
  ids = _windows()
  every = sae_lib.evaluate_sae(model, ours, ids, compatible="saelens",
                               ignore_tokens=[], rows=4)
  assert every.tokens == ids.size


@pytest.mark.parametrize("kwargs, error", [
    (dict(compatible="sae_lens"), ValueError),
    (dict(compatible="saelens", skip_positions=1), ValueError),
    (dict(compatible="saelens", max_norm=10.0), ValueError),
    (dict(ignore_tokens=1), TypeError),
    (dict(ignore_tokens=[VOCAB]), ValueError),
])
def test_bad_conventions_are_clear_errors(models, kwargs, error):
  model, _ = models
  ours = random_sae("topk", d_in=HIDDEN, d_sae=128, layer=1)
  with pytest.raises(error, match=next(iter(kwargs))):
    sae_lib.evaluate_sae(model, ours, _windows(), **kwargs)


def test_train_sae_saves_what_activations_store_needs(tmp_path, models):
  """SAELens's store built from the saved SAE alone reads the values the
  SAE was trained on: positions from ``skip_positions`` of windows of
  ``context_length`` tokens, no BOS prepended."""
  model, tl = models
  config = sae_lib.TrainConfig(
      expansion_factor=2, k=4, batch_tokens=64, steps=4, context_length=LENGTH,
      model_batch=4, buffer_tokens=128, log_every=2, eval_windows=0)
  tokens = np.random.default_rng(1).integers(3, VOCAB, 40 * LENGTH)
  sae_lib.train_sae(model, POINT, tokens, config, save_to=tmp_path,
                    progress=False, model_name="tiny-llama")
  meta = sae_lens.SAE.load_from_disk(str(tmp_path)).cfg.metadata
  assert (meta.model_name, meta.hook_name) == ("tiny-llama", HOOK)
  ids = _windows(seed=2)
  store = _store(tl, tmp_path, ids)
  assert (store.context_size, store.prepend_bos) == (LENGTH, False)
  batch = store.get_batch_tokens(len(ids))
  np.testing.assert_array_equal(batch.numpy(), ids)
  with torch.no_grad():
    theirs = store.get_activations(batch).numpy()
  ours = np.asarray(PointActivations(model, POINT, 1)(ids))
  np.testing.assert_allclose(theirs.reshape(ours.shape), ours, atol=1e-4)


def test_save_sae_metadata_arguments(tmp_path):
  ours = random_sae("topk", d_in=HIDDEN, d_sae=64, layer=1)
  sae_lib.save_sae(ours, tmp_path, model_name="m", context_size=8,
                   prepend_bos=True)
  meta = sae_lens.SAE.load_from_disk(str(tmp_path)).cfg.metadata
  assert (meta.context_size, meta.prepend_bos, meta.model_name) == (
      8, True, "m")
  with pytest.raises(ValueError, match="context_size"):
    sae_lib.save_sae(ours, tmp_path, context_size=0)
  with pytest.raises(TypeError, match="prepend_bos"):
    sae_lib.save_sae(ours, tmp_path, prepend_bos="yes")
  with pytest.raises(ValueError, match="context_size"):
    sae_lib.save_sae(ours, tmp_path, context_size=8,
                     metadata={"context_size": 8})
