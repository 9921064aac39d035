"""The widget in a real browser (Debian's Chromium driven by Playwright).

Two tests: the built front end alone on a page, timing a 70B-sized tree; and the whole flow in
JupyterLab — run a notebook, expand, tick a decoder layer, Materialize → CPU, and check both
the page and the kernel.  Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from _loopback import free_port
from _models import llama70b_on_meta
from torch import nn

from jupyter_metainit import meta_init
from jupyter_metainit.jupyter.row_schema import ROW

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ROOT = pathlib.Path(__file__).resolve().parents[1]
STATIC = ROOT / "jupyter_metainit" / "jupyter" / "static"
ARTIFACTS = ROOT / "test-artifacts"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM),
        reason=f"{CHROMIUM} is missing (install it with: apt-get install -y chromium)",
    ),
]


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


# A page with the built ES module and CSS, and a minimal in-page model (state + events),
# the way anywidget hands them to render().
_HARNESS = """<!doctype html><html><head><meta charset="utf-8">
<link rel="stylesheet" href="/widget.css"><style>body{margin:16px;background:#fff}</style>
</head><body><div id="host"></div><script type="module">
import widget from "/widget.js";
class Model {
  constructor(state) { this.state = state; this.h = {}; this.sent = []; }
  get(k) { return this.state[k]; }
  set(k, v) { this.state[k] = v; (this.h["change:" + k] || []).forEach((f) => f()); }
  save_changes() {}
  send(c) { this.sent.push(c); }
  on(e, f) { (this.h[e] = this.h[e] || []).push(f); }
  off() {}
}
const frame = () => new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
window.mount = async (state) => {
  const model = new Model(state);
  window.model = model;
  const el = document.getElementById("host");
  const t0 = performance.now();
  widget.initialize?.({ model });
  widget.render({ model, el });
  el.getBoundingClientRect();
  await frame();
  return performance.now() - t0;
};
window.timed = async (fn) => {
  const t0 = performance.now();
  fn();
  document.body.getBoundingClientRect();
  await frame();
  return performance.now() - t0;
};
</script></body></html>"""


def _serve_static(page) -> None:
    files = {
        "/": ("text/html", _HARNESS.encode()),
        "/widget.js": ("text/javascript", (STATIC / "widget.js").read_bytes()),
        "/widget.css": ("text/css", (STATIC / "widget.css").read_bytes()),
    }

    def handle(route) -> None:
        path = "/" + route.request.url.split("/", 3)[3]
        ctype, body = files.get(path, ("text/plain", b""))
        route.fulfill(status=200 if path in files else 404, content_type=ctype, body=body)

    page.route("http://jmi.test/**", handle)
    page.goto("http://jmi.test/")
    page.wait_for_function("typeof window.mount === 'function'")


def _rows_in_dom(page) -> int:
    return page.locator(".jmi-rows .jmi-row:not(.jmi-colhead)").count()


def test_70b_tree_keeps_only_the_rows_in_view_in_the_page_after_expand_and_filter(browser):
    # What keeps a 70B tree responsive: a virtual list (the 18 visible rows and 6 either side),
    # whatever the number of modules. The times are figures, kept in widget-70b-timings.json,
    # not asserted (a loaded machine is not a slow widget).
    from jupyter_metainit.jupyter.widget import explore

    most_rows = 18 + 2 * 6

    w = explore(llama70b_on_meta())
    state = {k: v for k, v in w.get_state().items() if not k.startswith("_")}
    first_message = len(json.dumps(w.get_state(), default=str).encode())
    assert first_message <= 500_000
    page = browser.new_page(viewport={"width": 1200, "height": 820})
    _serve_static(page)
    render_ms = page.evaluate("(s) => window.mount(s)", state)
    assert 0 < _rows_in_dom(page) <= most_rows
    expand_ms = page.evaluate(
        """() => window.timed(() => [...document.querySelectorAll('.jmi-rows .jmi-row')]
             .find((r) => r.querySelector('.jmi-name').textContent === 'layers')
             .querySelector('.jmi-caret').click())"""
    )
    assert page.locator(".jmi-rows .jmi-row .jmi-name", has_text="79").count() == 0  # virtual
    assert 0 < _rows_in_dom(page) <= most_rows
    filter_ms = page.evaluate(
        """() => window.timed(() => { const i = document.querySelector('.jmi-search');
             i.value = 'down_proj'; i.dispatchEvent(new Event('input')); })"""
    )
    matches = page.locator(".jmi-count").inner_text()
    assert 0 < _rows_in_dom(page) <= most_rows
    ARTIFACTS.mkdir(exist_ok=True)
    page.evaluate(
        """() => { const i = document.querySelector('.jmi-search'); i.value = '';
             i.dispatchEvent(new Event('input')); }"""
    )
    page.screenshot(path=str(ARTIFACTS / "widget-70b.png"), full_page=True)
    (ARTIFACTS / "widget-70b-timings.json").write_text(
        json.dumps(
            {
                "render_ms": render_ms,
                "expand_ms": expand_ms,
                "filter_ms": filter_ms,
                "first_message_bytes": first_message,
                "modules": len(w.tree["nodes"]),
            },
            indent=1,
        )
    )
    assert matches == "80 matches"


def test_deferred_to_cuda_badge_keeps_clear_of_the_size_column_at_700px(browser):
    from jupyter_metainit.jupyter.widget import explore

    with meta_init():
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    state = {k: v for k, v in explore(model).get_state().items() if not k.startswith("_")}
    for row in state["tree"]["nodes"]:
        row[ROW["target"]] = (
            "cuda:15"  # the target a --device cuda:15 build gives (no GPU needed here)
        )
    for width in (1400, 700, 440):
        page = browser.new_page(viewport={"width": width, "height": 600})
        _serve_static(page)
        page.evaluate("(s) => window.mount(s)", state)
        boxes = page.evaluate(
            """() => [...document.querySelectorAll('.jmi-rows .jmi-row')].map((r) => {
                 const box = (sel) => r.querySelector(sel)?.getBoundingClientRect();
                 const size = box('.jmi-c-size'), cell = box('.jmi-c-state');
                 const badge = box('.jmi-badge');
                 const target = box('.jmi-badge-target') || badge;
                 return [size && size.width ? size.right : 0, cell.left, cell.right,
                         badge.left, badge.right, target.left, target.right,
                         r.querySelector('.jmi-badge').textContent, badge.height,
                         r.querySelector('.jmi-badge').scrollWidth
                           - r.querySelector('.jmi-badge').clientWidth]; })"""
        )
        for size_right, left, right, b_left, b_right, t_left, t_right, text, height, spill in boxes:
            assert text == "deferred → cuda:15"
            assert spill <= 1, (width, spill)  # no text runs out of the badge
            assert height <= 20, (width, height)  # one line: a wrapped badge spills out of its row
            assert size_right <= b_left - 4 and left <= b_left and b_right <= right, (width, text)
            assert left <= t_left and t_right <= right, width  # the device is never cut
        page.close()


def _llama_small():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _measured_llama_state(tmp_path) -> dict:
    """A small Llama's widget state, one layer real and holding a NaN, Values measured and
    compared with a checkpoint of it (as the values notebook below, without a kernel)."""
    import torch

    from jupyter_metainit import materialize, save
    from jupyter_metainit.jupyter.widget import explore

    with meta_init():
        model = _llama_small()
    materialize(model.model.layers[1])
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    save(model, tmp_path / "tuned")
    w = explore(model)
    w.measure_values()
    w.compare_with(str(tmp_path / "tuned"))
    assert w.error == "", w.error
    return {k: v for k, v in w.get_state().items() if not k.startswith("_")}


def _mount_at(
    browser,
    state: dict,
    widths: tuple[int, ...],
    measure: str,
    columns: bool = True,
    shot: str = "",
) -> dict:
    """The harness page at each widget width: ``measure`` evaluated on the widget's root; with
    ``shot``, screenshots test-artifacts/<shot>-<px>.png (light: the harness has no JupyterLab
    theme)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    _serve_static(page)
    page.evaluate("(s) => window.mount(s)", state)
    if not columns:
        page.locator(".jmi-values-cols").click()  # the NaN flags back beside the names
    layers = page.locator(".jmi-rows .jmi-row", has=page.locator(".jmi-name[title='model.layers']"))
    layers.locator(".jmi-caret").click()  # open, and the focused row (its copy button shown)
    found = {}
    for width in widths:
        page.evaluate("(w) => { document.getElementById('host').style.width = w + 'px'; }", width)
        page.wait_for_timeout(200)
        found[width] = page.locator(".jmi-root").evaluate(measure)
        if shot:
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator(".jmi-root").screenshot(path=str(ARTIFACTS / f"{shot}-{width}.png"))
    page.close()
    return found


_NAMES_AND_TAGS = """(root) => {
  const box = (el) => el.getBoundingClientRect();
  const rows = [...root.querySelectorAll('.jmi-rows .jmi-row')];
  // a long name's head (dom.ts: appendName) ends in an ellipsis when cut: count it
  const cut = rows.map((r) => r.querySelector('.jmi-name'))
    .filter((n) => [n, ...n.children].some((e) => e.scrollWidth > e.clientWidth + 1))
    .map((n) => n.title);
  const tags = rows.map((r) => r.querySelector('.jmi-c-size .jmi-dtype'))
    .filter((t) => t && t.checkVisibility()).map((t) => Math.round(box(t).left));
  return { cut, tags: [...new Set(tags)] }; }"""


@pytest.mark.parametrize("columns", ["value columns", "no value columns"])
def test_narrow_rows_keep_their_names_and_the_dtype_tags_in_one_column(browser, tmp_path, columns):
    state = _measured_llama_state(tmp_path)
    widths = (330, 580, 700, 968)
    found = _mount_at(browser, state, widths, _NAMES_AND_TAGS, columns == "value columns")
    assert all(not f["cut"] for f in found.values()), found  # beside a NaN flag too
    assert all(len(f["tags"]) <= 1 for f in found.values()), found  # one left edge


_PLANNED_CUTS = """(root) => {
  const box = (el) => el.getBoundingClientRect();
  const cut = (el) => el.scrollWidth > el.clientWidth + 1;
  const faults = [];
  for (const row of root.querySelectorAll('.jmi-rows .jmi-row:not(:hover)')) {
    const name = row.querySelector('.jmi-name');
    const bytes = row.querySelector('.jmi-bytes'), badge = row.querySelector('.jmi-badge');
    const dev = row.querySelector('.jmi-c-device .jmi-dev-name');
    if (cut(name) || [...name.children].some(cut)) faults.push(`${name.title}: name cut`);
    // a size shown is whole and clear of the state badge (at 330 px the device takes its place)
    if (bytes.checkVisibility() && (box(bytes).right > box(bytes.parentElement).right + 1
        || box(bytes).right > box(badge).left)) faults.push(`${name.title}: size cut`);
    if (cut(badge)) faults.push(`${name.title}: state cut`);
    if (!dev || cut(dev)) faults.push(`${name.title}: device cut`);
  }
  return faults; }"""


def test_a_planned_tree_at_330_to_580_px_keeps_names_sizes_states_and_devices_whole(
    browser, tmp_path
):
    """Screenshots: test-artifacts/widget-planned-<px>.png."""
    from jupyter_metainit.jupyter.widget import explore

    state = _measured_llama_state(tmp_path)
    with meta_init():
        model = _llama_small()
    w = explore(model)
    w.place("cpu", seq_len=8)
    assert w.plan.get("devices"), w.error
    state["plan"] = w.plan
    found = _mount_at(browser, state, (330, 420, 580), _PLANNED_CUTS, False, "widget-planned")
    assert all(not f for f in found.values()), found


_TIE_CHIPS = """(root) => [...root.querySelectorAll('.jmi-rows .jmi-row')].flatMap((row) => {
  const chip = row.querySelector('.jmi-tied');
  if (!chip) return [];
  // the chip draws no box of its own: its key and its rest are items of the tags' line
  const c = chip.querySelector('.jmi-chip-key').getBoundingClientRect();
  const rest = chip.querySelector('.jmi-chip-rest'), r = rest.getBoundingClientRect();
  const tags = row.querySelector('.jmi-tags').getBoundingClientRect();
  const shown = c.width > 0 && c.top < tags.bottom - 1 && c.right <= tags.right + 0.5;
  const whole = r.width > 0 && r.top < tags.bottom - 1 && r.right <= tags.right + 0.5;
  const gone = !rest.checkVisibility() || r.top >= tags.bottom - 1;
  return [{ name: row.querySelector('.jmi-name').title, shown, whole, gone,
            label: row.getAttribute('aria-label') }]; })"""


def test_a_tie_chip_shows_its_holder_whole_or_not_at_all_and_the_label_names_it(browser, tmp_path):
    """At every width the tie is in the row's accessible name; its chip (when the row has room
    for "tied") never shows the holder's name cut. Screenshots: widget-tied-<px>.png."""
    state = _measured_llama_state(tmp_path)
    found = _mount_at(browser, state, (330, 650, 968), _TIE_CHIPS, False, "widget-tied")
    for width, chips in found.items():
        assert {c["name"] for c in chips} == {"model.embed_tokens", "lm_head"}, (width, chips)
        for c in chips:
            other = "lm_head" if c["name"] != "lm_head" else "model.embed_tokens"
            assert f"tied to {other}" in c["label"], (width, c)
            assert not c["shown"] or c["whole"] or c["gone"], (width, c)
    lm_head = next(c for c in found[968] if c["name"] == "lm_head")
    assert lm_head["shown"] and lm_head["whole"], found[968]


def test_two_gpus_wrap_the_action_bar_between_its_groups(browser, tmp_path):
    state = _measured_llama_state(tmp_path)
    # the devices trait as a two-GPU kernel sends it (no GPU needed to draw the bar)
    state["devices"] = [
        {"name": f"cuda:{i}", "label": "NVIDIA H100, 79.1 GiB free"} for i in (0, 1)
    ]
    measure = """(root) => {
      const bar = root.querySelector('.jmi-actions'), sep = bar.querySelector('.jmi-sep');
      const lines = (g) => new Set([...g.children].map((c) => c.offsetTop)).size;
      const groups = [...bar.querySelectorAll('.jmi-group')];
      const [before, after] = [sep.previousElementSibling, sep.nextElementSibling];
      return { groups: groups.length, split: groups.filter((g) => lines(g) > 1).length,
               dangling: sep.checkVisibility() && before.offsetTop !== after.offsetTop,
               wider: bar.scrollWidth > bar.clientWidth + 1 }; }"""
    found = _mount_at(browser, state, (968, 1300), measure, shot="widget-two-gpus")
    whole = {"groups": 3, "split": 0, "dangling": False, "wider": False}
    assert found[968] == whole and found[1300] == whole, found


# ---------------------------------------------------------------------------- JupyterLab


_SETUP = """\
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from jupyter_metainit import meta_init
from jupyter_metainit.jupyter.widget import explore

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
with meta_init():
    model = LlamaForCausalLM(cfg)
w = explore(model)
w"""

_CHECK = """\
from jupyter_metainit.core import tensor_state
layer = model.model.layers[1]
inside = {tensor_state(p) for p in layer.parameters()}
outside = {tensor_state(p) for n, p in model.named_parameters()
           if not n.startswith("model.layers.1.")}
print("CHECK", sorted(inside), sorted(outside), w.selected,
      torch.count_nonzero(layer.mlp.up_proj.weight).item() > 0)"""


def _write_notebook(path: pathlib.Path, cells: list[str]) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, str(path))


