"""Text level: the real SmolLM2 tokenizer with a tiny random model of the same
vocabulary size."""

import threading

from penzai_lm.generation import CalculatorTool
from penzai_lm.generation import StopStringMatcher
from penzai_lm.generation import generate
from penzai_lm.generation import generate_text
from penzai_lm.generation import stream_text
from penzai_lm.generation import text
from penzai_lm.tools import ToolCallParser

NEW = 12
SAMPLED = dict(max_new_tokens=NEW, temperature=1.0, seed=[5, 6],
               stop_tokens=[])
PROMPTS = ["Hello world", "Once upon a time"]
PARSER = ToolCallParser(call_start="<jupyter_code>",
                        call_end="<jupyter_output>",
                        output_start="<jupyter_text>",
                        output_end="<empty_output>")


def _pieces(stream):
  pieces, reasons = {}, {}
  for event in stream:
    pieces.setdefault(event.row, []).append(event.text)
    if event.finish_reason:
      reasons[event.row] = event.finish_reason
  return {r: "".join(p) for r, p in pieces.items()}, reasons


def test_streamed_pieces_concatenate_to_the_text(text_model, tok):
  s = stream_text(text_model, tok, PROMPTS, chunk_size=3, **SAMPLED)
  joined, reasons = _pieces(s)
  result = s.result
  assert [joined[0], joined[1]] == result.texts
  assert reasons == {0: "length", 1: "length"}
  once = generate_text(text_model, tok, PROMPTS, **SAMPLED)
  assert once.texts == result.texts and once.tokens == result.tokens
  for tokens, text in zip(result.tokens, result.texts):
    assert tok.decode(tokens) == text
  assert result.prompt_lengths == [len(tok.encode(p)) for p in PROMPTS]
  # The token API gives the same tokens for the encoded prompts.
  ids = generate(text_model, [tok.encode(p) for p in PROMPTS], **SAMPLED)
  assert ids.tokens == result.tokens


def test_stop_string_removes_match_and_rest(text_model, tok):
  free = generate_text(text_model, tok, PROMPTS[0], **dict(SAMPLED, seed=5))
  text = free.text
  assert len(text) > 12
  stop = text[8:11]
  cut = text.index(stop)
  s = stream_text(text_model, tok, PROMPTS[0], stop_strings=[stop, "\x00"],
                  chunk_size=4, **dict(SAMPLED, seed=5))
  joined, reasons = _pieces(s)
  result = s.result
  assert result.text == text[:cut] == joined[0]
  assert reasons == {0: "stop"}
  assert result.finish_reasons == ["stop"]
  assert result.stop_strings_matched == [stop]
  # Tokens are cut right after the token that completes the match.
  kept = result.tokens[0]
  assert kept == free.tokens[0][:len(kept)]
  assert tok.decode(kept).startswith(text[:cut] + stop)
  assert not tok.decode(kept[:-1]).startswith(text[:cut] + stop)
  # generate_text gives the same, and per-row stop strings work.
  both = generate_text(text_model, tok, [PROMPTS[0], PROMPTS[0]],
                       stop_strings=[[stop], []], **dict(SAMPLED, seed=5))
  assert both.texts == [text[:cut], text]
  assert both.finish_reasons == ["stop", "length"]


def test_stop_token_text_is_excluded(text_model, tok):
  free = generate_text(text_model, tok, PROMPTS[1], **dict(SAMPLED, seed=6))
  stop_id = free.tokens[0][4]
  first = free.tokens[0].index(stop_id)
  result = generate_text(text_model, tok, PROMPTS[1], **dict(
      SAMPLED, seed=6, stop_tokens=[stop_id]))
  assert result.finish_reasons == ["stop"]
  assert result.tokens[0] == free.tokens[0][:first + 1]
  assert result.text == tok.decode(free.tokens[0][:first])


def test_default_stop_tokens_include_the_tokenizer_stops(text_model, tok):
  result = generate_text(text_model, tok, PROMPTS[0], max_new_tokens=NEW,
                         temperature=0.0, logit_bias={2: 1e4})
  assert result.tokens == [[2]]  # <|im_end|> (eos), forced by the bias.
  assert result.finish_reasons == ["stop"] and result.text == ""


