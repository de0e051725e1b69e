"""The graph page in a real browser (Debian's chromium, headless, driven
over the DevTools protocol on a pipe): the drawn nodes and links are the
exported ones, a mouse click on a node lists its links (largest first) and
highlights them, a click on a listed link moves to its node, the prompt's
markup stays text, and no script error or console error occurs."""

import fcntl
import json
import os
import pathlib
import select
import shlex
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pytest

from penzai_lm.circuits import graph_page
from penzai_lm.circuits import neuronpedia
from penzai_lm.tokenizer import Tokenizer
from tests.circuits import small_graphs


def _above_4(fd: int) -> int:
  new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
  os.close(fd)
  return new


class _Browser:
  """Headless chromium with ``--remote-debugging-pipe``: DevTools
  messages are NUL-terminated JSON on its fds 3 (in) and 4 (out)."""

  def __init__(self, exe: str, profile: str, timeout: float = 60):
    # Both ends above 4, so bash's redirections cannot clobber them.
    to_browser, from_browser = (tuple(_above_4(fd) for fd in os.pipe())
                                for _ in range(2))
    # bash gives chromium the pipes as fds 3 and 4 (no preexec_fn: no
    # Python in a forked child of this multithreaded process).
    command = " ".join(shlex.quote(a) for a in [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}",
        "--remote-debugging-pipe", "about:blank"])
    self.proc = subprocess.Popen(
        ["bash", "-c", f"exec {command} 3<&{to_browser[0]}"
         f" 4>&{from_browser[1]}"],
        pass_fds=(to_browser[0], from_browser[1]), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_browser[0])
    os.close(from_browser[1])
    self.write, self.read = to_browser[1], from_browser[0]
    self.deadline = time.monotonic() + timeout
    self.buffer, self.last_id, self.events = b"", 0, []
    self.session = None

  def _message(self) -> dict:
    while b"\0" not in self.buffer:
      left = self.deadline - time.monotonic()
      if left <= 0 or not select.select([self.read], [], [], left)[0]:
        raise TimeoutError("the browser did not answer in time")
      chunk = os.read(self.read, 1 << 16)
      if not chunk:
        raise RuntimeError("the browser closed its DevTools pipe")
      self.buffer += chunk
    message, self.buffer = self.buffer.split(b"\0", 1)
    return json.loads(message)

  def send(self, method: str, **params) -> dict:
    self.last_id += 1
    message = {"id": self.last_id, "method": method, "params": params}
    if self.session is not None:
      message["sessionId"] = self.session
    os.write(self.write, json.dumps(message).encode() + b"\0")
    while True:
      answer = self._message()
      if answer.get("id") == self.last_id:
        if "error" in answer:
          raise RuntimeError(f"{method}: {answer['error']}")
        return answer["result"]
      self.events.append(answer)

  def wait_for(self, method: str) -> None:
    while not any(e.get("method") == method for e in self.events):
      self.events.append(self._message())

  def open(self, path: pathlib.Path) -> None:
    """Attaches to the blank page, starts collecting errors, loads
    ``path`` and waits for its load event."""
    targets = self.send("Target.getTargets")["targetInfos"]
    page = next(t for t in targets if t["type"] == "page")
    self.session = self.send("Target.attachToTarget",
                             targetId=page["targetId"],
                             flatten=True)["sessionId"]
    for domain in ("Runtime", "Page", "Log"):
      self.send(f"{domain}.enable")
    self.send("Emulation.setDeviceMetricsOverride", width=1600, height=1000,
              deviceScaleFactor=1, mobile=False)
    self.send("Page.navigate", url=path.as_uri())
    self.wait_for("Page.loadEventFired")

  def eval(self, expression: str):
    result = self.send("Runtime.evaluate", expression=expression,
                       returnByValue=True)
    if "exceptionDetails" in result:
      raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
    return result["result"].get("value")

  def click(self, x: float, y: float) -> None:
    for kind in ("mousePressed", "mouseReleased"):
      self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y,
                button="left", clickCount=1)

  def errors(self) -> list:
    """Uncaught exceptions, console errors and error log entries."""
    out = []
    for e in self.events:
      method, params = e.get("method"), e.get("params", {})
      if method == "Runtime.exceptionThrown":
        out.append(params["exceptionDetails"])
      elif method == "Runtime.consoleAPICalled" and params["type"] in (
          "error", "assert"):
        out.append(params["args"])
      elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
        out.append(params["entry"])
    return out

  def close(self) -> None:
    try:
      self.session = None
      self.send("Browser.close")
    except (RuntimeError, TimeoutError, OSError):
      self.proc.kill()
    self.proc.wait(timeout=30)
    os.close(self.write)
    os.close(self.read)


@pytest.fixture(name="browser")
def _browser():
  exe = shutil.which("chromium") or shutil.which("chromium-browser")
  if exe is None:
    pytest.skip("NO BROWSER: Debian's chromium is not installed (apt-get"
                " install chromium); the graph page was not rendered.")
  with tempfile.TemporaryDirectory() as profile:
    browser = _Browser(exe, profile)
    try:
      yield browser
    finally:
      browser.close()


@pytest.fixture(name="tok", scope="module")
def _tok(tmp_path_factory):
  return Tokenizer.from_hf(small_graphs.write_tokenizer_dir(
      tmp_path_factory.mktemp("tok")))


