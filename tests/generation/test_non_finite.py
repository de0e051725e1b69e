"""A row whose logits turn NaN ends with "non_finite" instead of sampling
garbage; the other rows are unaffected."""

import jax.numpy as jnp
import numpy as np
from penzai import pz

import penzai_lm
from penzai_lm import generation
from penzai_lm import interp
from tests.model.configs import config


def test_nan_logits_end_the_row_and_spare_the_others():
  model = penzai_lm.build_transformer(config("llama_gqa", False), seed=3)
  prompts = [[1, 2, 3], [4, 5, 6, 7]]
  # NaN in row 0's residual stream from its third generated token on
  # (built directly: AddVector.build refuses non-finite values).
  poison = interp.AddVector(
      vector=pz.nx.wrap(jnp.ones((model.config.hidden_size,))).tag(
          "embedding"),
      strength=pz.nx.wrap(jnp.asarray([np.nan, 0.0])).tag("batch"),
      where=interp.TokenRule.steps(2))
  patched = interp.insert_at(model, "blocks.0.resid_post", poison)
  options = dict(max_new_tokens=6, temperature=0.0, stop_tokens=[])
  result = generation.generate(patched, prompts, **options)
  clean = generation.generate(model, prompts, **options)
  assert result.finish_reasons == ["non_finite", "length"]
  # Tokens 0-2 come from finite logits (token 2's logits are computed
  # before token 2 is fed); feeding token 2 gives NaN.
  assert result.tokens[0] == clean.tokens[0][:3]
  assert result.tokens[1] == clean.tokens[1]
  assert all(np.isfinite(result.logprobs[0]))
