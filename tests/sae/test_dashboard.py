"""Feature dashboards: the numbers against a plain forward pass per prompt
and the autoencoder's own encode, and the HTML page rendered by a real
browser (Debian's chromium, headless): one section per feature, every
example shown, hostile token text escaped."""

import dataclasses
import html.parser
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

import penzai_lm
from penzai_lm import interp
from penzai_lm import sae as sae_lib
from penzai_lm.sae.dashboard import Example
from penzai_lm.tokenizer import Tokenizer
from tests.model.configs import config
from tests.tokenizer.conftest import write_tiny_bpe_gguf

POINT = "blocks.1.resid_post"
TEXTS = ["hello world, hello again", "the <script>alert(1)</script> tag",
         "world hello world", "a b c d e f g"]
FEATURES = [0, 3, 17, 40]


@pytest.fixture(name="setup", scope="module")
def _setup(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tok")
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("PENZAI_LM_CACHE", str(folder / "cache"))
    tokenizer = Tokenizer.from_gguf(write_tiny_bpe_gguf(folder / "t.gguf"))
  model = penzai_lm.build_transformer(
      dataclasses.replace(config("llama_gqa", True), vocab_size=268), seed=3)
  hidden = model.config.hidden_size
  cfg = sae_lib.SAEConfig(
      activation="relu", num_features=2 * hidden, hook_point=POINT,
      input_axes=(("embedding", hidden),),
      output_axes=(("embedding", hidden),))
  return model, tokenizer, sae_lib.SparseAutoencoder.random(cfg, 0)


def test_cards_equal_a_forward_pass_per_prompt(setup):
  model, tokenizer, sae = setup
  board = sae_lib.dashboard(model, sae, TEXTS, features=FEATURES,
                            tokenizer=tokenizer, k=4, context=(3, 2), rows=3)
  ids = [tokenizer.encode(t) for t in TEXTS]
  acts = []
  for prompt in ids:  # One prompt at a time: no padding anywhere.
    value = interp.run_with_cache(model, prompt, names=[POINT])[POINT]
    acts.append(np.asarray(sae.encode(value).unwrap(
        "batch", "seq", "features"))[0])
  flat = np.concatenate(acts)
  where = [(p, t) for p, a in enumerate(acts) for t in range(len(a))]
  assert board.tokens == len(flat)
  w_u = np.asarray(interp.weights(model, "unembed.W_U").unwrap(
      "embedding", "vocabulary"))
  w_dec = np.asarray(sae.flat()["w_dec"])
  for feature, card in zip(FEATURES, board.cards):
    column = flat[:, feature]
    assert card.feature == feature
    assert card.frequency == pytest.approx(float((column > 0).mean()))
    assert card.max_activation == pytest.approx(float(column.max()),
                                                rel=1e-5)
    want = np.sort(column[column > 0])[::-1][:4]
    np.testing.assert_allclose([e.activation for e in card.examples], want,
                               rtol=1e-5, atol=1e-6)
    for e in card.examples:
      assert column[where.index((e.prompt, e.position))] == pytest.approx(
          e.activation, rel=1e-5)
      lo = max(0, e.position - 3)
      assert e.tokens == tuple(tokenizer.decode([i]) for i in
                               ids[e.prompt][lo:e.position + 3])
      assert e.activations[e.center] == pytest.approx(e.activation)
    assert sum(card.histogram[0]) == int((column > 0).sum())
    logits = w_dec[feature] @ w_u
    assert [t for t, _ in card.top_logits] == [
        tokenizer.decode([int(i)]) for i in np.argsort(-logits)[:10]]
    assert card.bottom_logits[0][1] == pytest.approx(float(logits.min()),
                                                     rel=1e-4)


class _Page(html.parser.HTMLParser):
  """Sections, examples, script elements and text of a rendered DOM."""

  def __init__(self):
    super().__init__()
    self.sections, self.examples, self.scripts, self.text = [], 0, 0, []

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if tag == "section":
      self.sections.append(int(attrs["data-feature"]))
    if tag == "div" and attrs.get("class") == "pzlm-example":
      self.examples += 1
    if tag == "script":
      self.scripts += 1

  def handle_data(self, data):
    self.text.append(data)


def test_the_page_renders_in_a_real_browser(setup, tmp_path):
  browser = shutil.which("chromium") or shutil.which("chromium-browser")
  if browser is None:
    pytest.skip("NO BROWSER: Debian's chromium is not installed (apt-get"
                " install chromium); the dashboard page was not rendered.")
  model, tokenizer, sae = setup
  board = sae_lib.dashboard(model, sae, TEXTS, features=FEATURES,
                            tokenizer=tokenizer, k=3)
  hostile = Example(  # Token texts a vocabulary may hold.
      prompt=0, position=1, activation=0.5, center=1,
      tokens=("<script>alert(1)</script>", '" onmouseover="x', "\n"),
      activations=(0.1, 0.5, 0.0))
  first = dataclasses.replace(board.cards[0],
                              examples=board.cards[0].examples + (hostile,))
  board = dataclasses.replace(board, cards=(first, *board.cards[1:]))
  path = tmp_path / "dashboard.html"
  board.save_html(path)
  with tempfile.TemporaryDirectory() as profile:
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=120, check=True).stdout
  page = _Page()
  page.feed(dom)
  assert page.sections == FEATURES
  assert page.examples == sum(len(c.examples) for c in board.cards)
  assert page.scripts == 0  # "<script>" stayed text.
  text = "".join(page.text)
  assert "Feature 17" in text
  assert '<script>alert(1)</script>" onmouseover="x\\n' in text


def test_bad_requests_are_clear_errors(setup):
  model, tokenizer, sae = setup
  for kwargs, message in ((dict(features=[10**6]), "feature ids"),
                          (dict(features=[]), "feature ids"),
                          (dict(features=[0], k=0), "k must be"),
                          (dict(features=[0], context=(1,)), "context")):
    with pytest.raises(ValueError, match=message):
      sae_lib.dashboard(model, sae, TEXTS, tokenizer=tokenizer, **kwargs)
  with pytest.raises(ValueError, match="tokenizer="):
    sae_lib.dashboard(model, sae, TEXTS, features=[0])