_CENTER = """(() => {
  const e = document.querySelector('svg [data-node="%d"]');
  e.scrollIntoView({block: "center", inline: "center"});
  const r = e.getBoundingClientRect();
  const x = r.x + r.width / 2, y = r.y + r.height / 2;
  const hit = document.elementFromPoint(x, y);
  return [x, y, hit && hit.getAttribute("data-node")];
})()"""
_PANEL = """(() => {
  const rows = id => Array.from(document.getElementById(id).rows,
      r => [Number(r.getAttribute("data-node")), r.cells[0].textContent]);
  return {node: document.getElementById("info").getAttribute("data-node"),
          title: document.getElementById("info-title").textContent,
          incoming: document.getElementById("incoming-count").textContent,
          outgoing: document.getElementById("outgoing-count").textContent,
          inRows: rows("incoming"), outRows: rows("outgoing"),
          on: document.querySelectorAll("line.on").length,
          dim: document.querySelectorAll("line.dim").length};
})()"""


def _expected_rows(export, node, end):
  """The panel's rows for ``node``'s links whose ``end`` (0 source, 1
  target) is ``node``: the other ends, largest |weight| first."""
  mine = np.flatnonzero(export.links[:, end] == node)
  order = mine[np.argsort(-np.abs(export.weights[mine]), kind="stable")]
  return [int(export.links[i, 1 - end]) for i in order[:12]], len(mine)


def test_page_in_a_real_browser(browser, tok, tmp_path):
  g = small_graphs.graph()
  export = neuronpedia.export_graph(g, tokenizer=tok)
  path = graph_page.save_graph_html(g, tmp_path / "g.html", tokenizer=tok)
  browser.open(path)
  assert browser.eval("document.querySelectorAll('svg [data-node]').length"
                      ) == len(export.nodes)
  assert browser.eval("document.querySelectorAll('line[data-link]').length"
                      ) == len(export.links) > 100
  # The prompt's "</script><script>..." stayed text.
  assert browser.eval("document.scripts.length") == 2
  assert browser.eval("typeof window.pwned") == "undefined"
  assert browser.eval("document.getElementById('prompt').textContent"
                      ) == tok.decode(g.input_tokens.tolist())
  assert browser.eval(_PANEL)["node"] is None
  # The most connected feature that is on top at its centre.
  degree = np.bincount(export.links.ravel(), minlength=len(export.nodes))
  features = [i for i in np.argsort(-degree, kind="stable").tolist()
              if export.nodes[i]["feature_type"] == "cross layer transcoder"]
  for node in features:
    x, y, hit = browser.eval(_CENTER % node)
    if hit == str(node):
      break
  browser.click(x, y)
  panel = browser.eval(_PANEL)
  ins, n_in = _expected_rows(export, node, 1)
  outs, n_out = _expected_rows(export, node, 0)
  assert n_in and n_out
  assert panel["node"] == str(node)
  assert panel["incoming"] == f"Incoming links: {n_in}"
  assert panel["outgoing"] == f"Outgoing links: {n_out}"
  assert [r[0] for r in panel["inRows"]] == ins
  assert [r[0] for r in panel["outRows"]] == outs
  mine = np.flatnonzero(export.links[:, 0] == node)
  top = export.weights[mine[np.argmax(np.abs(export.weights[mine]))]]
  assert panel["outRows"][0][1][0] == ("+" if top >= 0 else "-")
  assert float(panel["outRows"][0][1]) == pytest.approx(top, rel=5e-3)
  assert panel["on"] == n_in + n_out
  assert panel["dim"] == len(export.links) - n_in - n_out
  info = export.nodes[node]
  layer, feature, pos = info["node_id"].split("_")
  assert panel["title"].startswith(f"Feature L{layer} #{feature} @{pos}")
  # A click on the first outgoing row goes to that node.
  row = browser.eval("(() => { const r = document.getElementById('outgoing')"
                     ".rows[0].getBoundingClientRect();"
                     " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
  browser.click(*row)
  assert browser.eval(_PANEL)["node"] == str(outs[0])
  browser.click(5, 5)  # Outside the plot: nothing changes.
  assert browser.eval(_PANEL)["node"] == str(outs[0])
  x, y, hit = browser.eval(
      "(() => { const r = document.getElementById('plot')"
      ".getBoundingClientRect(); const x = r.x + 4, y = r.y + 4;"
      " return [x, y, document.elementFromPoint(x, y).tagName]; })()")
  assert hit == "svg"
  browser.click(x, y)  # The plot's background clears the selection.
  cleared = browser.eval(_PANEL)
  assert cleared["node"] is None and cleared["on"] == cleared["dim"] == 0
  assert browser.errors() == []


def test_the_browser_check_sees_script_errors(browser, tmp_path):
  """The error collection above can fail: a page with a console error and
  an uncaught exception gives both."""
  path = tmp_path / "bad.html"
  path.write_text("<!DOCTYPE html><html><body><script>console.error('boom');"
                  " null.x;</script></body></html>")
  browser.open(path)
  assert len(browser.errors()) == 2


def test_json_files_give_the_same_page():
  """A graph JSON (here 0.5's, whose ids collide, and with distinct ids)
  gives the page of the graph; malformed data is a clear error."""
  g = small_graphs.graph()
  fixed = neuronpedia.graph_json(g, slug="graph", distinct_error_ids=True)
  page = graph_page.json_html(fixed)
  export = neuronpedia.export_graph(g, distinct_error_ids=True)
  assert page == graph_page.export_html(export)
  assert page != graph_page.graph_html(g)  # The error ids differ.
  for bad in ({}, {"nodes": [], "links": [], "metadata": {}},
              {**fixed, "links": [{"source": "nowhere", "target": "x",
                                   "weight": 1}]}):
    with pytest.raises(ValueError, match="not a graph JSON object"):
      graph_page.json_html(bad)
