"""generate(..., capture=[...]): values recorded in the compiled loop equal a
plain forward pass over prompt + output, per row, for every family and both
layouts, in `generate`, `stream` and the recompute reference."""

import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import generation
from penzai_lm import interp
from tests.model.configs import config

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
NAMES = ["embed", "blocks.1.resid_post", "blocks.0.attn.head_out",
         "blocks.1.attn.pattern", "blocks.0.mlp.neurons", "final_norm"]


def _np(x, like):
  return np.asarray(x.unwrap(*like.named_shape))


def _check_against_forward(model, prompts, result, names, atol=2e-5):
  # One forward pass over every row, left-padded to the longest (positions
  # count from each row's first token): one program, not one per length.
  rows = [list(p) + t for p, t in zip(prompts, result.tokens)]
  want = interp.run_with_cache(model, rows, names=names)
  longest = max(map(len, rows))
  for row, full in enumerate(rows):
    unpadded = pz.slice[longest - len(full):]
    for name in names:
      got = result.captures[name][row]
      expected = want[name][{"batch": row}]
      expected = expected[{axis: unpadded for axis in ("seq", "kv_seq")
                           if axis in expected.named_shape}]
      assert dict(got.named_shape) == dict(expected.named_shape), name
      np.testing.assert_allclose(_np(got, expected), _np(expected, expected),
                                 atol=atol, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3", "gpt2"])
@pytest.mark.parametrize("stacked", [True, False])
def test_captures_equal_a_forward_pass_over_prompt_and_output(name, stacked):
  model = penzai_lm.build_transformer(config(name, stacked), seed=3)
  # Decode the stack as it is too (the engine unstacks it by default).
  engine = generation.Engine(unstack_layer_stacks=not stacked)
  result = engine.generate(model, PROMPTS, max_new_tokens=[6, 3, 5],
                           temperature=0.0, stop_tokens=[], capture=NAMES)
  assert result.lengths == [6, 3, 5]
  for row, prompt in enumerate(PROMPTS):
    n = len(prompt) + result.lengths[row]  # The last token's values too.
    assert result.captures["embed"][row].named_shape["seq"] == n
  _check_against_forward(model, PROMPTS, result, NAMES)


def test_captures_with_stop_tokens_samples_and_the_recompute_loop():
  model = penzai_lm.build_transformer(config("llama_gqa", False), seed=3)
  engine = generation.Engine()
  names = ["blocks.1.resid_post", "blocks.1.attn.pattern"]
  plain = engine.generate(model, PROMPTS, max_new_tokens=8, temperature=0.0,
                          stop_tokens=[])
  stop = plain.tokens[1][2]  # Row 1 stops on its third token.
  result = engine.generate(model, PROMPTS, max_new_tokens=8,
                           temperature=0.0, stop_tokens=[stop],
                           capture=names)
  assert result.finish_reasons[1] == "stop" and result.lengths[1] == 3
  _check_against_forward(model, PROMPTS, result, names)
  reference = engine.generate(model, PROMPTS, max_new_tokens=8,
                              temperature=0.0, stop_tokens=[stop],
                              capture=names, use_cache=False)
  assert reference.tokens == result.tokens
  for name in names:
    for a, b in zip(result.captures[name], reference.captures[name]):
      np.testing.assert_allclose(_np(a, a), _np(b, a), atol=2e-5)
  sampled = engine.generate(model, PROMPTS[:2], max_new_tokens=4,
                            temperature=1.0, seed=[1, 2], num_samples=2,
                            stop_tokens=[], capture=names)
  _check_against_forward(model, [p for p in PROMPTS[:2] for _ in range(2)],
                         sampled, names)


def test_streamed_captures_add_up_to_the_result_and_do_not_recompile():
  model = penzai_lm.build_transformer(config("gemma3", False), seed=3)
  engine = generation.Engine()
  names = ["blocks.0.resid_post"]
  options = dict(max_new_tokens=[6, 3, 5], temperature=0.0, stop_tokens=[],
                 capture=names)
  result = engine.generate(model, PROMPTS, **options)
  compiled = engine.compilations
  pieces = {r: [] for r in range(3)}
  finished = {}
  with engine.stream(model, PROMPTS, chunk_size=2, **options) as s:
    for event in s:
      pieces[event.row].append(event.captures[names[0]])
      if event.finish_reason:
        finished[event.row] = event.finish_reason
  assert finished == {0: "length", 1: "length", 2: "length"}
  for row in range(3):
    streamed = np.concatenate([_np(p, p) for p in pieces[row]
                               if p.named_shape["seq"]])
    whole = result.captures[names[0]][row]
    np.testing.assert_allclose(streamed, _np(whole, pieces[row][0]),
                               atol=1e-6)
  # Other prompts and values, same capture list and buckets: no compile.
  engine.generate(model, [[3, 3, 3], [4], [5, 6]], **options)
  assert engine.compilations == compiled


def test_capture_errors_name_the_problem():
  model = penzai_lm.build_transformer(config("llama_gqa", False), seed=3)
  with pytest.raises(ValueError, match="did you mean 'resid_post'"):
    generation.generate(model, [1, 2], capture=["blocks.0.resid_pots"])
  with pytest.raises(ValueError, match=r"does not exist: the model has 3 blocks"):
    generation.generate(model, [1, 2], capture="blocks.7.resid_post")
  with pytest.raises(ValueError, match="capture must be a point name"):
    generation.generate(model, [1, 2], capture=3)
  result = generation.generate(model, [1, 2], max_new_tokens=2)
  assert result.captures is None


def test_session_turns_capture_their_own_tokens():
  """A session's turn records the tokens it feeds: the previous turn's last
  token (fed first, counted in the turn's prompt_lengths), its prompt and
  its output, equal to a forward pass over the whole conversation."""
  model = penzai_lm.build_transformer(config("llama_gqa", False), seed=3)
  session = generation.Session(model)
  options = dict(temperature=0.0, stop_tokens=[], capture=["blocks.1.mlp_out"])
  first = session.generate([1, 2, 3, 4], max_new_tokens=4, **options)
  second = session.generate([5, 6], max_new_tokens=3, **options)
  conversation = [1, 2, 3, 4] + first.tokens[0] + [5, 6] + second.tokens[0]
  want = interp.run_with_cache(model, [conversation],
                               names=["blocks.1.mlp_out"])
  whole = want["blocks.1.mlp_out"][{"batch": 0}]
  got = second.captures["blocks.1.mlp_out"][0]
  n = second.prompt_lengths[0] + second.lengths[0]
  assert got.named_shape["seq"] == n == 6
  np.testing.assert_allclose(_np(got, whole),
                             _np(whole, whole)[len(conversation) - n:],
                             atol=2e-5)
