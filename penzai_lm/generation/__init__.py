"""Compiled generation for penzai_lm models.

Token level (knows nothing about text):

* `generate(model, prompts, **settings) -> GenerationResult`
* `stream(model, prompts, **settings) -> GenerationStream` of `TokenEvent`s

Text level (takes a `penzai_lm.tokenizer.Tokenizer`):

* `generate_text(model, tokenizer, prompt_or_prompts, **settings)`
  -> `GenerationResult` with ``texts``
* `stream_text(model, tokenizer, prompt_or_prompts, **settings)`
  -> `TextStream` of `TextEvent`s

Conversations that keep the KV cache between calls:

* `Session(model)`: token level, ``session.generate(new_ids, **settings)``
* `ChatSession(model, tokenizer)`: chat messages, ``chat.send(text)``

Tools: `CalculatorTool` (calculator calls answered with forced tokens).

See `penzai_lm.generation.engine` for the design of the compiled loop.
"""

from penzai_lm.generation.chat import ChatSession
from penzai_lm.generation.engine import clear_compiled_cache
from penzai_lm.generation.engine import generate
from penzai_lm.generation.forcing import CalculatorTool
from penzai_lm.generation.forcing import Tool
from penzai_lm.generation.results import FINISH_REASONS
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.results import Timings
from penzai_lm.generation.session import Session
from penzai_lm.generation.streaming import GenerationStream
from penzai_lm.generation.streaming import TokenEvent
from penzai_lm.generation.streaming import stream
from penzai_lm.generation.text import StopStringMatcher
from penzai_lm.generation.text import TextEvent
from penzai_lm.generation.text import TextStream
from penzai_lm.generation.text import generate_text
from penzai_lm.generation.text import stream_text

__all__ = [
    "CalculatorTool",
    "ChatSession",
    "FINISH_REASONS",
    "GenerationResult",
    "GenerationStream",
    "Session",
    "StopStringMatcher",
    "TextEvent",
    "TextStream",
    "Timings",
    "TokenEvent",
    "Tool",
    "clear_compiled_cache",
    "generate",
    "generate_text",
    "stream",
    "stream_text",
]