def test_prompt_forms(tok):
  messages = [{"role": "user", "content": "What is 2+2?"}]
  assert text.encode_prompts(tok, messages) == [tok.encode_chat(messages)]
  assert text.encode_prompts(tok, "Hi") == [tok.encode("Hi")]
  assert text.encode_prompts(tok, ["Hi", messages, [5, 6]]) == [
      tok.encode("Hi"), tok.encode_chat(messages), [5, 6]]


def test_calculator_injects_the_result(text_model, tok):
  calc = CalculatorTool(tok, PARSER)
  call = [calc.call_start_id] + tok.encode("12*(3+4)")
  # Row 0 is steered into a call (forced expression, then the end marker
  # by a bias); row 1 is free and must not be affected by row 0's pauses.
  result = generate_text(
      text_model, tok, PROMPTS, max_new_tokens=NEW + 8, temperature=1.0,
      seed=[5, 6], stop_tokens=[], forced_tokens=[call, []],
      logit_bias=[{calc.call_end_id: 100.0}, {}], tool=calc)
  text = result.texts[0]
  assert text.startswith(
      "<jupyter_code>12*(3+4)<jupyter_output><jupyter_text>84<empty_output>")
  assert calc.calls == [("12*(3+4)", "84")]  # Later end markers: no call.
  reply = [calc.output_start_id] + tok.encode("84") + [calc.output_end_id]
  n = len(call)
  assert result.tokens[0][n] == calc.call_end_id
  assert result.tokens[0][n + 1:n + 1 + len(reply)] == reply
  assert result.forced[0][:n] == [True] * n
  assert result.forced[0][n] is False
  assert result.forced[0][n + 1:n + 1 + len(reply)] == [True] * len(reply)
  alone = generate_text(text_model, tok, PROMPTS[1], max_new_tokens=NEW + 8,
                        temperature=1.0, seed=6, stop_tokens=[])
  assert result.tokens[1] == alone.tokens[0]


def test_calculator_refusal_forces_nothing(text_model, tok):
  s = stream_text(text_model, tok, PROMPTS[0], calculator=PARSER,
                  max_new_tokens=NEW, temperature=0.0, stop_tokens=[],
                  forced_tokens=tok.encode("<jupyter_code>2**1000"),
                  logit_bias={tok.token_to_id("<jupyter_output>"): 100.0})
  joined, _ = _pieces(s)
  assert joined[0].startswith("<jupyter_code>2**1000<jupyter_output>"
                              "<jupyter_output>")
  assert "<jupyter_text>" not in joined[0]


def test_text_stream_cancellation(text_model, tok):
  cancel = threading.Event()
  s = stream_text(text_model, tok, PROMPTS, cancel=cancel, chunk_size=2,
                  **SAMPLED)
  pieces = {}
  for event in s:
    pieces.setdefault(event.row, []).append(event.text)
    cancel.set()
  result = s.result
  assert result.finish_reasons == ["cancelled", "cancelled"]
  assert ["".join(pieces[0]), "".join(pieces[1])] == result.texts
  assert result.lengths == [1, 1]


def test_text_stream_close(text_model, tok):
  with stream_text(text_model, tok, PROMPTS, chunk_size=2, **SAMPLED) as s:
    first = next(s)
  result = s.result
  assert result.finish_reasons == ["cancelled", "cancelled"]
  assert result.texts[0].startswith(first.text)


def test_stop_string_matcher_holds_back_partial_matches():
  m = StopStringMatcher(["END", "xy"])
  assert m.push("abcE") == ("abc", None)
  assert m.push("N") == ("", None)
  assert m.push("Dzz") == ("", "END")
  assert m.match_end == 6
  m = StopStringMatcher(["END"])
  assert m.push("aE") == ("a", None)
  assert m.push("x") == ("Ex", None)
  assert m.flush() == ""
  m = StopStringMatcher(["abc", "b"])
  assert m.push("ab") == ("a", "b")  # Earliest match wins.
