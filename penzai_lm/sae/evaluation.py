"""How good an autoencoder is, on held-out tokens: `evaluate_sae`.

The standard figures (SAELens's evals, Gemma Scope's tables):

* ``l0``: features active per token, on average;
* ``explained_variance``: ``1 - sum |x - x_hat|^2 / sum |x - mean x|^2``
  over the tokens;
* ``mse``: ``|x - x_hat|^2`` per token (summed over the value's units);
* ``dead_fraction``: features that fire on none of the tokens;
* cross-entropy of the next token three ways: the clean model, the model
  with the reconstruction in place of the value (``ce_spliced``: the
  splice's "replace" mode, `penzai_lm.sae.splice`), and with the value
  zeroed (``ce_zero_ablated``); ``ce_recovered`` is ``(zero - spliced) /
  (zero - clean)``: 1 when splicing costs nothing, 0 when it is as bad as
  deleting the value.

Tokens an autoencoder is not trained on are left alone (neither replaced
nor zeroed, nor counted in the SAE figures), as in training
(`penzai_lm.sae.training`): the first ``skip_positions`` of each window
(the attention sink at position 0) and, given ``max_norm``, tokens whose
value is longer than it (other attention sinks, with norms ~100x the
rest). Cross-entropies count the predictions made at positions from
``skip_positions`` on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp.token_rules import TokenRule
from penzai_lm.model import points as points_lib
from penzai_lm.runtime.shared_traces import share_block_traces
from penzai_lm.runtime.unstack import unstack_layers
from penzai_lm.sae.activations import check_token_ids
from penzai_lm.sae.activations import PointActivations
from penzai_lm.sae.autoencoder import FEATURES
from penzai_lm.sae.autoencoder import SparseAutoencoder

_FAR = 1 << 30


@dataclasses.dataclass(frozen=True)
class SAEMetrics:
  """An autoencoder's figures on held-out tokens (module docstring)."""

  tokens: int
  l0: float
  explained_variance: float
  mse: float
  dead_fraction: float
  ce_clean: float
  ce_spliced: float
  ce_zero_ablated: float

  @property
  def ce_recovered(self) -> float:
    gap = self.ce_zero_ablated - self.ce_clean
    return float("nan") if gap == 0 else (
        (self.ce_zero_ablated - self.ce_spliced) / gap)

  @property
  def ce_increase(self) -> float:
    """``ce_spliced - ce_clean`` (nats per token)."""
    return self.ce_spliced - self.ce_clean

  def summary(self) -> str:
    return (f"L0 {self.l0:.1f}, explained variance"
            f" {self.explained_variance:.3f}, MSE {self.mse:.4g}, dead"
            f" {self.dead_fraction:.1%}; CE clean {self.ce_clean:.3f},"
            f" spliced {self.ce_spliced:.3f}, zero-ablated"
            f" {self.ce_zero_ablated:.3f} -> {self.ce_recovered:.1%}"
            f" recovered ({self.tokens} tokens)")


@pz.pytree_dataclass
class Replace(pz.nn.Layer):
  """Replaces the value by an autoencoder's reconstruction (or by zeros,
  with ``sae=None``) at the tokens ``where`` selects whose value's norm is
  at most ``max_norm`` (at every token, with no limit: what a "replace"
  splice does)."""

  sae: SparseAutoencoder | None
  where: TokenRule
  max_norm: pz.nx.NamedArray

  def __call__(self, x, /, **side_inputs):
    if self.sae is None:
      out = pz.nx.zeros(x.named_shape, x.dtype)
    else:
      out = self.sae.forward(x).astype(x.dtype)
    mask = self.where.mask(side_inputs) & (
        _norm(x, self.sae_axes(x)) <= self.max_norm)
    return pz.nx.order_like(pz.nx.nmap(jnp.where)(mask, out, x), x)

  def sae_axes(self, x) -> tuple[str, ...]:
    return tuple(a for a in x.named_shape if a not in ("batch", "seq"))


def _norm(x, axes):
  squares = pz.nx.nmap(jnp.square)(x.astype(jnp.float32))
  for axis in axes:
    squares = squares.untag(axis).sum()
  return pz.nx.nmap(jnp.sqrt)(squares)


