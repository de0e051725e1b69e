"""Tools a model can call during generation (text in, text out).

Conventions: tool inputs and outputs are ``str``; the generation engine
decodes a finished call span to text and tokenizes the tool's reply into
forced tokens.
"""

from penzai_lm.tools.calculator import CalculatorError
from penzai_lm.tools.calculator import ToolCallParser
from penzai_lm.tools.calculator import evaluate

__all__ = ["CalculatorError", "ToolCallParser", "evaluate"]