@contextlib.contextmanager
def _jupyter_server(app: str):
    """A JupyterLab (``app="jupyterlab"``) or Notebook 7 (``"notebook"``) server on a free port,
    with its own config, data and runtime dirs."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="jmi-lab-"))
    (tmp / "work").mkdir()
    port, token = free_port(), "jmi-test-token"
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
        IPYTHONDIR=str(tmp / "ipython"),
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    # no "what's new"/news popups, no announcements
    apputils = tmp / "settings" / "@jupyterlab" / "apputils-extension"
    apputils.mkdir(parents=True)
    (apputils / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - open while the server runs
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            app,
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            "--allow-root",
            f"--IdentityProvider.token={token}",
            "--ServerApp.open_browser=False",
            f"--ServerApp.root_dir={tmp / 'work'}",
            "--ServerApp.disable_check_xsrf=False",
            *(["--LabApp.news_url="] if app == "jupyterlab" else []),
        ],
        cwd=tmp / "work",
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    import urllib.request

    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                raise RuntimeError((tmp / "server.log").read_text()[-3000:]) from None
            time.sleep(0.3)
    try:
        yield {
            "url": url,
            "token": token,
            "dir": tmp / "work",
            "settings": tmp / "settings",
            "app": app,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def jupyterlab():
    with _jupyter_server("jupyterlab") as server:
        yield server


@pytest.fixture(params=["jupyterlab", "notebook"], ids=["jupyterlab4", "notebook7"])
def frontend(request):
    """Each front end in turn: JupyterLab 4 and Notebook 7."""
    with _jupyter_server(request.param) as server:
        yield server


def _set_theme(settings: pathlib.Path, theme: str) -> None:
    d = settings / "@jupyterlab" / "apputils-extension"
    d.mkdir(parents=True, exist_ok=True)
    (d / "themes.jupyterlab-settings").write_text(json.dumps({"theme": theme}))


def _dismiss_dialogs(page) -> None:
    """Accept any JupyterLab dialog (e.g. kernel selection) that would block clicks."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dialog-dismissed.png"))
        accept = dialog.locator(".jp-Dialog-button.jp-mod-accept")
        if accept.count():
            accept.first.click()
        else:
            page.keyboard.press("Escape")
        dialog.first.wait_for(state="detached", timeout=10_000)


def _open(page, server: dict, name: str) -> None:
    if server.get("app", "jupyterlab") == "jupyterlab":
        # ?reset: a fresh workspace, so nothing from an earlier test's page is restored
        url = f"{server['url']}/lab/tree/{name}?reset&token={server['token']}"
    else:
        url = f"{server['url']}/notebooks/{name}?token={server['token']}"
    page.goto(url, wait_until="load")
    page.wait_for_selector(".jp-Notebook", timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    if server.get("app", "jupyterlab") == "jupyterlab":
        page.wait_for_selector(
            ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000
        )
    else:
        page.wait_for_function(
            "() => !document.body.textContent.includes('Kernel status: Unknown')", timeout=60_000
        )


def _row(widget, qname: str):
    """The widget's row for the module named ``qname``."""
    return widget.locator(f".jmi-rows .jmi-row:has(.jmi-name[title='{qname}'])")


def _run_first_cell_and_wait_widget(page, lab: dict, name: str) -> object:
    _open(page, lab, name)
    # run only the first cell (the second is run after the click); a key press that lands
    # before the kernel is connected is lost, so press again while the prompt stays empty
    first = page.locator(".jp-Cell").first
    widget = page.locator(".jmi-root")
    for _ in range(6):
        _dismiss_dialogs(page)
        if first.locator(".jp-InputPrompt").inner_text().strip() in ("[ ]:", ""):
            first.click()
            page.keyboard.press("Shift+Enter")
        try:
            widget.wait_for(timeout=15_000)
            break
        except Exception:
            continue
    try:
        widget.wait_for(timeout=1_000)
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"failure-{name}.png"))
        raise
    return widget


