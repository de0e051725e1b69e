"""Builds a `TransformerLM` from a `TransformerConfig`.

The structure follows the config's feature fields (``norm_kind``,
``position_embedding``, ``mlp_kind``, biases, ``qk_norm``, ``post_norms``,
``embedding_scale``, soft-capping); the family name plays no part.

Parameters get path-like labels such as ``transformer/block_3/attention/query``
(per-layer blocks) or ``transformer/blocks/attention/query`` with a ``blocks``
axis (layer stack). With ``init_base_rng=None`` every parameter is a slot for
a loader to bind (`pz.bind_variables`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model import transformer
from penzai_lm.model.config import TransformerConfig
from penzai_lm.model.hooks import hook
from penzai_lm.model.layers import AddLearnedPositionEmbeddings
from penzai_lm.model.layers import ApplyRotaryEmbedding
from penzai_lm.model.layers import SoftCap
from penzai_lm.model.random_init import random_parameters
from penzai_lm.model.stacking import stack_blocks
from penzai_lm.model.tracing import full

# Mask fill value used by Gemma (any large finite negative value works).
MASKED_OUT = -2.3819763e38
# Window of a global layer when it shares a layer stack with local layers.
GLOBAL_WINDOW = 2**30


def _linear(name, rng, config, input_axes, output_axes, bias=False):
  layers = [
      pz.nn.Linear.from_config(
          name=name,
          init_base_rng=rng,
          input_axes=input_axes,
          output_axes=output_axes,
          dtype=config.parameter_dtype,
      )
  ]
  if bias:
    layers.append(
        pz.nn.AddBias.from_config(
            name=name,
            init_base_rng=rng,
            biased_axes=output_axes,
            dtype=config.parameter_dtype,
        )
    )
  return layers


def _norm(name, rng, config, axes, kind=None):
  """A norm of ``config.norm_kind`` (or ``kind``) over ``axes``."""
  # Epsilon an array of the parameters' dtype, made on the host (`full`).
  epsilon = full((), config.norm_eps, config.parameter_dtype)
  if (kind or config.norm_kind) == "layer":
    return pz.nn.LayerNorm.from_config(
        name=name, init_base_rng=rng, across_axes=axes,
        epsilon=epsilon, dtype=config.parameter_dtype,
    )
  return pz.nn.RMSLayerNorm.from_config(
      name=name, init_base_rng=rng, across_axes=axes,
      epsilon=epsilon, dtype=config.parameter_dtype,
  )


def _in_float32(fn, x):
  """``fn(x)`` computed in float32 and rounded once to a 16-bit ``x``'s
  dtype, as PyTorch computes activations of 16-bit tensors (XLA would round
  after every op of the formula: slower on CPU and further from PyTorch;
  docs/cpu-speed.md)."""
  if jnp.dtype(x.dtype).itemsize < 4 and jnp.issubdtype(x.dtype, jnp.floating):
    return fn(x.astype(jnp.float32)).astype(x.dtype)
  return fn(x)


def silu(x):
  """SiLU (SwiGLU's gate), in float32 for 16-bit inputs (`_in_float32`)."""
  return _in_float32(jax.nn.silu, x)


def gelu_tanh(x):
  """GELU with the tanh approximation (Gemma's GeGLU, GPT-2's gelu_new), in
  float32 for 16-bit inputs."""
  return _in_float32(lambda v: jax.nn.gelu(v, approximate=True), x)


def gelu_exact(x):
  """GELU with the exact erf formula, in float32 for 16-bit inputs."""
  return _in_float32(lambda v: jax.nn.gelu(v, approximate=False), x)


# Module-level functions, so blocks built separately compare equal.
ACTIVATION_FUNCTIONS = {
    "silu": silu, "gelu_tanh": gelu_tanh, "gelu": gelu_exact
}


def build_feedforward(name, rng, config, layer=None
                      ) -> transformer.TransformerFeedForward:
  """The MLP: gated (GLU) or plain two-layer, per ``config.mlp_kind``, with
  the ``mlp.neurons`` hook point on its hidden activations."""
  embedding = {"embedding": config.hidden_size}
  neurons = {"neurons": config.mlp_hidden_size}
  act = pz.nn.Elementwise(ACTIVATION_FUNCTIONS[config.activation])
  bias = config.mlp_bias
  if config.mlp_kind == "plain":
    return transformer.TransformerFeedForward([
        *_linear(f"{name}/in_linear", rng, config, embedding, neurons, bias),
        act,
        hook("mlp.neurons", layer),
        *_linear(f"{name}/out_linear", rng, config, neurons, embedding, bias),
    ])
  value = _linear(f"{name}/value_linear", rng, config, embedding, neurons, bias)
  return transformer.TransformerFeedForward([
      pz.nn.BranchAndMultiplyTogether(branches=[
          pz.nn.NamedGroup("gate", [
              *_linear(
                  f"{name}/gating_linear", rng, config, embedding, neurons, bias
              ),
              act,
          ]),
          # One branch: the projection, or the projection and its bias.
          value[0] if len(value) == 1 else pz.nn.Sequential(value),
      ]),
      hook("mlp.neurons", layer),
      *_linear(f"{name}/out_linear", rng, config, neurons, embedding, bias),
  ])


def _attention_mask(config, layer_type, mixed):
  """The mask layer; with ``mixed``, every layer uses a windowed mask."""
  if layer_type == "local" or mixed:
    window = config.sliding_window if layer_type == "local" else GLOBAL_WINDOW
    return pz.nn.ApplyCausalSlidingWindowAttentionMask(
        masked_out_value=full((), MASKED_OUT, config.activation_dtype),
        sliding_window_size=pz.nx.wrap(full((), window, jnp.int32)),
    )
  return pz.nn.ApplyCausalAttentionMask(
      masked_out_value=full((), MASKED_OUT, config.activation_dtype)
  )


def _rope(config, layer_type):
  if config.position_embedding != "rope":
    return []
  if layer_type == "local" and config.local_rope_base is not None:
    return [ApplyRotaryEmbedding.from_config(config.head_dim, config.local_rope_base)]
  return [ApplyRotaryEmbedding.from_config(
      config.head_dim, config.rope_base, config.rope_scaling
  )]


def _qk_norm(name, rng, config, axes, enabled):
  """The per-head query or key RMSNorm, if ``enabled``."""
  return [_norm(name, rng, config, axes, kind="rms")] if enabled else []


def _softcap(cap):
  """A soft-capping layer, or nothing when ``cap`` is None."""
  return [] if cap is None else [SoftCap(cap=float(cap))]


def build_attention(name, rng, config, layer_type, mixed, layer=None
                    ) -> pz.nn.Attention:
  """One attention layer (hook points ``attn.pattern`` after the softmax and
  ``attn.head_out`` before the output projection)."""
  common, query_only = config.head_axes
  embedding = {"embedding": config.hidden_size}
  kv_axes = {**common, "projection": config.head_dim}
  q_axes = {**common, **query_only, "projection": config.head_dim}
  qkv_bias, qk_norm = config.qkv_bias, config.qk_norm
  projection = {"projection": config.head_dim}
  q_names = {ax: ax for ax in q_axes if ax != "projection"}
  kv_names = {ax: ax for ax in common}

  def einsum(lhs, rhs, out):
    return pz.nn.NamedEinsum((lhs, rhs), out)

  query_key = einsum(
      {"seq": "tq", **q_names, "projection": "p"},
      {"seq": "tkv", **kv_names, "projection": "p"},
      {"seq": "tq", **q_names, "kv_seq": "tkv"},
  )
  weights_value = einsum(
      {"seq": "tq", **q_names, "kv_seq": "tkv"},
      {"seq": "tkv", **kv_names, "projection": "p"},
      {"seq": "tq", **q_names, "projection": "p"},
  )
  return pz.nn.Attention(
      input_to_query=pz.nn.Sequential([
          *_linear(f"{name}/query", rng, config, embedding, q_axes, qkv_bias),
          *_qk_norm(f"{name}/query_norm", rng, config, projection, qk_norm),
          *_rope(config, layer_type),
          pz.nn.ConstantRescale(
              by=full((), config.query_scale, config.activation_dtype)
          ),
      ]),
      input_to_key=pz.nn.Sequential([
          *_linear(f"{name}/key", rng, config, embedding, kv_axes, qkv_bias),
          *_qk_norm(f"{name}/key_norm", rng, config, projection, qk_norm),
          *_rope(config, layer_type),
      ]),
      input_to_value=pz.nn.Sequential(
          _linear(f"{name}/value", rng, config, embedding, kv_axes, qkv_bias)
      ),
      query_key_to_attn=pz.nn.Sequential([
          query_key,
          *_softcap(config.attn_logit_softcap),
          _attention_mask(config, layer_type, mixed),
          pz.nn.Softmax("kv_seq"),
          hook("attn.pattern", layer),
      ]),
      attn_value_to_output=pz.nn.Sequential([
          weights_value,
          hook("attn.head_out", layer),
          *_linear(
              f"{name}/output", rng, config, q_axes, embedding,
              config.attention_output_bias,
          ),
      ]),
  )


def build_block(name, rng, config, layer_type, mixed, layer: int
                ) -> transformer.TransformerBlock:
  """Block ``layer``, with its hook points (`penzai_lm.model.hooks`)."""
  embedding = {"embedding": config.hidden_size}
  post_norms = config.post_norms
  attention = [
      _norm(f"{name}/pre_attention_norm", rng, config, embedding),
      build_attention(f"{name}/attention", rng, config, layer_type, mixed,
                      layer),
  ]
  mlp = [
      _norm(f"{name}/pre_ffw_norm", rng, config, embedding),
      hook("mlp_in", layer),
      build_feedforward(f"{name}/mlp", rng, config, layer),
  ]
  if post_norms:
    attention.append(_norm(f"{name}/post_attention_norm", rng, config, embedding))
    mlp.append(_norm(f"{name}/post_ffw_norm", rng, config, embedding))
  return transformer.TransformerBlock([
      hook("resid_pre", layer),
      pz.nn.Residual(pz.nn.Sequential([*attention, hook("attn_out", layer)])),
      hook("resid_mid", layer),
      pz.nn.Residual(pz.nn.Sequential([*mlp, hook("mlp_out", layer)])),
      hook("resid_post", layer),
  ])


def build_transformer(
    config: TransformerConfig,
    seed: int | None = None,
    name: str = "transformer",
    *,
    freeze: bool = True,
    on_device: bool = False,
) -> transformer.TransformerLM:
  """Builds a `TransformerLM`.

  Args:
    config: The architecture.
    seed: Integer seed for random weights, or None to leave every parameter
      as a slot for a loader to bind (`pz.bind_variables`).
    name: Prefix of every parameter label.
    freeze: Random weights as `pz.ParameterValue` leaves (a plain pytree,
      as `penzai_lm.load` returns); False gives `pz.Parameter` variables.
    on_device: Draw random weights with `jax.random` on the default device
      (other values than numpy's for the same seed; seconds where numpy on
      the host takes minutes for an 8B model).

  Returns:
    The uncached model.
  """
  model = _build(config, None, name)
  if seed is None:
    return model
  if not isinstance(seed, int):
    raise ValueError(f"seed must be an integer or None, got {seed!r}.")
  if not isinstance(freeze, bool):
    raise TypeError(f"freeze must be True or False, got {freeze!r}.")
  if not isinstance(on_device, bool):
    raise TypeError(f"on_device must be True or False, got {on_device!r}.")
  parameters = random_parameters(
      lambda rng: _build(config, rng, name), model, seed, on_device=on_device
  )
  model = pz.bind_variables(model, parameters)
  return pz.freeze_params(model) if freeze else model


def _build(config, rng, name) -> transformer.TransformerLM:
  """Builds the model; parameters are slots when ``rng`` is None."""
  embedding = {"embedding": config.hidden_size}
  table = pz.nn.EmbeddingTable.from_config(
      name=f"{name}/embedder",
      init_base_rng=rng,
      vocab_size=config.vocab_size,
      embedding_axes=embedding,
      dtype=config.parameter_dtype,
  )
  layers = [pz.nn.EmbeddingLookup(table)]
  if config.activation_dtype != config.parameter_dtype:
    layers.append(pz.nn.CastToDType(config.activation_dtype))
  if config.embedding_scale is not None and config.embedding_scale != 1:
    layers.append(pz.nn.ConstantRescale(
        by=full((), config.embedding_scale, config.activation_dtype)
    ))
  if config.position_embedding == "learned":
    layers.append(AddLearnedPositionEmbeddings.from_config(
        f"{name}/position_embedder", rng, config.max_position_embeddings,
        config.hidden_size, config.parameter_dtype,
    ))
  layers.append(hook("embed"))

  layer_types = config.resolved_layer_types
  mixed = config.use_layer_stack and len(set(layer_types)) > 1

  def layer_rng(index):
    return None if rng is None else jax.random.fold_in(rng, index)

  if config.use_layer_stack:
    blocks = [
        build_block(f"{name}/blocks", layer_rng(i), config, kind, mixed, i)
        for i, kind in enumerate(layer_types)
    ]
    layers.append(stack_blocks(blocks, stack_axis="blocks"))
  else:
    layers.extend(
        build_block(f"{name}/block_{i}", layer_rng(i), config, kind, mixed, i)
        for i, kind in enumerate(layer_types)
    )

  layers.append(_norm(f"{name}/final_norm", rng, config, embedding))
  layers.append(hook("final_norm"))
  if config.tie_embeddings:
    layers.append(pz.nn.EmbeddingDecode(table))
  else:
    layers.extend(_linear(
        f"{name}/lm_head", rng, config, embedding,
        {"vocabulary": config.vocab_size},
    ))
  layers.extend(_softcap(config.final_logit_softcap))
  return transformer.TransformerLM(body=pz.nn.Sequential(layers), config=config)
