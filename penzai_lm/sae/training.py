"""Training sparse autoencoders in JAX: `train_sae`.

::

    sae, report = train_sae(model, "blocks.15.resid_post", token_ids,
                            TrainConfig(activation="topk", k=32,
                                        expansion_factor=16,
                                        total_tokens=2_000_000),
                            save_to="my_sae")
    print(report.evaluation.summary())

The pipeline:

1. token ids are cut into ``context_length`` windows (`activations`), the
   model runs ``model_batch`` windows at a time in one compiled program and
   the point's values (without each window's first ``skip_positions``
   tokens, and those longer than ``max_norm_ratio`` times the median: the
   attention sinks) go through a bounded shuffle buffer;
2. the first batches fix the input scale (SAELens's
   ``expected_average_only_in``: mean norm ``sqrt(d_in)``) and ``b_dec``
   (their geometric median, or mean);
3. each batch is one compiled Adam step (`train_step`: SAELens's losses for
   ReLU + L1, TopK + AuxK, JumpReLU + L0; the same program every step);
   dead features (not fired for ``dead_feature_window`` steps) feed AuxK and
   are resampled every ``resample_every`` steps if set;
4. the result is folded into a `SparseAutoencoder` on the unscaled values
   with unit-norm decoder rows, evaluated on held-out windows
   (`evaluate_sae`: L0, explained variance, MSE, dead features, CE loss
   recovered when spliced) and saved in SAELens's format if asked.

`train_sae_on_activations` runs steps 2-4 (without the CE figures) on
precomputed activations.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from penzai_lm.sae import activations as acts_lib
from penzai_lm.sae import train_step as step_lib
from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.evaluation import SAEMetrics
from penzai_lm.sae.evaluation import evaluate_sae
from penzai_lm.sae.formats import save_sae
from penzai_lm.sae.sae_config import SAEConfig
from penzai_lm.sae.train_config import TrainConfig

# Activations that fix the input scale and b_dec before the first step.
_INIT_TOKENS = 4096

@dataclasses.dataclass(frozen=True)
class LogEntry:
  """Training figures averaged over ``log_every`` steps ending at ``step``
  (on the scaled activations the steps see)."""

  step: int
  tokens: int
  loss: float
  mse: float
  sparsity_loss: float
  aux_loss: float
  l0: float
  explained_variance: float
  dead_fraction: float
  lr: float


@dataclasses.dataclass(frozen=True)
class TrainingReport:
  """What `train_sae` did.

  Attributes:
    config: The configuration.
    point: The point trained on (None for precomputed activations).
    steps: Steps taken (fewer than asked if the token source ran out).
    tokens: Activations trained on.
    history: One `LogEntry` per ``log_every`` steps (and the last step).
    resampled: ``(step, features resampled)`` per resampling.
    input_scale: The factor the activations were scaled by in training.
    seconds: Wall time of the training loop (forward passes included).
    norm_limit: Activations longer than this were dropped (None: none).
    dropped_tokens: How many were.
    evaluation: Held-out figures (`evaluate_sae`), or None.
    saved_to: Where the SAELens directory was written, or None.
  """

  config: TrainConfig
  point: str | None
  steps: int
  tokens: int
  history: tuple[LogEntry, ...]
  resampled: tuple[tuple[int, int], ...]
  input_scale: float
  seconds: float
  norm_limit: float | None = None
  dropped_tokens: int = 0
  evaluation: SAEMetrics | None = None
  saved_to: Path | None = None

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds if self.seconds else float("nan")

  @property
  def final(self) -> LogEntry:
    return self.history[-1]


def train_sae(model, point: str, tokens, config: TrainConfig, *,
              eval_tokens=None, save_to=None, progress: bool = True,
              model_name: str | None = None
              ) -> tuple[SparseAutoencoder, TrainingReport]:
  """Trains an SAE on the values at ``point`` (module docstring).

  Args:
    model: An uncached `TransformerLM`.
    point: E.g. ``"blocks.15.resid_post"`` (any point of fixed width:
      ``resid_*``, ``attn_out``, ``mlp_out``, ``mlp.neurons``,
      ``attn.head_out`` (SAELens's ``hook_z``)).
    tokens: A 1-D stream of ids, ``[windows, context_length]`` ids (both
      cycled), or an iterable of such 2-D batches (read once).
    config: A `TrainConfig`.
    eval_tokens: ``[windows, length]`` held-out ids for the evaluation
      (default: ``config.eval_windows`` windows held out of ``tokens``).
    save_to: A directory to write the SAE to in SAELens's format, with the
      metadata SAELens's ``ActivationsStore.from_sae`` reads
      (``context_size``, ``prepend_bos`` false: windows are cut from the
      ids as given, ``seqpos_slice`` ``[skip_positions, null]``,
      ``hook_name``, ``model_name``).
    progress: Show a progress bar.
    model_name: Recorded as the saved metadata's ``model_name`` (the name
      TransformerLens loads the model by).

  Returns:
    ``(sae, report)``: the trained `SparseAutoencoder` (reading ``point``)
    and a `TrainingReport`.
  """
  if not isinstance(config, TrainConfig):
    raise TypeError(f"config must be a TrainConfig, got"
                    f" {type(config).__name__}.")
  reader = acts_lib.PointActivations(model, point, config.skip_positions)
  config.features(reader.d_in)  # Checks k and memory before any forward.
  vocab = model.config.vocab_size
  if eval_tokens is None:
    tokens, eval_tokens = acts_lib.split_held_out(
        tokens, config.context_length, config.eval_windows, vocab=vocab)
  else:
    acts_lib.check_token_ids(np.asarray(eval_tokens), vocab, "eval_tokens")
  windows = acts_lib.token_windows(tokens, config.context_length,
                                   config.seed, vocab=vocab)
  norms = acts_lib.NormFilter(config.max_norm_ratio)
  chunks = norms(acts_lib.finite_chunks(
      reader.stream(windows, config.model_batch), f"the values at {point}"))
  sae, report = _fit(_buffer(config).batches(chunks), reader.input_axes,
                     config, point, progress, norms)
  if eval_tokens is not None:
    metrics = evaluate_sae(model, sae, eval_tokens, point=point,
                           skip_positions=config.skip_positions,
                           max_norm=report.norm_limit,
                           rows=config.model_batch)
    report = dataclasses.replace(report, evaluation=metrics)
  if save_to is not None:
    report = dataclasses.replace(report, saved_to=_save(
        sae, report, save_to, model_name))
  return sae, report


def train_sae_on_activations(activations, config: TrainConfig, *,
                             input_axes=None, hook_point: str | None = None,
                             progress: bool = True
                             ) -> tuple[SparseAutoencoder, TrainingReport]:
  """Trains on precomputed activations (no model, no CE figures).

  Args:
    activations: ``[tokens, d_in]`` values (cycled, shuffled each pass), or
      an iterable of ``[n, d_in]`` chunks (read once, through the shuffle
      buffer).
    config: A `TrainConfig` (the window and model fields are unused).
    input_axes: The value's axes, ``((name, size), ...)`` (default:
      ``(("embedding", d_in),)``).
    hook_point: Recorded in the SAE's config.
    progress: Show a progress bar.
  """
  if not isinstance(config, TrainConfig):
    raise TypeError(f"config must be a TrainConfig, got"
                    f" {type(config).__name__}.")
  norms = acts_lib.NormFilter(config.max_norm_ratio)
  if isinstance(activations, (np.ndarray, jax.Array)):
    data = np.asarray(activations, np.float32)
    if data.ndim == 2:
      acts_lib.check_finite_rows(data, "activations")
      data = next(norms([data]))
    if data.ndim != 2 or data.shape[0] < config.batch_tokens:
      raise ValueError(f"activations must be [tokens, d_in] with at least"
                       f" batch_tokens={config.batch_tokens} rows, got shape"
                       f" {data.shape}.")
    batches = _epochs(data, config.batch_tokens, config.seed)
    d_in = data.shape[1]
  else:
    chunks = iter(activations)
    first = np.asarray(next(chunks, np.zeros((0, 0))), np.float32)
    if first.ndim != 2 or not first.size:
      raise ValueError("activations must give [n, d_in] chunks, got shape"
                       f" {first.shape} first.")
    batches = _buffer(config).batches(norms(acts_lib.finite_chunks(
        itertools.chain([first], chunks), "activations")))
    d_in = first.shape[1]
  axes = tuple(input_axes or (("embedding", d_in),))
  if math.prod(n for _, n in axes) != d_in:
    raise ValueError(f"input_axes {axes} do not hold the activations' width"
                     f" {d_in}.")
  return _fit(batches, axes, config, hook_point, progress, norms)


def _buffer(config: TrainConfig) -> acts_lib.ShuffleBuffer:
  """The shuffle buffer, no larger than the tokens the run trains on.

  A buffer is filled before its first batch: a run shorter than the
  buffer (the sae notebook's: 40 steps of 512 tokens, 20,480 tokens, with
  the default 65,536-token buffer) ran the model for three times the
  activations it trained on (132 forward passes instead of ~60).
  """
  return acts_lib.ShuffleBuffer(
      min(config.buffer_tokens, config.steps * config.batch_tokens),
      config.batch_tokens, config.seed)


def _epochs(data, batch, seed):
  """Batches of ``data``, a new shuffle each pass (already mixed: no
  buffer)."""
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(data.shape[0])
    for start in range(0, data.shape[0] - batch + 1, batch):
      yield data[order[start:start + batch]]


def _fit(batches, input_axes, cfg: TrainConfig, point, progress,
         norms: acts_lib.NormFilter):
  """Steps 2-4 of the module docstring on ``[batch_tokens, d_in]``
  batches."""
  d_in = math.prod(n for _, n in input_axes)
  width = cfg.features(d_in)
  start = time.perf_counter()
  first = list(itertools.islice(batches,
                                max(1, -(-_INIT_TOKENS // cfg.batch_tokens))))
  if not first:
    raise ValueError("the source gave no full batch of"
                     f" batch_tokens={cfg.batch_tokens} activations.")
  sample = np.concatenate(first)
  scale = 1.0
  if cfg.normalize_activations == "expected_average_only_in":
    mean_norm = float(np.linalg.norm(sample, axis=-1).mean())
    if not 0 < mean_norm < math.inf:
      raise ValueError(
          f"the first {sample.shape[0]} activations have mean norm"
          f" {mean_norm}: they cannot be scaled to sqrt(d_in). Check their"
          " source, or pass normalize_activations='none'.")
    scale = math.sqrt(d_in) / mean_norm
  scaled = jnp.asarray(sample * scale)
  b_dec = {"geometric_median": step_lib.geometric_median,
           "mean": lambda s: s.mean(0),
           "zeros": lambda s: jnp.zeros(d_in)}[cfg.b_dec_init](scaled)
  prog = step_lib.Program.of(cfg)
  total = cfg.total_steps
  h = step_lib.hyper(cfg, total)
  state = step_lib.init_state(b_dec, cfg.seed, h["init_threshold"],
                              features=width,
                              jumprelu=cfg.activation == "jumprelu")
  scale_array = jnp.asarray(scale, jnp.float32)
  key = jax.random.key(cfg.seed + 1)
  history, resampled, pending = [], [], []
  steps = 0
  bar = tqdm(total=total, desc="Training SAE", unit="step",
             disable=not progress)
  with bar:
    for x in itertools.chain(first, batches):
      x = jnp.asarray(x)
      state, metrics = step_lib.train_step(state, x, scale_array, h,
                                           prog=prog)
      pending.append(metrics)
      steps += 1
      if cfg.resample_every and steps % cfg.resample_every == 0:
        state, count = step_lib.resample(
            state, x, scale_array, jax.random.fold_in(key, steps), h,
            prog=prog)
        resampled.append((steps, int(count)))
      if steps % cfg.log_every == 0 or steps == total:
        entry = _log_entry(pending, steps, cfg)
        history.append(entry)
        pending = []
        bar.set_postfix(loss=f"{entry.loss:.4g}", l0=f"{entry.l0:.1f}",
                        ev=f"{entry.explained_variance:.3f}",
                        dead=f"{entry.dead_fraction:.1%}", refresh=False)
      bar.update(1)
      if steps == total:
        break
  if pending:  # The source ran out between two logs.
    history.append(_log_entry(pending, steps, cfg))
  flat = jax.device_get(step_lib.fold(
      state.params, scale_array,
      fold_norms=cfg.activation != "topk" or prog.rescale))
  seconds = time.perf_counter() - start
  sae = SparseAutoencoder.from_arrays(
      SAEConfig(activation=cfg.activation, num_features=width,
                input_axes=tuple(input_axes), output_axes=tuple(input_axes),
                k=cfg.k if cfg.activation == "topk" else None,
                apply_b_dec_to_input=True, hook_point=point), **flat)
  report = TrainingReport(config=cfg, point=point, steps=steps,
                          tokens=steps * cfg.batch_tokens,
                          history=tuple(history), resampled=tuple(resampled),
                          input_scale=scale, seconds=seconds,
                          norm_limit=norms.limit,
                          dropped_tokens=norms.dropped)
  return sae, report


def _log_entry(pending, step: int, cfg: TrainConfig) -> LogEntry:
  """The mean of the ``pending`` steps' metrics, ending at ``step``.

  Raises:
    FloatingPointError: naming the first of them whose loss or weights
      became non-finite.
  """
  values = jax.device_get(pending)  # One wait for the steps' results.
  for i, v in enumerate(values):
    if not v["finite"]:
      raise FloatingPointError(
          f"SAE training diverged at step {step - len(values) + i + 1}: the"
          f" loss ({float(v['loss'])}) or the weights became NaN or inf with"
          f" learning_rate={cfg.learning_rate}. Lower"
          " TrainConfig.learning_rate (SAELens's default: 3e-4) or"
          " grad_clip_norm.")
  means = {k: float(np.mean([v[k] for v in values])) for k in values[0]}
  return LogEntry(step=step, tokens=step * cfg.batch_tokens,
                  loss=means["loss"],
                  mse=means["mse"], sparsity_loss=means["sparsity_loss"],
                  aux_loss=means["aux_loss"], l0=means["l0"],
                  explained_variance=means["explained_variance"],
                  dead_fraction=means["dead_fraction"], lr=means["lr"])


def _save(sae, report: TrainingReport, directory, model_name) -> Path:
  cfg = report.config
  metadata = {"context_size": cfg.context_length, "prepend_bos": False,
              "seqpos_slice": [cfg.skip_positions, None],
              "training_tokens": report.tokens,
              "l0": report.final.l0 if report.history else None,
              "trained_by": "penzai_lm.sae.train_sae"}
  if report.evaluation is not None:
    metadata["ce_loss_recovered"] = report.evaluation.ce_recovered
    metadata["explained_variance"] = report.evaluation.explained_variance
  return save_sae(sae, directory, model_name=model_name, metadata=metadata)