def test_materialize_a_decoder_layer_in_jupyterlab(browser, jupyterlab):
    _write_notebook(jupyterlab["dir"] / "flow.ipynb", [_SETUP, _CHECK])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    widget = _run_first_cell_and_wait_widget(page, jupyterlab, "flow.ipynb")

    _row(widget, "model.layers").locator(".jmi-caret").click()
    layer = _row(widget, "model.layers.1")
    layer.locator(".jmi-check").check()
    widget.locator(".jmi-seltotals", has_text="1 subtree").wait_for(timeout=20_000)
    widget.locator(".jmi-mat-cpu").click()
    layer.locator(".jmi-badge", has_text="cpu").wait_for(timeout=60_000)
    widget.locator(".jmi-message.jmi-ok").wait_for(timeout=20_000)
    assert widget.locator(".jmi-progress").is_hidden()
    assert _row(widget, "model.layers.0").locator(".jmi-badge").inner_text() == "deferred"
    assert _row(widget, "model").locator(".jmi-badge").inner_text() == "mixed"
    ARTIFACTS.mkdir(exist_ok=True)
    widget.screenshot(path=str(ARTIFACTS / "widget-jupyterlab.png"))
    widget.get_by_role("button", name="Table", exact=True).click()
    widget.locator(".jmi-tablewrap table").first.wait_for(timeout=30_000)
    widget.screenshot(path=str(ARTIFACTS / "widget-jupyterlab-table.png"))

    page.locator(".jp-Cell").nth(1).click()
    page.keyboard.press("Shift+Enter")
    out = page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea-output", has_text="CHECK")
    out.wait_for(timeout=60_000)
    text = out.inner_text()
    assert "CHECK ['cpu'] ['deferred'] ['model.layers.1'] True" in text, text


def test_dark_theme_screenshot(browser, jupyterlab):
    _set_theme(jupyterlab["settings"], "JupyterLab Dark")
    _write_notebook(jupyterlab["dir"] / "dark.ipynb", [_SETUP, _CHECK])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    widget = _run_first_cell_and_wait_widget(page, jupyterlab, "dark.ipynb")
    _row(widget, "model.layers").locator(".jmi-caret").click()
    ARTIFACTS.mkdir(exist_ok=True)
    widget.screenshot(path=str(ARTIFACTS / "widget-jupyterlab-dark.png"))
    bg = page.evaluate(
        "() => getComputedStyle(document.querySelector('.jmi-root')).backgroundColor"
    )
    assert bg != "rgb(255, 255, 255)"


# ---------------------------------------------------------------------------- both front ends

_FLOW_CELLS = [
    "%load_ext jupyter_metainit",
    """%%meta_init
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  tie_word_embeddings=True)
model = LlamaForCausalLM(cfg)""",
    "%materialize model.model.layers[1]",
    "import jupyter_metainit\n\n(w,) = jupyter_metainit.widgets_of(model)\n"
    "print('CHECK', w.selected)",
]


def _run_cell(page, i: int) -> None:
    """Run cell ``i`` and wait for its execution count (a key press that lands before the
    kernel is connected is lost, so it is pressed again while the prompt stays empty)."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(i)
    prompt = cell.locator(".jp-InputPrompt")
    for _ in range(8):
        _dismiss_dialogs(page)
        if re.search(r"\[\d+\]", prompt.inner_text()):
            return
        if "*" not in prompt.inner_text():
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(
                "(el) => /\\[\\d+\\]/.test(el.textContent)",
                arg=prompt.element_handle(),
                timeout=15_000,
            )
            return
        except Exception:
            continue
    page.screenshot(path=str(ARTIFACTS / f"failure-cell-{i}.png"))
    raise AssertionError(f"cell {i} did not run")


def _open_and_build(browser, server: dict, name: str, cells: list[str], height: int = 900):
    """Write ``cells`` as notebook ``name``, open it on a new 1400 px page and run its first
    two cells (load the extension, build the model); return the page once a widget shows."""
    _write_notebook(server["dir"] / name, cells)
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": height})
    _open(page, server, name)
    _run_cell(page, 0)
    _run_cell(page, 1)
    page.locator(".jmi-root").first.wait_for(timeout=60_000)
    return page


def _restart_kernel(page) -> None:
    page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("0")
    page.keyboard.press("0")
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=10_000)
    dialog.locator(".jp-Dialog-button.jp-mod-accept").first.click()


def test_widget_follows_the_model_and_works_from_the_keyboard(browser, frontend):
    app = "jupyterlab4" if frontend["app"] == "jupyterlab" else "notebook7"
    page = _open_and_build(browser, frontend, "follow.ipynb", _FLOW_CELLS)
    widget = page.locator(".jmi-root")

    # tied weights are named on both holders
    # (the chip's text: its two parts, the holder's on a line the chip hides when narrow)
    assert _row(widget, "model.embed_tokens").locator(".jmi-tied").text_content() == "tied: lm_head"
    # the chip names the holder by its last name, the row's title by its whole name
    assert _row(widget, "lm_head").locator(".jmi-tied").text_content() == "tied: embed_tokens"
    assert "tied to model.embed_tokens" in (_row(widget, "lm_head").get_attribute("title") or "")

    # a magic in a later cell shows in the widget above, with no refresh
    _run_cell(page, 2)
    _row(widget, "model.layers").locator(".jmi-badge", has_text="mixed").wait_for(timeout=5_000)
    widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-1400.png"))

    # keyboard: focus a row, open it, move down, tick with Space; focus stays on the row
    _row(widget, "model.layers").locator(".jmi-c-type").click()
    page.keyboard.press("ArrowRight")
    _row(widget, "model.layers.1").wait_for(timeout=5_000)
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Space")
    widget.locator(".jmi-seltotals", has_text="1 subtree").wait_for(timeout=10_000)
    focused = page.evaluate(
        "() => [document.activeElement.getAttribute('role'),"
        " document.activeElement.querySelector('.jmi-name')?.title]"
    )
    assert focused == ["treeitem", "model.layers.1"], focused
    assert _row(widget, "model.layers.1").locator(".jmi-check").is_checked()
    _run_cell(page, 3)
    out = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".jp-OutputArea-output")
    assert "CHECK ['model.layers.1']" in out.inner_text()

    # narrow: name and state stay visible inside the widget
    page.set_viewport_size({"width": 700, "height": 900})
    page.wait_for_timeout(300)
    box = widget.bounding_box()
    for part in (".jmi-name", ".jmi-badge"):
        cell = _row(widget, "model.layers").locator(part).bounding_box()
        assert cell is not None and cell["x"] + cell["width"] <= box["x"] + box["width"] + 1, part
    _row(widget, "model.layers.1").scroll_into_view_if_needed()
    widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-700.png"))

    # the kernel restarts: the widget says it is disconnected and stops offering actions
    _restart_kernel(page)
    notice = widget.locator(".jmi-disconnected")
    try:
        notice.wait_for(state="visible", timeout=8_000)
    except Exception:
        widget.locator(".jmi-mat-cpu").click()  # no message reached the page: an action tells
        notice.wait_for(state="visible", timeout=15_000)
    assert widget.locator(".jmi-mat-cpu").is_disabled()
    widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-disconnected.png"))


_COMMAND_KEYS = ["a", "b", "m", "y", "d", "d", "x", "c", "v", "z", "Shift+Enter", "Shift+m"]


def test_notebook_shortcuts_never_fire_while_focus_is_in_the_widget(browser, frontend):
    app = "jupyterlab4" if frontend["app"] == "jupyterlab" else "notebook7"
    page = _open_and_build(browser, frontend, "keys.ipynb", _FLOW_CELLS[:2])
    widget = page.locator(".jmi-root")
    cells = page.locator(".jp-Notebook .jp-Cell")
    markdown = page.locator(".jp-Notebook .jp-MarkdownCell")
    count = cells.count()
    # focus a row (a click on its type cell, as a person would) and press command-mode keys
    widget.locator(".jmi-rows .jmi-row .jmi-c-type").nth(1).click()
    for key in _COMMAND_KEYS:
        page.keyboard.press(key)
    # and in the filter box, where letters are typed
    widget.locator(".jmi-search").click()
    for key in _COMMAND_KEYS:
        page.keyboard.press(key)
    page.wait_for_timeout(500)
    assert cells.count() == count, app
    assert markdown.count() == 0, app
    assert widget.count() == 1, app
    # Escape hands focus back to the notebook: its shortcuts work again
    widget.locator(".jmi-search").fill("")
    widget.locator(".jmi-rows .jmi-row .jmi-c-type").nth(1).click()
    page.keyboard.press("Escape")
    inside = page.evaluate("() => !!document.activeElement.closest('.jmi-root')")
    assert not inside, app
    page.keyboard.press("b")
    page.wait_for_function(
        f"() => document.querySelectorAll('.jp-Notebook .jp-Cell').length == {count + 1}",
        timeout=5_000,
    )


# ---------------------------------------------------------------------------- keyboard only

_BIG_CELL = """%%meta_init
import torch.nn as nn
big = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(16)])  # 1 GiB"""


