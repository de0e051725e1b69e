"""Direct logit attribution on the real checkpoints against transformers:
each head's, MLP's and the embeddings' direct effect on a logit difference,
recomputed by hand on the Hugging Face model from its own modules (hooks on
``o_proj``'s input, the MLP branch and the final norm's input; Gemma's post
norms and the final norm frozen at the run's denominators)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from penzai_lm import interp  # pylint: disable=g-import-not-at-top
from tests import real_models  # pylint: disable=g-import-not-at-top
from tests.interp.test_hf_parity import _branch_modules  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.slow

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module", params=real_models.NAMES)
def models(request):
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  model, tokenizer = real_models.ours(request.param)
  yield model, tokenizer, real_models.theirs(request.param)
  torch.set_num_threads(threads)


def _norm_scale(module) -> torch.Tensor:
  """The multiplier an HF RMSNorm applies (Gemma stores ``w`` for
  ``1 + w``)."""
  weight = module.weight.detach().double()
  return 1.0 + weight if "Gemma" in type(module).__name__ else weight


def _frozen(module, full, terms):
  """``terms`` through ``module`` (an RMSNorm) at ``full``'s denominator."""
  eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
  denominator = torch.sqrt((full * full).mean(-1, keepdim=True) + eps)
  return terms / denominator * _norm_scale(module)


def _theirs(hf, ids, answer, wrong):
  """``[terms]`` direct effects at the last position and the logit
  difference, by hand on the HF model."""
  config = hf.config
  head_dim = getattr(config, "head_dim", None) or (
      config.hidden_size // config.num_attention_heads)
  seen, handles = {}, []
  for i, layer in enumerate(hf.model.layers):
    handles.append(layer.self_attn.o_proj.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(("z", i), args[0])))
    mlp = _branch_modules(layer)["mlp_out"]
    handles.append(mlp.register_forward_hook(
        lambda _m, _a, out, i=i: seen.__setitem__(("mlp", i), out)))
  handles.append(hf.model.norm.register_forward_pre_hook(
      lambda _m, args: seen.__setitem__("final", args[0])))
  try:
    with torch.no_grad():
      out = hf(torch.tensor([ids]), output_hidden_states=True)
  finally:
    for h in handles:
      h.remove()
  last = lambda t: t[0, -1].double()  # pylint: disable=unnecessary-lambda-assignment
  terms = [last(out.hidden_states[0])]
  for i, layer in enumerate(hf.model.layers):
    z = last(seen[("z", i)])
    w_o = layer.self_attn.o_proj.weight.detach().double()
    heads = torch.stack([
        w_o[:, h * head_dim:(h + 1) * head_dim] @ z[h * head_dim:(h + 1)
                                                    * head_dim]
        for h in range(config.num_attention_heads)])
    if hasattr(layer, "post_feedforward_layernorm"):  # Gemma's post norm.
      heads = _frozen(layer.post_attention_layernorm, heads.sum(0), heads)
    terms += list(heads) + [last(seen[("mlp", i)])]
  final = last(seen["final"])
  w_u = hf.lm_head.weight.detach().double()
  direction = w_u[answer] - w_u[wrong]
  effects = _frozen(hf.model.norm, final, torch.stack(terms)) @ direction
  logits = out.logits[0, -1].double()
  return effects.numpy(), float(logits[answer] - logits[wrong])


def test_direct_logit_attribution_matches_transformers(models):
  model, tokenizer, hf = models
  ids = tokenizer.encode(PROMPT)
  stack = interp.decompose_resid(model, ids, per_head=True)
  logits = np.asarray(interp.run_with_cache(model, ids, names=[]).logits
                      .unwrap("batch", "seq", "vocabulary"))[0, -1]
  answer, wrong = (int(t) for t in np.argsort(logits)[::-1][:2])
  ours = np.asarray(interp.logit_attribution(
      model, interp.apply_final_norm(model, stack), answer, wrong
  ).unwrap("component", "batch"))[:, 0]

  theirs, difference = _theirs(hf, ids, answer, wrong)
  config = model.config
  assert len(stack.labels) == 1 + config.num_layers * (config.num_heads + 1)
  assert ours.shape == theirs.shape
  # The recipe on the HF side is exact: its terms sum to HF's difference.
  assert abs(theirs.sum() - difference) < 1e-3 * max(1.0, abs(difference))
  scale = max(1.0, float(np.abs(theirs).max()))
  assert float(np.abs(ours - theirs).max()) / scale < 1e-3
  assert abs(ours.sum() - difference) < 2e-3 * max(1.0, abs(difference))