def evaluate_sae(model, sae: SparseAutoencoder, tokens, *,
                 point: str | None = None, skip_positions: int = 1,
                 max_norm: float | None = None, rows: int = 8
                 ) -> SAEMetrics:
  """The figures of the module docstring for ``sae`` at ``point``.

  Args:
    model: The uncached `TransformerLM` the autoencoder reads.
    sae: An SAE (reads and writes one point).
    tokens: ``[windows, length]`` ids (the windows are run ``rows`` at a
      time; a last partial group is run on its own).
    point: Where it reads (default: its config's ``hook_point``).
    skip_positions: Leading tokens of each window left alone.
    max_norm: Tokens whose value is longer are left alone (None: none;
      `train_sae` passes its ``TrainingReport.norm_limit``).
    rows: Windows per forward pass.

  Raises:
    ValueError: for a transcoder, a missing point, too short windows, or
      ids outside the vocabulary.
  """
  if sae.config.is_transcoder:
    raise ValueError("evaluate_sae measures SAEs (one point read and"
                     " written); this autoencoder is a transcoder.")
  point = point or sae.config.hook_point
  if point is None:
    raise ValueError("the autoencoder's config names no point: pass"
                     " point='blocks.{i}.resid_post' (or another).")
  windows = np.asarray(tokens)
  check_token_ids(windows, model.config.vocab_size, "tokens")
  windows = windows.astype(np.int32)
  if windows.ndim != 2 or windows.shape[1] <= skip_positions + 1:
    raise ValueError(f"tokens must be [windows, length] with length >"
                     f" skip_positions + 1, got shape {windows.shape}.")
  reader = PointActivations(model, point, skip_positions)
  if dict(reader.input_axes) != dict(sae.config.input_axes):
    raise ValueError(f"the autoencoder reads axes {dict(sae.config.input_axes)}"
                     f" but {point!r} has {dict(reader.input_axes)}.")
  if pz.select(model).at_instances_of(pz.nn.LayerStack).count():
    # Per-block layers (as `splice` makes): the reconstruction runs in its
    # block only, not masked in every block of the stack's scan.
    model = unstack_layers(model)
  rule = TokenRule.positions(skip_positions, _FAR)
  limit = pz.nx.wrap(jnp.asarray(
      np.inf if max_norm is None else max_norm, jnp.float32))
  models = {
      "clean": model,
      "spliced": points_lib.insert_at(model, point, Replace(sae, rule, limit)),
      "zero": points_lib.insert_at(model, point, Replace(None, rule, limit)),
  }
  axes = tuple(reader.input_axes)
  totals = dict.fromkeys(("clean", "spliced", "zero", "error", "l0",
                          "count", "sums", "squares"), 0.0)
  fired = np.zeros(sae.config.num_features, bool)
  for start in range(0, windows.shape[0], rows):
    group = windows[start:start + rows]
    ids = pz.nx.wrap(jnp.asarray(group)).tag("batch", "seq")
    for name, m in models.items():
      totals[name] += float(_ce_sum(m, ids, skip_positions))
    stats = jax.device_get(_sae_stats(sae, reader(group), limit.data_array,
                                      axes=axes))
    for name in ("error", "l0", "count", "squares"):
      totals[name] += float(stats[name])
    totals["sums"] = totals["sums"] + stats["sums"].astype(np.float64)
    fired |= stats["fired"]
  n = totals["count"]
  predictions = windows.shape[0] * (windows.shape[1] - 1 - skip_positions)
  if not n:
    raise ValueError("no token of these windows is evaluated: all are"
                     " skipped or longer than max_norm.")
  spread = totals["squares"] - float(np.square(totals["sums"]).sum()) / n
  return SAEMetrics(
      tokens=int(n), l0=totals["l0"] / n,
      explained_variance=1.0 - totals["error"] / max(spread, 1e-12),
      mse=totals["error"] / n, dead_fraction=float(1.0 - fired.mean()),
      ce_clean=totals["clean"] / predictions,
      ce_spliced=totals["spliced"] / predictions,
      ce_zero_ablated=totals["zero"] / predictions)


@jax.jit
def _ce_sum(model, ids, skip):
  """Summed next-token cross-entropy of the predictions made at positions
  ``skip .. length - 2`` (``skip`` traced: one program for any). Blocks
  of one structure share one trace."""
  logits = share_block_traces(model)(ids).unwrap("batch", "seq", "vocabulary")
  logits = logits.astype(jnp.float32)
  tokens = ids.unwrap("batch", "seq")
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  counted = jnp.arange(nll.shape[1]) >= skip
  return jnp.where(counted, nll, 0.0).sum()


@functools.partial(jax.jit, static_argnames=("axes",))
def _sae_stats(sae, x, limit, *, axes):
  """Sums over the tokens of ``x`` ``[tokens, d]`` no longer than
  ``limit``."""
  kept = jnp.linalg.norm(x, axis=-1) <= limit
  named = pz.nx.wrap(x.reshape(x.shape[0], *(n for _, n in axes))).tag(
      "tokens", *(a for a, _ in axes))
  features = sae.encode(named).unwrap("tokens", FEATURES)
  recon = sae.forward(named).unwrap("tokens", *(a for a, _ in axes))
  error = jnp.square(recon.reshape(x.shape) - x).sum(-1)
  active = (features > 0) & kept[:, None]
  kept_x = jnp.where(kept[:, None], x, 0.0)
  return {"error": jnp.where(kept, error, 0.0).sum(), "l0": active.sum(),
          "fired": active.any(0), "count": kept.sum(),
          "sums": kept_x.sum(0), "squares": jnp.square(kept_x).sum()}