def _focus(page) -> dict:
    """Where keyboard focus is: in a widget or not, on which row or control."""
    return page.evaluate(
        """() => { const a = document.activeElement;
          return { inWidget: !!a.closest('.jmi-root'), body: a === document.body,
                   role: a.getAttribute('role'), row: a.querySelector('.jmi-name')?.title ?? null,
                   cls: a.className, bar: !!a.closest('[role=toolbar]') }; }"""
    )


def _on_row(page, qname: str) -> None:
    focus = _focus(page)
    assert focus["role"] == "treeitem" and focus["row"] == qname, focus


def test_a_keyboard_only_pass_keeps_focus_in_the_widget_and_reaches_every_action_in_one_key(
    browser, frontend
):
    app = "jupyterlab4" if frontend["app"] == "jupyterlab" else "notebook7"
    page = _open_and_build(browser, frontend, "keyboard.ipynb", [*_FLOW_CELLS[:2], _BIG_CELL])
    widget = page.locator(".jmi-root").first
    _row(widget, "model.layers").locator(".jmi-c-type").click()
    page.keyboard.press("ArrowRight")
    _row(widget, "model.layers.1").wait_for(timeout=5_000)
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    _on_row(page, "model.layers.1")

    # m materializes the focused row (nothing is ticked), f frees it: the row keeps the focus
    page.keyboard.press("m")
    _row(widget, "model.layers.1").locator(".jmi-badge", has_text="cpu").wait_for(timeout=60_000)
    widget.locator(".jmi-message.jmi-ok").wait_for(timeout=20_000)
    _on_row(page, "model.layers.1")
    page.keyboard.press("f")
    _row(widget, "model.layers.1").locator(".jmi-badge", has_text="deferred").wait_for(
        timeout=60_000
    )
    widget.locator(".jmi-message.jmi-ok", has_text="Freed").wait_for(timeout=20_000)
    _on_row(page, "model.layers.1")

    # p and s open their bars with focus in the first field; Escape closes them, back to the row
    for key, field in (("p", "jmi-plan-devices"), ("s", "jmi-save-path")):
        page.keyboard.press(key)
        assert field in _focus(page)["cls"], (key, _focus(page))
        page.keyboard.press("Escape")
        _on_row(page, "model.layers.1")
    assert widget.locator(".jmi-planbar").is_hidden() and widget.locator(".jmi-savebar").is_hidden()

    # Shift+Enter never collapses an open row; the action bar is one Shift+Tab away, and back
    page.keyboard.press("ArrowUp")
    page.keyboard.press("ArrowUp")
    _on_row(page, "model.layers")
    page.keyboard.press("Shift+Enter")
    page.wait_for_timeout(300)
    assert _row(widget, "model.layers").get_attribute("aria-expanded") == "true"
    _on_row(page, "model.layers")
    page.keyboard.press("Shift+Tab")
    assert _focus(page)["bar"], _focus(page)
    page.keyboard.press("Tab")
    _on_row(page, "model.layers")
    widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-keys-focus.png"))

    # Cancel from its key, then from its button: the row has the focus once Cancel goes away
    _run_cell(page, 2)
    big = page.locator(".jmi-root").nth(1)
    big.wait_for(timeout=30_000)
    for how in ("key", "button"):
        big.locator(".jmi-rows .jmi-row").first.locator(".jmi-c-type").click()
        page.keyboard.press("m")
        big.locator(".jmi-progress").wait_for(state="visible", timeout=30_000)
        if how == "key":
            page.keyboard.press("x")
        else:
            big.locator(".jmi-cancel").focus()
            page.keyboard.press("Enter")
        big.locator(".jmi-progress").wait_for(state="hidden", timeout=60_000)
        page.wait_for_timeout(200)
        focus = _focus(page)
        assert focus["role"] == "treeitem" and focus["row"] == "the whole model", (how, focus)
        assert "Cancelled" in big.locator(".jmi-message").inner_text(), how
    page.keyboard.press("Escape")  # and Escape still leaves for the notebook
    assert not _focus(page)["inWidget"]


def test_every_action_declares_its_key_on_its_button_and_in_its_tooltip(browser, jupyterlab):
    page = _open_and_build(browser, jupyterlab, "keys-declared.ipynb", _FLOW_CELLS[:2])
    widget = page.locator(".jmi-root").first
    found = widget.evaluate(
        """(root) => [...root.querySelectorAll(`.jmi-actions .jmi-btn, .jmi-cancel,
             .jmi-table-toggle, .jmi-planbar .jmi-btn:not(.jmi-plan-go)`)]
             .map((b) => [b.textContent, b.getAttribute('aria-keyshortcuts'), b.title])"""
    )
    assert len(found) >= 9
    for _label, key, title in found:
        assert key and title.endswith(f"(key on a tree row: {_key_text(key)})"), (key, title)
    _row(widget, "model").locator(".jmi-c-type").click()
    page.keyboard.press("?")  # the key list, every key in it
    notice = widget.locator(".jmi-notice")
    notice.wait_for(state="visible", timeout=5_000)
    for label, key, _title in found:
        assert f" {_key_text(key)} " in f" {notice.inner_text()} ", (label, key)


def _key_text(shortcut: str) -> str:
    return shortcut if "+" in shortcut else shortcut.lower()


