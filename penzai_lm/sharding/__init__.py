"""Sharding a model over a device mesh, by the names of its axes.

Conventions:

* A `ShardingRules` maps named axes (see `penzai_lm.model.transformer` for
  the names) to mesh axes. An axis it does not list, or lists with ``()``,
  stays whole (replicated). `DEFAULT_RULES`: tensor parallelism on a mesh
  axis ``"model"`` over attention heads (``heads``, ``head_groups``), MLP
  ``neurons`` and the ``vocabulary`` (embedding and unembedding), and data
  parallelism on a mesh axis ``"data"`` over ``batch`` (used by the
  generation engine for its per-row state; no weight has a batch axis).
* `shard(model, mesh, rules)` places every parameter (``pz.Parameter`` or
  ``pz.ParameterValue`` holding a named array) with a
  ``jax.sharding.NamedSharding`` built from its axis names; a parameter axis
  a mesh axis does not divide is an error, never silently replicated.
  `parameter_sharding` is the same rule for one array (for loaders that place
  each tensor as they read it).
* A quantized projection (`penzai_lm.quantization.QuantizedLinear`) keeps
  its output axes flattened into ``quant_out`` and its input axes into
  ``quant_in`` (values) and ``quant_groups`` (scale groups). Each flattened
  axis splits as the layer's leading output / input axis does (a query
  projection's ``quant_out`` over ``head_groups``, an MLP down projection's
  ``quant_in`` over ``neurons``), which cuts it into contiguous runs of
  whole rows and whole scale groups; a rule that splits a later axis of
  the flattened ones, or scale groups that do not divide, is an error.
* Programs run SPMD with automatic propagation: meshes are used with
  ``AxisType.Auto`` axes (``jax.make_mesh`` makes ``Explicit`` ones, whose
  sharding-in-types would reject the model's contractions over sharded
  axes), so a mesh of either kind gives the same placement.
* Multi-host: call ``jax.distributed.initialize()`` in every process, build
  the mesh over ``jax.devices()`` (all processes' devices) and run the same
  code in every process.

penzai's ``toolshed.sharding_util.name_to_name_sharding`` maps names the same
way, but neither checks that a mesh axis divides the axis it splits nor
counts a named array's positional axes, so the spec is built here.
"""

from penzai_lm.sharding.rules import DEFAULT_RULES
from penzai_lm.sharding.rules import KNOWN_AXES
from penzai_lm.sharding.rules import MeshAxes
from penzai_lm.sharding.rules import ShardingRules
from penzai_lm.sharding.rules import check_mesh
from penzai_lm.sharding.rules import resolve_rules
from penzai_lm.sharding.shard import ModelSharding
from penzai_lm.sharding.shard import model_sharding
from penzai_lm.sharding.shard import shard
from penzai_lm.sharding.specs import parameter_sharding
from penzai_lm.sharding.specs import state_sharding
