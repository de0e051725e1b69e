"""ChatSession: turns append to the cache and equal re-reading the chat."""

import pytest

from penzai_lm.generation import generate_text
from penzai_lm.generation.chat import ChatSession

GREEDY = dict(temperature=0.0, max_new_tokens=6)


def _reference(model, tok, messages, **settings):
  """The reply when the whole conversation is read at once."""
  return generate_text(model, tok, messages, **settings)


def test_turns_keep_the_cache_and_equal_rereading(text_model, tok):
  chat = ChatSession(text_model, tok, system="Be brief.")
  first = "".join(e.text for e in chat.send("What is 2+2?", **GREEDY))
  expected = _reference(text_model, tok, chat.messages[:2], **GREEDY)
  assert first == expected.texts[0]
  assert chat.last_result.tokens == expected.tokens
  second = chat.reply("And 3+3?", **GREEDY)
  assert chat.rereads == 0
  history = chat.messages[:4]
  assert [m["role"] for m in history] == [
      "system", "user", "assistant", "user"]
  assert history[2]["content"] == first
  expected = _reference(text_model, tok, history, **GREEDY)
  assert second == expected.texts[0]
  assert chat.last_result.tokens == expected.tokens
  # The second turn prefilled only its own tokens (plus the pending one).
  rendered_all = len(tok.encode_chat(history))
  assert chat.last_prefill_tokens < rendered_all // 2


def test_stop_string_cut_rereads_and_stays_exact(text_model, tok):
  chat = ChatSession(text_model, tok)
  first = chat.reply("Tell me a story.", max_new_tokens=8, temperature=0.0)
  assert first  # A random model says something.
  tokens = chat.last_result.tokens[0]
  # Stop on the text of the reply's second token: the cut reply is not what
  # the cache holds, so the next turn reads the conversation again.
  piece = tok.decode(tokens[1:2])
  chat2 = ChatSession(text_model, tok)
  cut = chat2.reply("Tell me a story.", max_new_tokens=8, temperature=0.0,
                    stop_strings=[piece])
  assert chat2.last_result.finish_reasons == ["stop"]
  second = chat2.reply("Go on.", **GREEDY)
  assert chat2.rereads == 1
  expected = _reference(text_model, tok, chat2.messages[:3], **GREEDY)
  assert chat2.messages[1]["content"] == cut
  assert second == expected.texts[0]


def test_an_interrupted_reply_joins_the_conversation(text_model, tok):
  chat = ChatSession(text_model, tok)
  stream = chat.send("Count to ten.", max_new_tokens=8, temperature=0.0,
                     chunk_size=2)
  next(stream)
  stream.close()
  assert chat.last_result.finish_reasons == ["cancelled"]
  chat.reply("Thanks.", **GREEDY)
  assert chat.rereads == 0
  partial = chat.messages[1]
  assert partial["role"] == "assistant"
  expected = _reference(text_model, tok, chat.messages[:3], **GREEDY)
  assert chat.messages[3]["content"] == expected.texts[0]


def test_reset_keeps_the_system_message(text_model, tok):
  chat = ChatSession(text_model, tok, system="Be brief.")
  chat.reply("Hi.", **GREEDY)
  chat.reset()
  assert chat.messages == [{"role": "system", "content": "Be brief."}]
  assert chat.session.tokens == []
  reply = chat.reply("Hello.", **GREEDY)
  assert reply == _reference(text_model, tok, chat.messages[:2],
                             **GREEDY).texts[0]


def test_bad_input(text_model, tok):
  chat = ChatSession(text_model, tok)
  with pytest.raises(TypeError, match="content must be a str"):
    chat.send(["hi"])
  with pytest.raises(ValueError, match="top_p"):
    chat.reply("hi", top_p=0.0)
  assert chat.messages == []  # The failed turn left nothing behind.
  assert chat.reply("hi", **GREEDY) == _reference(
      text_model, tok, [{"role": "user", "content": "hi"}], **GREEDY).texts[0]