def _shut_down_kernel(page, app: str) -> None:
    """Kernel → Shut Down Kernel from the menu bar (the same in both front ends)."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Shut Down Kernel").first.click()
    dialog = page.locator(".jp-Dialog")
    with contextlib.suppress(Exception):
        dialog.wait_for(timeout=3_000)
        dialog.locator(".jp-Dialog-button.jp-mod-accept").first.click()


def _nothing_clickable(widget) -> None:
    state = widget.evaluate(
        """(root) => ({
          live: [...root.querySelectorAll('button, input, select, [tabindex="0"]')]
            .filter((el) => !el.disabled && !el.closest('[inert]')).map((el) => el.className),
          badges: [...root.querySelectorAll('.jmi-rows .jmi-badge')]
            .map((b) => getComputedStyle(b).filter),
          banner: root.querySelector('.jmi-disconnected').hidden })"""
    )
    assert state["live"] == [], state["live"]
    assert state["banner"] is False
    assert all("grayscale(1)" in f or f == "none" for f in state["badges"])


@pytest.mark.parametrize("how", ["restart", "shutdown"])
def test_a_dead_kernel_leaves_nothing_clickable_in_the_old_widget(browser, frontend, how):
    app = "jupyterlab4" if frontend["app"] == "jupyterlab" else "notebook7"
    page = _open_and_build(browser, frontend, f"dead-{how}.ipynb", _FLOW_CELLS)
    widget = page.locator(".jmi-root").first
    _run_cell(page, 2)  # a layer on the CPU: a coloured badge that has to go grey
    _row(widget, "model.layers").locator(".jmi-badge", has_text="mixed").wait_for(timeout=10_000)
    widget.locator(".jmi-plan-toggle").click()
    widget.locator(".jmi-plan-devices").fill("cpu=8GiB")
    widget.locator(".jmi-planbar input[type=number]").nth(1).fill("8")
    widget.locator(".jmi-planbar input[type=number]").nth(1).press("Enter")
    widget.locator(".jmi-mat-plan").wait_for(state="visible", timeout=60_000)
    _row(widget, "model.layers").locator(".jmi-c-type").click()
    if how == "restart":
        _restart_kernel(page)
    else:
        _shut_down_kernel(page, app)
    # said at once, with no click: the page follows the notebook's kernel
    widget.locator(".jmi-disconnected").wait_for(state="visible", timeout=20_000)
    _nothing_clickable(widget)
    assert widget.locator(".jmi-mat-plan").is_disabled()
    # the banner is the one alarm: the last message (an old error, say) is greyed with the rest
    message = widget.locator(".jmi-message")
    assert message.evaluate("(el) => getComputedStyle(el).opacity") == "0.5"
    widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-dead-{how}.png"))


_BIG_VALUES_CELLS = [
    "%load_ext jupyter_metainit",
    "%%meta_init\nfrom torch import nn\n\n"
    "big = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(32)])",  # 2 GiB, deferred
]


def test_a_kernel_restarted_during_values_says_the_action_stopped_and_hides_cancel(
    browser, jupyterlab
):
    page = _open_and_build(browser, jupyterlab, "restart-values.ipynb", _BIG_VALUES_CELLS)
    widget = page.locator(".jmi-root").first
    widget.locator(".jmi-values").click()
    progress = widget.locator(".jmi-progress-text", has_text="measure the values")
    progress.wait_for(timeout=30_000)  # seconds of work: 2 GiB of values
    _restart_kernel(page)
    widget.locator(".jmi-disconnected").wait_for(state="visible", timeout=20_000)
    stopped = "measure the values: stopped, the kernel died or was restarted."
    assert progress.inner_text() == stopped
    assert widget.locator(".jmi-cancel").is_hidden()
    widget.screenshot(path=str(ARTIFACTS / "widget-jupyterlab4-restarted-during-values.png"))


# ---------------------------------------------------------------------------- widths and themes

_WIDTH_CELLS = [
    *_FLOW_CELLS[:3],
    "%meta_table model --full",  # a wide table: its summary line has to wrap, not be cut
]


def _layout_faults(widget) -> list[str]:
    """What a width does wrong: a row without its size (or, with the value columns on, its
    std in the size's place) or state, a cell pushed under its row, a name cut, dtype tags
    out of their column, a separator alone at the start or end of a line, anything wider than
    the widget."""
    return widget.evaluate(
        """(root) => {
          const faults = [];
          const box = (el) => el.getBoundingClientRect();
          const shown = (el) => el && el.checkVisibility() && box(el).width > 0;
          const r = box(root);
          for (const row of root.querySelectorAll('.jmi-rows .jmi-row, .jmi-colhead')) {
            const name = row.querySelector('.jmi-name')?.title ?? 'the column heads';
            const figure = shown(row.querySelector('.jmi-c-size')) ? '.jmi-c-size'
              : root.classList.contains('jmi-valued') ? '.jmi-c-std' : '.jmi-c-size';
            const parts = row.classList.contains('jmi-colhead') ? [figure]
              : ['.jmi-name', figure, '.jmi-badge'];
            for (const part of parts) {
              const el = row.querySelector(part);
              if (!shown(el)) faults.push(`${name}: no ${part}`);
              else if (box(el).right > box(row).right + 1) faults.push(`${name}: ${part} cut`);
            }
            for (const cell of row.children) {
              if (shown(cell) && box(cell).top >= box(row).bottom - 1) {
                faults.push(`${name}: ${cell.className} under the row`);
              }
            }
          }
          // a name is whole (the hovered row shows its copy button: it may end in "…")
          for (const n of root.querySelectorAll('.jmi-rows .jmi-row:not(:hover) .jmi-name')) {
            // a long name's head (dom.ts: appendName) ends in an ellipsis when cut
            if ([n, ...n.children].some((e) => e.scrollWidth > e.clientWidth + 1)) {
              faults.push(`${n.title}: name cut`);
            }
          }
          const tags = [...root.querySelectorAll('.jmi-rows .jmi-c-size .jmi-dtype')]
            .filter(shown).map((t) => Math.round(box(t).left));
          if (new Set(tags).size > 1) faults.push(`dtype tags at ${[...new Set(tags)]}`);
          const sep = root.querySelector('.jmi-sep');
          if (shown(sep)) {
            const line = (a, b) => box(a).top < box(b).bottom && box(b).top < box(a).bottom;
            const [p, n] = [sep.previousElementSibling, sep.nextElementSibling];
            if (!line(p, sep) || !line(sep, n)) faults.push('separator alone on its line');
          }
          if (root.scrollWidth > root.clientWidth + 1) faults.push('wider than the widget');
          return faults; }"""
    )


def _summary_cut(page, cell: int) -> dict:
    """The %meta_table summary line of cell ``cell``: its lines and whether it is cut."""
    return (
        page.locator(".jp-Notebook .jp-Cell")
        .nth(cell)
        .evaluate(
            """(cell) => { const p = cell.querySelector('.jmi-table-summary');
          const out = cell.querySelector('.jp-OutputArea-output').getBoundingClientRect();
          const b = p.getBoundingClientRect();
          const line = parseFloat(getComputedStyle(p).lineHeight) || 16;
          return { lines: Math.round(b.height / line), cut: b.right > out.right + 1
                   || p.scrollWidth > p.clientWidth + 1 }; }"""
        )
    )


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_widget_at_1400_700_and_330_px_in_light_and_dark(browser, frontend, theme):
    """Screenshots at each width and theme go to test-artifacts/widget-<app>-<theme>-<px>.png;
    at each: every row keeps its name, size and state, no separator dangles, nothing spills,
    and %meta_table's summary line wraps rather than being cut."""
    app = "jupyterlab4" if frontend["app"] == "jupyterlab" else "notebook7"
    if theme == "dark":
        _set_theme(frontend["settings"], "JupyterLab Dark")
    page = _open_and_build(browser, frontend, f"widths-{theme}.ipynb", _WIDTH_CELLS, height=1100)
    _run_cell(page, 2)
    _run_cell(page, 3)
    widget = page.locator(".jmi-root").first
    _row(widget, "model.layers").locator(".jmi-caret").click()
    _row(widget, "model.layers.1").locator(".jmi-badge", has_text="cpu").wait_for(timeout=10_000)
    found = {}
    for width in (1400, 700, 330):
        page.set_viewport_size({"width": max(width, 700), "height": 1100})
        if width == 330:  # a notebook beside an open side panel: the widget 330 px wide
            widget.evaluate("(r) => { r.closest('.jp-OutputArea-output').style.width = '330px'; }")
        page.wait_for_timeout(400)
        widget.scroll_into_view_if_needed()
        widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-{theme}-{width}.png"))
        px = widget.bounding_box()["width"]
        found[width] = {"widget_px": px, "faults": _layout_faults(widget)}
        if width in (1400, 700):
            found[width]["summary"] = _summary_cut(page, 3)
            table = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".jp-OutputArea-output")
            table.screenshot(path=str(ARTIFACTS / f"meta-table-{app}-{theme}-{width}.png"))
    (ARTIFACTS / f"widths-{app}-{theme}.json").write_text(json.dumps(found, indent=1))
    assert all(not f["faults"] for f in found.values()), found
    assert not found[700]["summary"]["cut"] and not found[1400]["summary"]["cut"], found
    assert found[700]["summary"]["lines"] >= 2, found  # wrapped at 700 px


DOCS_IMG = ROOT / "docs" / "img"
# The documentation's screenshots are taken by these tests into test-artifacts/ and copied to
# docs/img/ only when asked (a test run never changes a tracked file):
#   JMI_REFRESH_DOCS_IMG=1 python -m pytest -m browser tests/test_widget_browser.py
REFRESH_DOCS_IMG = os.environ.get("JMI_REFRESH_DOCS_IMG") == "1"


def _doc_shot(locator, name: str) -> None:
    """Screenshot ``locator`` into test-artifacts/``name``, and into docs/img/ when asked."""
    ARTIFACTS.mkdir(exist_ok=True)
    locator.screenshot(path=str(ARTIFACTS / name))
    if REFRESH_DOCS_IMG:
        shutil.copyfile(ARTIFACTS / name, DOCS_IMG / name)


_CITIZEN_CELLS = [
    "%load_ext jupyter_metainit",
    _FLOW_CELLS[1],
    "%materialize model.model.layers[1] --rng fast",
    # holds the GIL for 12 s: no other kernel thread (comm handling included) runs meanwhile
    "import sys, time\nsys.setswitchinterval(100)\nt0 = time.time()\n"
    "while time.time() - t0 < 12:\n    pass\nsys.setswitchinterval(0.005)",
    """%%meta_init
import torch.nn as nn
big = nn.Sequential(nn.Linear(8, 8), nn.Linear(1_000_000, 1_000_000, bias=False))""",
]


def test_busy_kernel_fast_values_fits_and_focus(browser, frontend):
    """Points 2, 4, 5 and 6 of the widget being a good citizen, in each front end (JupyterLab 4
    in the light theme, Notebook 7 in the dark one); its screenshots are the docs' (_doc_shot)."""
    app = "jupyterlab4" if frontend["app"] == "jupyterlab" else "notebook7"
    theme = "light" if app == "jupyterlab4" else "dark"
    if theme == "dark":
        _set_theme(frontend["settings"], "JupyterLab Dark")
    page = _open_and_build(browser, frontend, "citizen.ipynb", _CITIZEN_CELLS, height=1000)
    widget = page.locator(".jmi-root").first

    # 4: a part materialized with --rng fast is marked on its row and its ancestors
    _run_cell(page, 2)
    _row(widget, "model.layers").locator(".jmi-caret").click()
    _row(widget, "model.layers.1").locator(".jmi-fast").wait_for(timeout=10_000)
    assert _row(widget, "model.layers.0").locator(".jmi-fast").count() == 0
    _doc_shot(widget, f"widget-{app}-{theme}-1400.png")

    # 2: a busy kernel is waited for, not declared dead; the action runs when it is free
    _row(widget, "model.layers.0").locator(".jmi-check").check()
    widget.locator(".jmi-seltotals", has_text="1 subtree").wait_for(timeout=10_000)
    page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_timeout(1_000)
    mat = widget.locator(".jmi-mat-cpu")
    mat.focus()
    page.keyboard.press("Enter")  # 6: by keyboard
    try:
        widget.locator(".jmi-waiting").wait_for(state="visible", timeout=10_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"failure-waiting-{app}.png"))
        raise
    assert widget.locator(".jmi-disconnected").is_hidden()
    widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-waiting.png"))
    _row(widget, "model.layers.0").locator(".jmi-badge", has_text="cpu").wait_for(timeout=40_000)
    widget.locator(".jmi-waiting").wait_for(state="hidden", timeout=5_000)
    widget.locator(".jmi-message.jmi-ok").wait_for(timeout=20_000)
    assert mat.get_attribute("aria-disabled") == "false"
    assert widget.locator(".jmi-disconnected").is_hidden()

    # 6: focus stays on the button after Enter, with a visible 2px ring
    assert page.evaluate("() => document.activeElement.classList.contains('jmi-mat-cpu')"), _focus(
        page
    )
    ring = page.evaluate(
        "() => { const s = getComputedStyle(document.activeElement);"
        " const root = getComputedStyle(document.activeElement.closest('.jmi-root'));"
        " return [s.outlineStyle, s.outlineWidth, s.outlineOffset, s.outlineColor,"
        " root.backgroundColor]; }"
    )
    # outside the button (offset 2px), on the widget's background, so it never blends into
    # the button's own colour (its contrast with the background: labextension/test/contrast)
    assert ring[:3] == ["solid", "2px", "2px"], ring
    assert ring[3] != ring[4], ring
    widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-focus.png"))

    # 5: a selection that cannot fit the CPU's free memory is refused before acting
    _run_cell(page, 4)
    big = page.locator(".jmi-root").nth(1)
    big.wait_for(timeout=30_000)
    big.locator(".jmi-rows .jmi-row:has(.jmi-name[title='1']) .jmi-check").check()
    big.locator(".jmi-nofit", has_text="too big for cpu").wait_for(timeout=10_000)
    big_mat = big.locator(".jmi-mat-cpu")
    assert big_mat.get_attribute("aria-disabled") == "true"
    assert "Does not fit" in big_mat.get_attribute("title")
    _doc_shot(big, f"widget-{app}-{theme}-toobig.png")

    page.set_viewport_size({"width": 700, "height": 1000})
    page.wait_for_timeout(300)
    widget.scroll_into_view_if_needed()
    _doc_shot(widget, f"widget-{app}-{theme}-700.png")


