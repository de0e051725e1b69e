"""The progress bar of `penzai_lm.load`: tqdm on stderr, when watched.

`show_progress` decides: an explicit ``progress=True/False`` wins; else the
``PENZAI_LM_PROGRESS`` environment variable ("0"/"false"/"off"/"no" or
"1"/"true"/"on"/"yes"); else only when stderr is a terminal (not in logs,
pipes or CI). Even then tqdm's ``delay`` keeps a load that ends within
`DELAY_S` seconds silent: SmolLM2 loads in about one second.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, TextIO

ENV_VAR = "PENZAI_LM_PROGRESS"
DELAY_S = 3.0
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def show_progress(
    requested: bool | None,
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
  """Whether a load shows a progress bar.

  Args:
    requested: The caller's choice; None decides from the environment.
    stream: Where the bar would go (default: ``sys.stderr``).
    environ: The environment (default: ``os.environ``).
  """
  if requested is not None:
    return bool(requested)
  setting = (environ if environ is not None else os.environ).get(ENV_VAR, "")
  if setting.strip().lower() in _OFF:
    return False
  if setting.strip().lower() in _ON:
    return True
  stream = sys.stderr if stream is None else stream
  isatty = getattr(stream, "isatty", None)
  try:
    return bool(isatty and isatty())
  except ValueError:  # a closed stream
    return False


def progress_bar(total_bytes: int, description: str, enabled: bool):
  """A tqdm bar over ``total_bytes`` on stderr (a no-op one if disabled).

  Use it as a context manager; ``update(nbytes)`` advances it.
  """
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm(
      total=total_bytes, desc=description, unit="B", unit_scale=True,
      unit_divisor=1024, delay=DELAY_S, disable=not enabled,
      file=sys.stderr, leave=False,
  )
