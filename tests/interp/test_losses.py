"""Next-token losses (`token_losses`, ``run_with_cache(return_loss=True)``)
against transformers on the same tiny random weights, and
``cache.row(r, "logits")``.

The reference is computed by torch: ``cross_entropy`` of each row's logits
from the Hugging Face model run on the row alone, and HF's own
``model(ids, labels=ids).loss``.
"""

import numpy as np
import pytest
from penzai import pz

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import penzai_lm  # pylint: disable=g-import-not-at-top
from penzai_lm import interp  # pylint: disable=g-import-not-at-top
from penzai_lm.generation import Engine  # pylint: disable=g-import-not-at-top
from penzai_lm.loading import load_model  # pylint: disable=g-import-not-at-top
from penzai_lm.runtime.unstack import unstack_layers  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top
from tests.model.configs import config  # pylint: disable=g-import-not-at-top

LENGTHS = (12, 5, 1, 9)  # Ragged, with a row that predicts nothing.
VOCAB = 101


def _configs():
  t = transformers
  common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)
  return {
      "llama": (t.LlamaForCausalLM, t.LlamaConfig(
          **common, num_key_value_heads=2)),
      # Soft-capped final logits: the loss is taken after the cap.
      "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(
          **common, num_key_value_heads=2, head_dim=16, sliding_window=5,
          query_pre_attn_scalar=12, attn_logit_softcapping=0.5,
          final_logit_softcapping=3.0)),
      # Learned positions: padding must not shift them.
      "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(
          vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
  }


@pytest.fixture(scope="module", params=sorted(_configs()))
def pair(request, tmp_path_factory):
  cls, hf_config = _configs()[request.param]
  path = tmp_path_factory.mktemp(request.param)
  hf_model = save_perturbed(cls, hf_config, path)
  return pz.freeze_params(load_model(path)), hf_model


def _named_model():
  return penzai_lm.build_transformer(
      config("llama_gqa").replace(vocab_size=VOCAB), seed=0)


def _prompts(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, n).tolist() for n in LENGTHS]


def _hf_losses(hf_model, ids) -> np.ndarray:
  """torch's per-token cross-entropy of the row run alone."""
  with torch.no_grad():
    logits = hf_model(torch.tensor([ids])).logits[0]
    return torch.nn.functional.cross_entropy(
        logits[:-1], torch.tensor(ids[1:], dtype=torch.long),
        reduction="none").numpy()


def _hf_mean_loss(hf_model, ids) -> float:
  with torch.no_grad():
    return float(hf_model(torch.tensor([ids]),
                          labels=torch.tensor([ids])).loss)


def test_token_losses_match_transformers(pair):
  model, hf_model = pair
  prompts = _prompts()
  losses = interp.token_losses(model, prompts)
  assert [len(row) for row in losses] == [n - 1 for n in LENGTHS]
  for ids, got in zip(prompts, losses):
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _hf_losses(hf_model, ids), atol=1e-4)
    if len(ids) > 1:
      np.testing.assert_allclose(got.mean(), _hf_mean_loss(hf_model, ids),
                                 atol=1e-4)


def test_run_with_cache_carries_the_losses(pair):
  model, hf_model = pair
  prompts = _prompts(seed=1)
  cache = interp.run_with_cache(model, prompts, names=["embed"],
                                return_loss=True)
  want = [_hf_losses(hf_model, ids) for ids in prompts]
  for got, ref in zip(cache.losses, want):
    np.testing.assert_allclose(got, ref, atol=1e-4)
  # The mean over every predicted token of the batch.
  np.testing.assert_allclose(cache.loss, np.concatenate(want).mean(),
                             atol=1e-4)
  eager = interp.run_with_cache(model, prompts, names=["embed"],
                                return_loss=True, eager=True)
  for got, ref in zip(eager.losses, want):
    np.testing.assert_allclose(got, ref, atol=1e-4)
  plain = interp.run_with_cache(model, prompts, names=["embed"])
  assert plain.losses is None and plain.loss is None


def test_one_program_without_the_logits(pair):
  """``token_losses`` is one compiled call; the program's outputs are the
  losses, not the ``(batch, seq, vocabulary)`` logits."""
  model, _ = pair
  engine = Engine()
  first = interp.token_losses(model, _prompts(), engine=engine)
  again = interp.token_losses(model, _prompts(seed=2), engine=engine)
  assert engine.compilations == 1
  assert not np.array_equal(np.concatenate(first), np.concatenate(again))
  (_, program), = engine.programs.items("forward")
  # The float32 losses of 4 rows padded to 16 tokens, and nothing else.
  assert program.memory_analysis().output_size_in_bytes == 4 * 16 * 4


def test_named_array_tokens_and_per_layer_blocks():
  """A NamedArray of tokens: every position is a real token. Per-layer
  blocks give the losses of the layer stack."""
  model = _named_model()
  ids = np.random.default_rng(3).integers(0, VOCAB, (2, 6))
  tokens = pz.nx.wrap(ids).tag("batch", "seq")
  got = interp.run_with_cache(model, tokens, names=[], return_loss=True)
  rows = interp.token_losses(model, [list(r) for r in ids])
  per_layer = interp.token_losses(unstack_layers(model),
                                  [list(r) for r in ids])
  assert [len(r) for r in got.losses] == [5, 5]
  for a, b, c in zip(got.losses, rows, per_layer):
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(c, b, atol=1e-5)


def test_row_of_the_logits(pair):
  model, hf_model = pair
  prompts = _prompts(seed=4)
  cache = interp.run_with_cache(model, prompts, names=[])
  for r, ids in enumerate(prompts):
    row = cache.row(r, "logits")
    assert row.named_shape == {"seq": len(ids), "vocabulary": VOCAB}
    with torch.no_grad():
      want = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(row.unwrap("seq", "vocabulary")),
                               want, atol=1e-4)
  lean = interp.run_with_cache(model, prompts, names=["embed"], logits=False)
  with pytest.raises(KeyError, match="logits were not kept"):
    lean.row(0, "logits")
