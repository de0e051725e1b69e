"""Interpretability tools: steering/control vectors; more to come.

Conventions: layers are numbered by the 0-based penzai_lm block index ``i``,
and a per-block vector acts on the residual stream after block ``i``
(TransformerLens's ``blocks.{i}.hook_resid_post``). Control vectors are read
and written in llama.cpp's GGUF control-vector format, shared with repeng;
see :mod:`penzai_lm.interp.control_vector_files` for the format and its
sources.
"""

from penzai_lm.interp.control_vector_files import load_control_vector
from penzai_lm.interp.control_vector_files import save_control_vector
from penzai_lm.interp.control_vectors import ControlVector

__all__ = ["ControlVector", "load_control_vector", "save_control_vector"]