def test_a_plan_made_in_the_widget_shows_each_parts_device_in_jupyterlab(browser, jupyterlab):
    """Plan… in the widget: the tree gains a device column and the header a bar per device;
    screenshots at 1400 and 700 px are the docs' widget-plan-*.png (_doc_shot)."""
    page = _open_and_build(browser, jupyterlab, "plan.ipynb", _FLOW_CELLS[:2], height=1000)
    widget = page.locator(".jmi-root").first

    widget.locator(".jmi-plan-toggle").click()
    widget.locator(".jmi-plan-devices").fill("cuda:0=900KiB, cuda:1=900KiB")
    widget.locator(".jmi-planbar input[type=number]").nth(0).fill("2")
    widget.locator(".jmi-planbar input[type=number]").nth(1).fill("64")
    widget.locator(".jmi-planbar input[type=number]").nth(1).press("Enter")  # by keyboard
    widget.locator(".jmi-planhead .jmi-devbar").nth(1).wait_for(timeout=60_000)
    _row(widget, "model.layers").locator(".jmi-caret").click()
    assert _row(widget, "model.embed_tokens").locator(".jmi-c-device").inner_text() == "cuda:0"
    assert _row(widget, "model.layers.3").locator(".jmi-c-device").inner_text() == "cuda:1"
    assert widget.locator(".jmi-colhead .jmi-c-device").is_visible()
    widget.locator(".jmi-message.jmi-ok", has_text="It fits").wait_for(timeout=10_000)
    _doc_shot(widget, "widget-plan-1400.png")
    assert _cut_tags(widget) == []
    # high enough for the whole widget: a taller one is shot under the status bar
    page.set_viewport_size({"width": 700, "height": 1400})
    page.wait_for_timeout(300)
    widget.scroll_into_view_if_needed()
    assert _row(widget, "model.layers.3").locator(".jmi-c-device").is_visible()
    _doc_shot(widget, "widget-plan-700.png")
    assert _cut_tags(widget) == []

    # a part pinned from its row's key (Shift+P, to the plan bar's device) shows a pin
    page.set_viewport_size({"width": 1400, "height": 1000})
    _row(widget, "model.layers.3").locator(".jmi-c-type").click()
    page.keyboard.press("Shift+P")
    pin = _row(widget, "model.layers.3").locator(".jmi-pin-mark")
    pin.wait_for(timeout=60_000)
    assert pin.inner_text() == "pinned to cuda:0" and pin.locator("svg").is_visible()
    assert _row(widget, "model.layers.3").locator(".jmi-c-device").inner_text().endswith("cuda:0")
    assert _row(widget, "model.layers.2").locator(".jmi-pin-mark").count() == 0
    _on_row(page, "model.layers.3")
    widget.screenshot(path=str(ARTIFACTS / "widget-plan-pinned-1400.png"))
    page.keyboard.press("u")  # Clear pins, from the row
    pin.wait_for(state="detached", timeout=60_000)
    _on_row(page, "model.layers.3")
    page.set_viewport_size({"width": 700, "height": 1000})
    page.wait_for_timeout(300)

    # a plan that does not fit: said in red, each device's "over" whole in its narrow column
    widget.locator(".jmi-plan-devices").fill("cuda:0=100KiB, cuda:1=100KiB")
    widget.locator(".jmi-plan-devices").press("Enter")
    try:
        widget.locator(".jmi-message.jmi-error", has_text="does NOT fit").wait_for(timeout=60_000)
    except Exception:
        raise AssertionError(widget.locator(".jmi-message").inner_text()) from None
    clipped = widget.evaluate(
        """(root) => [...root.querySelectorAll('.jmi-dev-overtag')].filter((tag) => {
          const cell = tag.closest('.jmi-c-device').getBoundingClientRect();
          const r = tag.getBoundingClientRect();
          return r.width === 0 || r.right > cell.right + 0.5;
        }).length"""
    )
    assert widget.locator(".jmi-dev-overtag").count() > 0 and clipped == 0
    widget.screenshot(path=str(ARTIFACTS / "widget-plan-over-700.png"))


def _cut_tags(widget) -> list[str]:
    """The tags beside names shown only in part (a tag shows whole or not at all)."""
    return widget.evaluate(
        """(root) => [...root.querySelectorAll('.jmi-tags')].flatMap((box) => {
          const b = box.getBoundingClientRect();
          // a chip draws no box: its key and its rest are the tags' items
          const items = box.querySelectorAll(':scope > :not(.jmi-chip), :scope > .jmi-chip > *');
          return [...items].filter((t) => {
            const r = t.getBoundingClientRect();
            const shown = r.width > 0 && r.top < b.bottom - 1;
            return shown && r.right > b.right + 0.5;
          }).map((t) => t.textContent);
        })"""
    )


@pytest.mark.parametrize("widget_state", ["not saved", "saved"])
def test_a_reopened_notebook_with_a_new_kernel_says_how_to_get_the_tree_back(
    browser, frontend, widget_state
):
    """Reopened in a new tab after the kernel restarted. ipywidgets saves no widget state by
    default ("model not found"): the note says what the output was and what to do, and
    ipywidgets' error never shows. With *Save Widget State Automatically* on, the saved tree is
    drawn again from the notebook: it says it is not connected, and nothing in it is a control."""
    app = "jupyterlab4" if frontend["app"] == "jupyterlab" else "notebook7"
    saved = widget_state == "saved"
    if saved:
        d = frontend["settings"] / "@jupyter-widgets" / "jupyterlab-manager"
        d.mkdir(parents=True, exist_ok=True)
        (d / "plugin.jupyterlab-settings").write_text(json.dumps({"saveState": True}))
    page = _open_and_build(browser, frontend, "reopen.ipynb", _FLOW_CELLS[:2])
    note = page.locator(".jmi-saved-note")
    assert note.count() == 1 and note.is_hidden()
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1_500)
    _restart_kernel(page)
    page.wait_for_timeout(1_500)
    tab = browser.new_page(viewport={"width": 1400, "height": 900})
    _open(tab, frontend, "reopen.ipynb")
    if saved:
        widget = tab.locator(".jmi-root")
        widget.locator(".jmi-disconnected", has_text="not connected to a kernel").wait_for(
            timeout=30_000
        )
        _nothing_clickable(widget)
        assert tab.locator(".jmi-saved-note").is_hidden()
    else:
        note = tab.locator(".jmi-saved-note")
        note.wait_for(state="visible", timeout=30_000)
        tab.wait_for_timeout(3_000)  # time for the widget manager to give up on the model
        assert "LlamaForCausalLM" in note.inner_text() and "Run the cell again" in note.inner_text()
        assert tab.locator(".jmi-root").count() == 0
    errors = tab.get_by_text("Error displaying widget")
    assert all(not errors.nth(i).is_visible() for i in range(errors.count())), app
    shot = f"widget-{app}-reopened-{widget_state.replace(' ', '-')}.png"
    tab.screenshot(path=str(ARTIFACTS / shot))


# ---------------------------------------------------------------------------- Values

_VALUES_CELLS = [
    *_FLOW_CELLS[:3],
    "import torch\nimport jupyter_metainit\n\nwith torch.no_grad():\n"
    "    model.model.layers[1].mlp.down_proj.weight[0, 0] = float('nan')\n"
    "jupyter_metainit.save(model, 'tuned_ckpt')  # a checkpoint for Compare with…\n"
    "with torch.no_grad():\n"
    "    model.model.norm.weight.mul_(2)  # the model now differs from it there",
]


