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

Two conventions (``compatible=``), which differ in which tokens count:

* ``None`` (the default, as in training, `penzai_lm.sae.training`): tokens
  an autoencoder is not trained on are left alone (neither replaced nor
  zeroed, nor counted in the SAE figures): the first ``skip_positions`` of
  each window (default 1: the attention sink at position 0) and, given
  ``max_norm``, tokens whose value is longer than it (other attention
  sinks, with norms ~100x the rest). Cross-entropies count the
  predictions made at positions from ``skip_positions`` on.
* ``"saelens"``: SAELens 6's ``run_evals`` (``get_recons_loss``,
  ``get_sparsity_and_variance_metrics``) with its default
  ``exclude_special_tokens=True``, on the same windows (no BOS prepended):
  every position counts (no skipped positions, no norm limit); tokens
  whose id is special (``ignore_tokens``, default the model config's BOS,
  EOS and padding ids) are left out of the SAE figures and keep their
  value in the spliced run, and the predictions made at them are not
  counted; the zero-ablated run zeroes the value at every token, special
  ones included. Averages are over tokens (as SAELens's concatenated
  per-token means), so `ce_recovered` is SAELens's ``ce_loss_score``.

Given ``ignore_tokens``, the default convention also leaves those tokens
alone (and zeroes them neither) and does not count the predictions made
at them.
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
_COMPATIBLE = (None, "saelens")


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
  with ``sae=None``) at the tokens ``where`` and ``keep`` (a bool named
  array over ``batch`` / ``seq``, or a scalar) select whose value's norm
  is at most ``max_norm`` (at every token, with no limits: what a
  "replace" splice does)."""

  sae: SparseAutoencoder | None
  where: TokenRule
  max_norm: pz.nx.NamedArray
  keep: pz.nx.NamedArray

  def __call__(self, x, /, **side_inputs):
    if self.sae is None:
      out = pz.nx.zeros(x.named_shape, x.dtype)
    else:
      out = self.sae.forward(x).astype(x.dtype)
    mask = self.where.mask(side_inputs) & self.keep & (
        _norm(x, self.sae_axes(x)) <= self.max_norm)
    return pz.nx.order_like(pz.nx.nmap(jnp.where)(mask, out, x), x)

  def sae_axes(self, x) -> tuple[str, ...]:
    return tuple(a for a in x.named_shape if a not in ("batch", "seq"))


def _norm(x, axes):
  squares = pz.nx.nmap(jnp.square)(x.astype(jnp.float32))
  for axis in axes:
    squares = squares.untag(axis).sum()
  return pz.nx.nmap(jnp.sqrt)(squares)


def sae_point(sae: SparseAutoencoder, point: str | None, what: str) -> str:
  """The point an SAE reads and writes: ``point``, else its config's.

  Raises:
    ValueError: for a transcoder (it writes another point), or no point.
  """
  if sae.config.is_transcoder:
    raise ValueError(f"{what} takes SAEs (one point read and written); this"
                     " autoencoder is a transcoder.")
  point = point or sae.config.hook_point
  if point is None:
    raise ValueError("the autoencoder's config names no point: pass"
                     " point='blocks.{i}.resid_post' (or another).")
  return point


def evaluate_sae(model, sae: SparseAutoencoder, tokens, *,
                 point: str | None = None, skip_positions: int | None = None,
                 max_norm: float | None = None, rows: int = 8,
                 compatible: str | None = None, ignore_tokens=None
                 ) -> SAEMetrics:
  """The figures of the module docstring for ``sae`` at ``point``.

  Args:
    model: The uncached `TransformerLM` the autoencoder reads.
    sae: An SAE (reads and writes one point).
    tokens: ``[windows, length]`` ids (the windows are run ``rows`` at a
      time; a last partial group is run on its own).
    point: Where it reads (default: its config's ``hook_point``).
    skip_positions: Leading tokens of each window left alone (default 1;
      ``compatible="saelens"`` allows only 0).
    max_norm: Tokens whose value is longer are left alone (None: none;
      `train_sae` passes its ``TrainingReport.norm_limit``; not with
      ``compatible="saelens"``).
    rows: Windows per forward pass.
    compatible: None (penzai_lm's convention) or ``"saelens"`` (SAELens's
      ``run_evals`` numbers): see the module docstring.
    ignore_tokens: Ids left alone wherever they occur (SAELens's
      ``exclude_special_tokens``); default: none, or with
      ``compatible="saelens"`` the model config's BOS, EOS and padding ids.

  Raises:
    ValueError: for a transcoder, a missing point, too short windows, ids
      outside the vocabulary, an unknown ``compatible``, or
      ``skip_positions`` / ``max_norm`` with ``compatible="saelens"``.
  """
  if compatible not in _COMPATIBLE:
    raise ValueError(f"compatible must be one of {_COMPATIBLE}, got"
                     f" {compatible!r}.")
  skip_positions, ignore = _conventions(model.config, compatible,
                                        skip_positions, max_norm,
                                        ignore_tokens)
  point = sae_point(sae, point, "evaluate_sae")
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
  everywhere = (TokenRule.positions(0, _FAR),
                pz.nx.wrap(jnp.asarray(np.inf, jnp.float32)),
                pz.nx.wrap(jnp.asarray(True)))
  axes = tuple(reader.input_axes)
  totals = dict.fromkeys(("clean", "spliced", "zero", "predictions", "error",
                          "l0", "count", "sums", "squares"), 0.0)
  fired = np.zeros(sae.config.num_features, bool)
  for start in range(0, windows.shape[0], rows):
    group = windows[start:start + rows]
    kept = ~np.isin(group, ignore)
    keep = pz.nx.wrap(jnp.asarray(kept)).tag("batch", "seq")
    left_alone = (rule, limit, keep)
    zeroed = everywhere if compatible == "saelens" else left_alone
    models = {
        "clean": model,
        "spliced": points_lib.insert_at(model, point,
                                        Replace(sae, *left_alone)),
        "zero": points_lib.insert_at(model, point, Replace(None, *zeroed)),
    }
    counted = kept[:, :-1] & (np.arange(group.shape[1] - 1) >= skip_positions)
    ids = pz.nx.wrap(jnp.asarray(group)).tag("batch", "seq")
    for name, m in models.items():
      totals[name] += float(_ce_sum(m, ids, jnp.asarray(counted)))
    totals["predictions"] += int(counted.sum())
    stats = jax.device_get(_sae_stats(
        sae, reader(group), limit.data_array,
        jnp.asarray(kept[:, skip_positions:].reshape(-1)), axes=axes))
    for name in ("error", "l0", "count", "squares"):
      totals[name] += float(stats[name])
    totals["sums"] = totals["sums"] + stats["sums"].astype(np.float64)
    fired |= stats["fired"]
  n, predictions = totals["count"], totals["predictions"]
  if not n or not predictions:
    raise ValueError("no token of these windows is evaluated: all are"
                     " skipped, in ignore_tokens or longer than max_norm.")
  spread = totals["squares"] - float(np.square(totals["sums"]).sum()) / n
  return SAEMetrics(
      tokens=int(n), l0=totals["l0"] / n,
      explained_variance=1.0 - totals["error"] / max(spread, 1e-12),
      mse=totals["error"] / n, dead_fraction=float(1.0 - fired.mean()),
      ce_clean=totals["clean"] / predictions,
      ce_spliced=totals["spliced"] / predictions,
      ce_zero_ablated=totals["zero"] / predictions)


def _conventions(config, compatible, skip_positions, max_norm, ignore_tokens
                 ) -> tuple[int, np.ndarray]:
  """``(skip_positions, ignored ids)`` for ``compatible``'s convention."""
  if compatible == "saelens":
    if skip_positions not in (None, 0) or max_norm is not None:
      raise ValueError(
          "compatible='saelens' evaluates every position with no norm"
          f" limit, as SAELens does; got skip_positions={skip_positions!r},"
          f" max_norm={max_norm!r}: drop them (or drop compatible= for"
          " penzai_lm's convention).")
    skip_positions = 0
    if ignore_tokens is None:
      ignore_tokens = [i for i in (config.bos_token_id, *config.eos_token_ids,
                                   config.pad_token_id) if i is not None]
  elif skip_positions is None:
    skip_positions = 1
  if isinstance(skip_positions, bool) or not isinstance(skip_positions, int
                                                        ) or skip_positions < 0:
    raise ValueError(f"skip_positions must be an int >= 0, got"
                     f" {skip_positions!r}.")
  if ignore_tokens is not None and (
      isinstance(ignore_tokens, (int, str, bytes))
      or not hasattr(ignore_tokens, "__iter__")):
    raise TypeError(f"ignore_tokens must be a list of token ids, got"
                    f" {ignore_tokens!r}.")
  ids = np.asarray(list(ignore_tokens or ()))
  if ids.size:
    check_token_ids(ids, config.vocab_size, "ignore_tokens")
  return skip_positions, ids.astype(np.int32)


@jax.jit
def _ce_sum(model, ids, counted):
  """Summed next-token cross-entropy of the predictions ``counted``
  (``[rows, length - 1]`` bool: made at positions ``0 .. length - 2``).
  Blocks of one structure share one trace."""
  logits = share_block_traces(model)(ids).unwrap("batch", "seq", "vocabulary")
  logits = logits.astype(jnp.float32)
  tokens = ids.unwrap("batch", "seq")
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  return jnp.where(counted, nll, 0.0).sum()


@functools.partial(jax.jit, static_argnames=("axes",))
def _sae_stats(sae, x, limit, keep, *, axes):
  """Sums over the tokens of ``x`` ``[tokens, d]`` that ``keep`` selects
  and are no longer than ``limit``."""
  kept = keep & (jnp.linalg.norm(x, axis=-1) <= limit)
  named = pz.nx.wrap(x.reshape(x.shape[0], *(n for _, n in axes))).tag(
      "tokens", *(a for a, _ in axes))
  features = sae.encode(named).unwrap("tokens", FEATURES)
  recon = sae.forward(named).unwrap("tokens", *(a for a, _ in axes))
  error = jnp.square(recon.reshape(x.shape) - x).sum(-1)
  active = (features != 0) & kept[:, None]
  kept_x = jnp.where(kept[:, None], x, 0.0)
  return {"error": jnp.where(kept, error, 0.0).sum(), "l0": active.sum(),
          "fired": active.any(0), "count": kept.sum(),
          "sums": kept_x.sum(0), "squares": jnp.square(kept_x).sum()}
