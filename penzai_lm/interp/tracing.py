"""Causal tracing (Meng et al., 2022, "Locating and Editing Factual
Associations in GPT"): the corrupted run is the clean prompt with Gaussian
noise added to some tokens' embeddings, several noise samples at once.

``patching_sweep(model, clean_ids, corrupt=GaussianNoise(positions=[1, 2,
3]), point="mlp_out", window=10, metric=AnswerProb(answer))`` restores the
clean value at each (block, position) of the noised runs, as ROME's
figures do. The samples are a ``noise`` axis the runs broadcast over (one
compiled program for all of them); a metric sees it as a batch axis
(`LogitDiff` and `AnswerProb`, in `penzai_lm.interp.metrics`, average
over it).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

NOISE_AXIS = "noise"


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class GaussianNoise:
  """Noise on the embeddings of some positions: the corruption of causal
  tracing.

  Attributes:
    positions: The token positions to corrupt (e.g. the subject's tokens).
    scale: The noise's standard deviation; None: 3 times the standard
      deviation of the model's token embeddings (as the model scales them),
      Meng et al.'s choice.
    samples: Noise samples, each a run of its own (a ``noise`` axis).
    seed: Seed of the noise (the same seed gives the same noise).
  """

  positions: tuple[int, ...]
  scale: float | None = None
  samples: int = 10
  seed: int = 0

  def __post_init__(self):
    positions = self.positions
    positions = [positions] if _is_int(positions) else list(positions)
    if not positions or not all(_is_int(p) and p >= 0 for p in positions):
      raise ValueError(
          "GaussianNoise.positions must be one or more token positions (ints"
          f" >= 0), got {self.positions!r}.")
    object.__setattr__(self, "positions", tuple(int(p) for p in positions))
    if self.scale is not None and not (
        isinstance(self.scale, numbers.Real) and np.isfinite(self.scale)
        and self.scale > 0):
      raise ValueError(
          "GaussianNoise.scale must be a finite number > 0 or None (3 x the"
          f" embeddings' standard deviation), got {self.scale!r}.")
    if not _is_int(self.samples) or self.samples < 1:
      raise ValueError(f"GaussianNoise.samples must be an int >= 1, got"
                       f" {self.samples!r}.")
    if not _is_int(self.seed):
      raise ValueError(f"GaussianNoise.seed must be an int, got"
                       f" {self.seed!r}.")

  def noise(self, model, embedding_table: pz.nx.NamedArray,
            seq: int) -> pz.nx.NamedArray:
    """``(noise, seq, embedding)`` float32: zero outside ``positions``.

    Raises:
      ValueError: for a position outside the prompt's ``seq`` tokens.
    """
    outside = [p for p in self.positions if p >= seq]
    if outside:
      raise ValueError(
          f"GaussianNoise.positions {outside} are outside the prompt's {seq}"
          f" tokens (0 to {seq - 1}).")
    scale = self.scale
    if scale is None:
      factor = model.config.embedding_scale or 1.0
      table = embedding_table.unwrap("vocabulary", "embedding")
      scale = 3.0 * float(jnp.std(table.astype(jnp.float32))) * factor
    hidden = embedding_table.named_shape["embedding"]
    draws = jax.random.normal(jax.random.key(self.seed),
                              (self.samples, len(self.positions), hidden))
    noise = jnp.zeros((self.samples, seq, hidden), jnp.float32)
    noise = noise.at[:, list(self.positions)].set(scale * draws)
    return pz.nx.wrap(noise).tag(NOISE_AXIS, "seq", "embedding")


@pz.pytree_dataclass
class AddNoise(pz.nn.Layer):
  """Adds ``noise`` to the rows of a sweep batch that ``rows`` selects.

  Attributes:
    noise: ``(noise, seq, embedding)``.
    rows: Bool over the sweep axis: the rows corrupted (not the clean
      baseline).
  """

  noise: pz.nx.NamedArray
  rows: pz.nx.NamedArray

  def __call__(self, x, /, **_side_inputs):
    noisy = x + self.noise.astype(x.dtype)
    return pz.nx.nmap(jnp.where)(self.rows, noisy, x)