_TWO_GPU_CELLS = [
    *_FLOW_CELLS[:2],
    "import jupyter_metainit\n\n(w,) = jupyter_metainit.widgets_of(model)\n"
    "# the devices trait as a kernel with two GPUs fills it (this one has none)\n"
    "w.devices = [{'name': f'cuda:{i}', 'label': 'NVIDIA H100 80GB HBM3, 79.1 GiB free'}\n"
    "             for i in (0, 1)]",
]


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_two_gpus_wrap_the_action_bar_between_its_groups_in_jupyterlab(browser, jupyterlab, theme):
    """At 1400 px (JupyterLab with its file browser open) a kernel with two GPUs gives the
    bar more buttons than one line holds: it wraps between its groups, the separator never
    alone. Screenshots: test-artifacts/widget-two-gpus-jupyterlab4-<theme>.png."""
    if theme == "dark":
        _set_theme(jupyterlab["settings"], "JupyterLab Dark")
    page = _open_and_build(browser, jupyterlab, f"gpus-{theme}.ipynb", _TWO_GPU_CELLS)
    _run_cell(page, 2)
    widget = page.locator(".jmi-root").first
    widget.locator(".jmi-actions button", has_text="→ cuda:1").wait_for(timeout=10_000)
    page.wait_for_timeout(400)
    widget.screenshot(path=str(ARTIFACTS / f"widget-two-gpus-jupyterlab4-{theme}.png"))
    found = widget.locator(".jmi-actions").evaluate(
        """(bar) => { const sep = bar.querySelector('.jmi-sep');
          const lines = (g) => new Set([...g.children].map((c) => c.offsetTop)).size;
          const groups = [...bar.querySelectorAll('.jmi-group')];
          const [before, after] = [sep.previousElementSibling, sep.nextElementSibling];
          return { groups: groups.length, split: groups.filter((g) => lines(g) > 1).length,
                   dangling: sep.checkVisibility() && before.offsetTop !== after.offsetTop }; }"""
    )
    assert found == {"groups": 3, "split": 0, "dangling": False}, found
    assert _layout_faults(widget) == []


def _focus_in_widget(page, step: str) -> None:
    """The keyboard focus is on a control of the widget, never fallen to <body>."""
    focus = _focus(page)
    assert focus["inWidget"] and not focus["body"], (step, focus)


def _values_measured(page):
    """Run the values notebook's last cells, then v on the model's row: the values measured."""
    _run_cell(page, 2)
    _run_cell(page, 3)
    widget = page.locator(".jmi-root").first
    _row(widget, "model.layers").locator(".jmi-badge", has_text="mixed").wait_for(timeout=10_000)
    _row(widget, "model").locator(".jmi-c-type").click()
    page.keyboard.press("v")
    widget.locator(".jmi-message", has_text="Measured the values").wait_for(timeout=60_000)
    return widget


def _compare_typed(page, widget, other: str) -> None:
    """d opens Compare with… with the focus in its field; ``other`` typed over what is there."""
    page.keyboard.press("d")
    assert "jmi-compare-other" in _focus(page)["cls"], _focus(page)
    page.keyboard.press("Control+A")
    page.keyboard.type(other)
    page.keyboard.press("Enter")


def test_values_and_compare_with_a_checkpoint_from_the_keyboard(browser, frontend):
    """Keyboard only, the focus never leaving the widget: v on the model's row measures the
    values (deferred parts staying deferred; the columns, the NaN flag, the depth chart and
    the focused row's histogram show); Tab reaches the chart's statistic and an arrow key
    changes it; d opens Compare with…, where a path that holds no checkpoint is refused in one
    line and a checkpoint directory colours the rows."""
    page = _open_and_build(browser, frontend, "values-keys.ipynb", _VALUES_CELLS, height=1300)
    widget = _values_measured(page)
    _on_row(page, "model")  # the focus stayed on the row
    assert widget.locator(".jmi-values-panel").is_visible()
    assert _row(widget, "model.layers").locator(".jmi-bad", has_text="NaN").is_visible()
    assert _row(widget, "model.embed_tokens").locator(".jmi-bad").count() == 0
    std = _row(widget, "model.embed_tokens").locator(".jmi-c-std").inner_text()
    assert 0.015 < float(std) < 0.025, std  # Llama's init: normal(0, 0.02)
    assert _row(widget, "model.layers").locator(".jmi-badge", has_text="mixed").count() == 1
    assert widget.locator(".jmi-chart-box .jmi-dot").count() >= 3
    assert widget.locator(".jmi-legend").is_hidden()  # no comparison yet
    page.keyboard.press("ArrowDown")  # the next row: the focused row's histogram follows
    _on_row(page, "model.embed_tokens")
    widget.locator(".jmi-hist-box", has_text="model.embed_tokens.weight").wait_for(timeout=5_000)

    # the chart's statistic: two Tabs from the row, an arrow key; two Shift+Tabs back
    page.keyboard.press("Tab")
    assert "jmi-values-cols" in _focus(page)["cls"], _focus(page)
    page.keyboard.press("Tab")
    assert "jmi-stat-sel" in _focus(page)["cls"], _focus(page)
    page.keyboard.press("ArrowDown")
    widget.locator(".jmi-chart-title", has_text="absmax of").wait_for(timeout=5_000)
    _focus_in_widget(page, "statistic chosen")
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Shift+Tab")
    _on_row(page, "model.embed_tokens")
    # Shift+V hides the columns; the flag stays
    page.keyboard.press("Shift+V")
    assert widget.locator(".jmi-rows .jmi-c-std").count() == 0
    assert _row(widget, "model.layers").locator(".jmi-bad").is_visible()
    _on_row(page, "model.embed_tokens")

    # Compare with…: a path that is no checkpoint is refused in one line, the focus stays put
    _compare_typed(page, widget, "no_such_ckpt")
    notice = widget.locator(".jmi-notice", has_text="no such file or directory")
    notice.wait_for(timeout=20_000)
    assert "\n" not in notice.inner_text().strip()
    _focus_in_widget(page, "refused path")
    page.keyboard.press("Escape")
    _on_row(page, "model.embed_tokens")
    # the checkpoint the notebook saved: the norm, doubled since, differs by rel_l2 ‖2x-x‖/‖2x‖
    _compare_typed(page, widget, "tuned_ckpt")
    widget.locator(".jmi-message", has_text="Compared").wait_for(timeout=60_000)
    assert "tuned_ckpt" in widget.locator(".jmi-message").inner_text()
    _focus_in_widget(page, "compared")
    page.keyboard.press("Escape")
    _on_row(page, "model.embed_tokens")
    norm = _row(widget, "model.norm")
    assert "jmi-cmp-large" in norm.get_attribute("class")
    assert "rel_l2 up to 0.5" in norm.get_attribute("title")
    assert widget.locator(".jmi-legend").is_visible()


def test_values_cancelled_from_the_keyboard_publish_nothing_and_keep_the_row_focused(
    browser, jupyterlab
):
    page = _open_and_build(
        browser, jupyterlab, "values-cancel.ipynb", [*_FLOW_CELLS[:2], _BIG_CELL]
    )
    _run_cell(page, 2)
    big = page.locator(".jmi-root").nth(1)
    big.wait_for(timeout=30_000)
    big.locator(".jmi-rows .jmi-row").first.locator(".jmi-c-type").click()
    page.keyboard.press("v")
    big.locator(".jmi-progress").wait_for(state="visible", timeout=30_000)
    page.keyboard.press("x")
    big.locator(".jmi-progress").wait_for(state="hidden", timeout=60_000)
    page.wait_for_timeout(200)
    focus = _focus(page)
    assert focus["role"] == "treeitem" and focus["row"] == "the whole model", focus
    assert "Cancelled" in big.locator(".jmi-message").inner_text()
    assert big.locator(".jmi-values-panel").is_hidden()


def _action_bar_lines(widget) -> int:
    """How many lines the action bar takes (its separator, shorter, is not counted)."""
    return widget.locator(".jmi-actions").evaluate(
        """(bar) => new Set([...bar.children].filter((c) => !c.classList.contains('jmi-sep')
             && c.offsetWidth).map((c) => c.offsetTop)).size"""
    )


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_values_and_compare_at_1400_700_580_and_330_px_in_light_and_dark(browser, frontend, theme):
    """With the value columns, the chart panel and a comparison with a checkpoint path shown,
    at each width every row keeps its whole name (beside a NaN flag too), state and key
    figure (its size; its std in the size's place at ~330 px), the dtype tags one column, no
    cell falls under its row, no separator dangles, and the action bar takes one line at
    1400 px. Screenshots:
    test-artifacts/widget-<app>-values-<theme>-<px>.png."""
    app = "jupyterlab4" if frontend["app"] == "jupyterlab" else "notebook7"
    if theme == "dark":
        _set_theme(frontend["settings"], "JupyterLab Dark")
    page = _open_and_build(browser, frontend, f"values-{theme}.ipynb", _VALUES_CELLS, height=1300)
    widget = _values_measured(page)
    page.keyboard.press("ArrowDown")  # embed_tokens: its histogram
    widget.locator(".jmi-hist-box", has_text="model.embed_tokens.weight").wait_for(timeout=5_000)
    if (app, theme) == ("jupyterlab4", "light"):
        _doc_shot(widget, "widget-values.png")  # docs/values.md, notebook-workflow.md
    _compare_typed(page, widget, "tuned_ckpt")
    widget.locator(".jmi-message", has_text="Compared").wait_for(timeout=60_000)
    found = {}
    for width in (1400, 700, 580, 330):
        # below 700: a notebook beside an open side panel, the widget this wide in a window
        # wide enough to hold it (JupyterLab's own panels take ~370 px of a 700 px window)
        page.set_viewport_size({"width": 1400 if width < 700 else width, "height": 1300})
        if width < 700:
            widget.evaluate(
                "(r, w) => { r.style.maxWidth = w + 'px'; }",
                width,  # the widget's own width
            )
        page.wait_for_timeout(400)
        widget.scroll_into_view_if_needed()
        widget.screenshot(path=str(ARTIFACTS / f"widget-{app}-values-{theme}-{width}.png"))
        found[width] = {
            "widget_px": widget.bounding_box()["width"],
            "faults": _layout_faults(widget),
            "bar_lines": _action_bar_lines(widget),
        }
    (ARTIFACTS / f"values-widths-{app}-{theme}.json").write_text(json.dumps(found, indent=1))
    assert abs(found[580]["widget_px"] - 580) <= 2, found  # each width is the one looked at
    assert all(not f["faults"] for f in found.values()), found
    assert found[1400]["bar_lines"] == 1, found
    std = _row(widget, "model.embed_tokens").locator(".jmi-c-std")
    assert std.is_visible() and 0.015 < float(std.inner_text()) < 0.025  # at 330 px


