"""penzai_lm: run, inspect, patch and sample language models in JAX.

>>> import penzai_lm
>>> model, tokenizer = penzai_lm.load()           # SmolLM2-135M-Instruct
>>> penzai_lm.generate_text(model, tokenizer, "The capital of France is",
...                         temperature=0.0, max_new_tokens=8).texts[0]
>>> chat = penzai_lm.ChatSession(model, tokenizer)  # Keeps its KV cache.
>>> chat.reply("Name a prime number.", temperature=0.0)
>>> cached = penzai_lm.KVCachingTransformerLM.from_uncached(
...     model, cache_len=256, batch_axes={"batch": 1})
>>> small, _ = penzai_lm.load(quantize="keep")  # the GGUF's Q4_1 blocks
>>> sharded = penzai_lm.shard(model, jax.make_mesh((2, 4), ("data", "model")))
"""

from penzai_lm.generation import ChatSession
from penzai_lm.generation import Engine
from penzai_lm.generation import Session
from penzai_lm.generation import generate
from penzai_lm.generation import generate_text
from penzai_lm.generation import stream
from penzai_lm.generation import stream_text
from penzai_lm.loading import load
from penzai_lm.loading import load_model
from penzai_lm.model import CacheOverflowError
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import RopeScaling
from penzai_lm.model import TransformerConfig
from penzai_lm.model import TransformerLM
from penzai_lm.model import build_transformer
from penzai_lm.model import eager
from penzai_lm.model import leading_padding
from penzai_lm.model import positions_from_padding
from penzai_lm.quantization import quantize
from penzai_lm.sharding import ShardingRules
from penzai_lm.sharding import shard
from penzai_lm.tokenizer import IncrementalDetokenizer
from penzai_lm.tokenizer import Tokenizer

__version__ = "0.1.0"
