"""Autoencoder files: SAELens, Gemma Scope 1 and 2, circuit-tracer.

* `load_sae(path, ...)`: one SAE or transcoder (SAELens directories, Gemma
  Scope ``params.npz`` / ``params.safetensors``, a circuit-tracer layer
  file), with the file's hook names mapped to penzai_lm points
  (`hook_names`).
* `load_transcoders(path, ...)`: a circuit-tracer ``config.yaml``: a
  `TranscoderSet` (one transcoder per block) or a `CrossLayerTranscoder`.
* `save_sae(sae, directory)`: SAELens 6's format.

Malformed files raise `SAEFormatError` naming the file and the field or
tensor. Every file is opened through `penzai_lm.file_access` (regular files
only: a FIFO or device is refused, never waited on) and written atomically
without following links; ``.npz`` members are checked against their
headers before they are inflated (`npz_files`); the files a
``config.yaml`` lists stay inside its folder unless the caller passes
``allow_outside=True`` (`layer_files`); with ``model=`` every point must
exist in the model. Each module's docstring gives its format, with the
reference code it follows.
"""

from penzai_lm.sae.formats.circuit_tracer import TranscoderSet
from penzai_lm.sae.formats.cross_layer import CrossLayerTranscoder
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.formats.load import load_sae
from penzai_lm.sae.formats.load import load_transcoders
from penzai_lm.sae.formats.load import save_sae

__all__ = [
    "CrossLayerTranscoder",
    "SAEFormatError",
    "TranscoderSet",
    "load_sae",
    "load_transcoders",
    "save_sae",
]
