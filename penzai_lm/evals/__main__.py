"""``python -m penzai_lm.evals ...``: lm-eval's command line (``lm_eval
...``) with the ``penzai_lm`` model registered (running this module
imported `penzai_lm.evals`, which registers it)."""

from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
  cli_evaluate()