# ---------------------------------------------------------------------------- narrow widths

_NARROW_FAULTS = """(root) => {
  const faults = [];
  const box = (el) => el.getBoundingClientRect();
  const shown = (el) => el && el.checkVisibility() && box(el).width > 0;
  for (const row of root.querySelectorAll('.jmi-rows .jmi-row')) {
    const name = row.querySelector('.jmi-name'), cell = box(row.querySelector('.jmi-c-name'));
    const q = name.title;
    // the name whole, hovered or focused (its copy button takes only the room left)
    const headCut = [...name.children].some((e) => e.scrollWidth > e.clientWidth + 1);
    if (name.scrollWidth > name.clientWidth + 1 || headCut || box(name).right > cell.right + 1) {
      faults.push(`${q}: name cut`);
    }
    const flag = row.querySelector('.jmi-c-name .jmi-bad');
    if (shown(flag) && box(flag).right > cell.right + 1) faults.push(`${q}: flag cut`);
    // a chip: its key ("x4") and its rest (", identical") each whole on the tags' line (the
    // rest beside its key) or not there
    for (const chip of row.querySelectorAll('.jmi-tags > .jmi-chip')) {
      const tags = box(chip.parentElement);
      const key = chip.querySelector('.jmi-chip-key'), rest = chip.querySelector('.jmi-chip-rest');
      const on = (el) => shown(el) && box(el).top < tags.bottom - 1;
      if (on(key) && box(key).right > tags.right + 0.5) faults.push(`${q}: chip key cut`);
      if (on(rest) && (!on(key) || box(rest).right > tags.right + 0.5)) {
        faults.push(`${q}: "${chip.textContent}" cut`);
      }
    }
    // a tied row: its mark shows whole in the name's cell, clear of the name
    if (row.title.includes('tied to')) {
      const mark = row.querySelector('.jmi-tie-mark');
      if (!shown(mark) || box(mark).width < 10) faults.push(`${q}: no tie mark`);
      else if (box(mark).left < cell.left - 0.5 || box(mark).right > box(name).left + 0.5) {
        faults.push(`${q}: tie mark out of place`);
      }
      if (!row.getAttribute('aria-label').includes('tied to')) faults.push(`${q}: tie unsaid`);
    }
    const dev = row.querySelector('.jmi-c-device .jmi-dev-name');
    if (root.querySelector('.jmi-planned') && (!shown(dev) || dev.scrollWidth > dev.clientWidth + 1
        || box(dev).right > box(row.querySelector('.jmi-c-device')).right + 1)) {
      faults.push(`${q}: device cut`);
    }
  }
  if (root.scrollWidth > root.clientWidth + 1) faults.push('wider than the widget');
  return faults; }"""


def _plan_in_the_widget(widget) -> None:
    """Plan… in the widget for two (pretend) GPUs: the device column shows."""
    widget.locator(".jmi-plan-toggle").click()
    widget.locator(".jmi-plan-devices").fill("cuda:0=900KiB, cuda:1=900KiB")
    widget.locator(".jmi-planbar input[type=number]").nth(0).fill("2")
    widget.locator(".jmi-planbar input[type=number]").nth(1).fill("64")
    widget.locator(".jmi-planbar input[type=number]").nth(1).press("Enter")
    widget.locator(".jmi-planhead .jmi-devbar").nth(1).wait_for(timeout=60_000)
    widget.locator(".jmi-colhead .jmi-c-device").wait_for(timeout=10_000)


def _at_width(page, widget, width: int) -> None:
    """The widget ``width`` px wide in a 1400 px window (a notebook beside side panels)."""
    widget.evaluate("(r, w) => { r.style.maxWidth = w + 'px'; }", width)
    page.wait_for_timeout(400)
    widget.scroll_into_view_if_needed()


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_names_chips_and_tie_marks_at_700_580_and_330_px_planned_or_not_in_jupyterlab(
    browser, jupyterlab, theme
):
    """A tied Llama with repeated layers, a NaN flagged, the embeddings' row focused and
    hovered, before and after Plan…: at each width every name shows whole (its NaN flag too),
    a repeated-blocks (xN) or tied chip shows whole, as its key alone, or not at all, a tied
    row keeps its ⇄ mark, and a planned row its device. Screenshots:
    test-artifacts/widget-jupyterlab4-narrow-<theme>-<plain|planned>-<px>.png."""
    if theme == "dark":
        _set_theme(jupyterlab["settings"], "JupyterLab Dark")
    page = _open_and_build(browser, jupyterlab, f"narrow-{theme}.ipynb", _VALUES_CELLS, 1300)
    widget = _values_measured(page)
    page.keyboard.press("Shift+V")  # the NaN flags beside the names
    _row(widget, "model.layers").locator(".jmi-caret").click()
    found: dict[str, dict] = {}
    for planned in ("plain", "planned"):
        if planned == "planned":
            _at_width(page, widget, 1400)
            _plan_in_the_widget(widget)
        _row(widget, "model.embed_tokens").locator(".jmi-c-size").click()  # focused, hovered
        for width in (700, 580, 330):
            _at_width(page, widget, width)
            shot = f"widget-jupyterlab4-narrow-{theme}-{planned}-{width}.png"
            widget.screenshot(path=str(ARTIFACTS / shot))
            found[f"{planned}-{width}"] = {
                "widget_px": round(widget.bounding_box()["width"]),
                "faults": widget.evaluate(_NARROW_FAULTS),
                "marks": widget.locator(".jmi-rows .jmi-tie-mark").count(),
            }
    (ARTIFACTS / f"narrow-jupyterlab4-{theme}.json").write_text(json.dumps(found, indent=1))
    assert all(abs(f["widget_px"] - int(k[-3:])) <= 2 for k, f in found.items()), found
    assert all(not f["faults"] for f in found.values()), found
    assert all(f["marks"] == 2 for f in found.values()), found  # embed_tokens and lm_head
    layers = _row(widget, "model.layers")
    assert "4 identical LlamaDecoderLayer blocks" in layers.get_attribute("aria-label")
    assert layers.locator(".jmi-chip").get_attribute("title") == (
        "4 identical LlamaDecoderLayer blocks"
    )


def test_every_action_is_reachable_from_the_keyboard_at_330_px_in_jupyterlab(browser, jupyterlab):
    """The widget 330 px wide, the tree focused: each action's key works with the focus kept
    in the widget (on the row, or in its bar's first field and back with Escape), Shift+Tab
    from the row reaches every button of the action bar, and the focus never falls to <body>.
    Screenshot: test-artifacts/widget-jupyterlab4-keys-330.png."""
    page = _open_and_build(browser, jupyterlab, "keys-330.ipynb", _VALUES_CELLS, 1300)
    _run_cell(page, 2)  # layer 1 real
    _run_cell(page, 3)  # a checkpoint to compare with
    widget = page.locator(".jmi-root").first
    _at_width(page, widget, 330)
    _row(widget, "model.layers").locator(".jmi-c-size").click()
    page.keyboard.press("ArrowRight")
    _row(widget, "model.layers.2").wait_for(timeout=5_000)
    for _ in range(3):
        page.keyboard.press("ArrowDown")
    _on_row(page, "model.layers.2")

    # m, f, v act on the focused row and leave the focus on it
    page.keyboard.press("m")
    _row(widget, "model.layers.2").locator(".jmi-badge", has_text="cpu").wait_for(timeout=60_000)
    _on_row(page, "model.layers.2")
    page.keyboard.press("f")
    _row(widget, "model.layers.2").locator(".jmi-badge", has_text="deferred").wait_for(
        timeout=60_000
    )
    _on_row(page, "model.layers.2")
    page.keyboard.press("v")
    widget.locator(".jmi-message", has_text="Measured the values").wait_for(timeout=60_000)
    _on_row(page, "model.layers.2")
    # p, s, d open their bars with the focus in the first field; Escape goes back to the row
    for key, field in (
        ("p", "jmi-plan-devices"),
        ("s", "jmi-save-path"),
        ("d", "jmi-compare-other"),
    ):
        page.keyboard.press(key)
        _focus_in_widget(page, key)
        assert field in _focus(page)["cls"], (key, _focus(page))
        page.keyboard.press("Escape")
        _on_row(page, "model.layers.2")
    widget.screenshot(path=str(ARTIFACTS / "widget-jupyterlab4-keys-330.png"))

    # Shift+Tab from the row to the action bar (one stop, a toolbar): → walks every button of
    # it, wrapped on several lines, and Tab goes back to the row; the focus never on <body>
    page.keyboard.press("Shift+Tab")
    assert _focus(page)["bar"], _focus(page)
    reached = []
    for _ in range(20):
        _focus_in_widget(page, f"toolbar after {reached}")
        reached.append(page.evaluate("() => document.activeElement.textContent.trim()"))
        page.keyboard.press("ArrowRight")
    for label in ("Materialize → CPU", "Free", "Values", "Compare with…", "Plan…", "Save…"):
        assert label in reached, (label, reached)
    page.keyboard.press("Tab")
    _on_row(page, "model.layers.2")
