"""lm-evaluation-harness for penzai_lm models (the optional ``[eval]``
extra): `LM`, registered in lm-eval as ``penzai_lm``.

* ``penzai_lm.evals.LM(model, tokenizer)`` scores a model in memory
  (patched, spliced, steered, quantized or sharded) with
  ``lm_eval.simple_evaluate(model=LM(...), tasks=[...])``;
* ``python -m penzai_lm.evals --model penzai_lm --model_args
  model=smollm2-135m-instruct --tasks ...`` is lm-eval's command line with
  the model registered; ``model_args`` may steer it (``control_vector=``,
  ``control_strength=``) or clamp an SAE feature (``sae=``,
  ``sae_feature=``, ``sae_value=``, ``sae_point=``);
* ``penzai_lm.evals.sweep(lm, pairs, strengths, intervene)`` scores an
  intervention at several strengths, the strengths as rows of one batch.
"""

from penzai_lm.evals.lm import LM
from penzai_lm.evals.scoring import score_rows
from penzai_lm.evals.strength_sweep import SweepResult
from penzai_lm.evals.strength_sweep import sweep

__all__ = ["LM", "SweepResult", "score_rows", "sweep"]
