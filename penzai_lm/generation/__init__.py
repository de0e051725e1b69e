"""Compiled generation for penzai_lm models.

Token level (knows nothing about text):

* `generate(model, prompts, **options) -> GenerationResult`
* `stream(model, prompts, **options) -> GenerationStream`, an iterator of `StreamEvent`

Text level (takes a `penzai_lm.tokenizer.Tokenizer`):

* `generate_text(model, tokenizer, prompt_or_prompts, **options)`
  -> `GenerationResult` with ``texts``
* `stream_text(model, tokenizer, prompt_or_prompts, **options)`
  -> `GenerationStream` whose events carry ``text`` (a `TextView`)

Conversations that keep the KV cache between calls:

* `Session(model)`: token level, ``session.generate(new_ids, **options)``
* `ChatSession(model, tokenizer)`: chat messages, ``chat.send(text)``

Both run one turn at a time when shared by threads (`SessionBusyError` for
a second concurrent stream); an `Engine` is safe to share.

Tools: `CalculatorTool` (calculator calls answered with forced tokens).

Every function runs on an `Engine` (`default_engine()` unless ``engine=``
is given), which owns the compiled programs and prepared models. The data
path, top to bottom: `request.py` (validate once) -> `engine.py` (prepare,
cache) -> `run.py` (drive) -> `prefill.py` and `programs.py` (prefill,
decode loop), with the typed state in `state.py`, shapes in `shapes.py`
and, for a model sharded over a mesh (`penzai_lm.shard`), the state's
shardings in `placement.py`.
"""

from penzai_lm.generation.chat import ChatSession
from penzai_lm.generation.engine import clear_compiled_cache
from penzai_lm.generation.engine import default_engine
from penzai_lm.generation.engine import Engine
from penzai_lm.generation.engine import generate
from penzai_lm.generation.engine import stream
from penzai_lm.generation.forcing import CalculatorTool
from penzai_lm.generation.forcing import Tool
from penzai_lm.generation.results import FINISH_REASONS
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.results import Timings
from penzai_lm.generation.session import Session
from penzai_lm.generation.session import SessionBusyError
from penzai_lm.generation.stop_strings import StopStringMatcher
from penzai_lm.generation.stream import GenerationStream
from penzai_lm.generation.stream import StreamEvent
from penzai_lm.generation.text import generate_text
from penzai_lm.generation.text import stream_text
from penzai_lm.generation.text import TextView
from penzai_lm.runtime.program_store import ProgramStore  # Documented in runtime.

__all__ = [
    "CalculatorTool",
    "ChatSession",
    "Engine",
    "FINISH_REASONS",
    "GenerationResult",
    "GenerationStream",
    "Session",
    "SessionBusyError",
    "StopStringMatcher",
    "StreamEvent",
    "TextView",
    "Timings",
    "Tool",
    "clear_compiled_cache",
    "default_engine",
    "generate",
    "generate_text",
    "stream",
    "stream_text",
]
