"""Looking up architecture specs, and tables derived from them.

The architectures themselves are declared in
:mod:`~penzai_lm.checkpoints.specs`; this module finds a spec by name
(:func:`spec_for`), words the "unsupported architecture" errors shared by the
readers, and keeps the read-only per-architecture tables older code imports
(:data:`ARCHITECTURE_CLASSES`, :data:`MODEL_TYPES`, :data:`CONFIG_DEFAULTS`),
all derived from :data:`~penzai_lm.checkpoints.specs.SPECS`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.spec_types import frozen_map
from penzai_lm.checkpoints.specs import SPECS

# Canonical architecture name -> HF causal-LM class.
ARCHITECTURE_CLASSES: Mapping[str, str] = frozen_map(
    {s.name: s.hf_class for s in SPECS}
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(s.name for s in SPECS)

# The ``model_type`` HF writes into config.json for each architecture.
MODEL_TYPES: Mapping[str, str] = frozen_map(
    {s.name: s.model_type for s in SPECS}
)

# Defaults of each architecture's transformers 5.x config class.
CONFIG_DEFAULTS: Mapping[str, Mapping[str, Any]] = frozen_map(
    {s.name: s.config_defaults for s in SPECS}
)


def unsupported_architecture_message(what: str, supported: str) -> str:
  """The error message for an architecture outside ``supported``."""
  return f"Unsupported architecture {what}. Supported: {supported}."


def spec_for(
    architecture: str | ArchitectureSpec,
    specs: Sequence[ArchitectureSpec] = SPECS,
) -> ArchitectureSpec:
  """The spec of ``architecture``; a spec is returned as it is.

  Args:
    architecture: A canonical architecture name, or a spec.
    specs: The specs to look the name up in.

  Raises:
    ValueError: no spec in ``specs`` has that name; the message lists those
      that do.
  """
  if isinstance(architecture, ArchitectureSpec):
    return architecture
  for spec in specs:
    if spec.name == architecture:
      return spec
  raise ValueError(
      unsupported_architecture_message(
          repr(architecture), ", ".join(s.name for s in specs)
      )
  )


def check_architecture(architecture: str) -> None:
  """Raises ValueError for an architecture not in SUPPORTED_ARCHITECTURES."""
  spec_for(architecture)
