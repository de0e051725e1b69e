"""Tokenizers for the models penzai_lm runs, built on Hugging Face `tokenizers`.

* `Tokenizer.from_gguf(path_or_reader)`: from a GGUF file's metadata.
* `Tokenizer.from_hf(directory)`: from a Hugging Face ``tokenizer.json``.
* `IncrementalDetokenizer`: streaming decode for generation.
* `TokenizerFileError`: a malformed tokenizer file (names file and field).
* `ChatTemplateError` / `TemplateLimitError`: a chat template that fails,
  or goes over its size, time or memory bounds.
"""

from penzai_lm.tokenizer.detokenizer import IncrementalDetokenizer
from penzai_lm.tokenizer.template_budget import ChatTemplateError
from penzai_lm.tokenizer.template_budget import TemplateLimitError
from penzai_lm.tokenizer.tokenizer import Tokenizer
from penzai_lm.tokenizer.tokenizer import TokenizerFileError

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "TemplateLimitError",
           "Tokenizer", "TokenizerFileError"]
