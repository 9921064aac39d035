"""The widget's bars, notices and deep names from the keyboard in JupyterLab (Chromium driven by
Playwright): what an outside tester found at narrow widths and in the bars' fields.

A click on a row's size cell puts the focus in the tree (as in test_widget_browser.py); every
step after it is a key. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import os

import pytest
import test_widget_browser as wb

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not os.path.exists(wb.CHROMIUM),
        reason=f"{wb.CHROMIUM} is missing (install it with: apt-get install -y chromium)",
    ),
]


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=wb.CHROMIUM, args=wb.CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def jupyterlab():
    with wb._jupyter_server("jupyterlab") as server:
        yield server


def _built(browser, server: dict, name: str, theme: str = "light", height: int = 900):
    """The small Llama's widget in JupyterLab (``theme``; the page 1400 px wide and ``height``
    px high), and the page."""
    if theme == "dark":
        wb._set_theme(server["settings"], "JupyterLab Dark")
    page = wb._open_and_build(browser, server, name, wb._FLOW_CELLS[:2], height=height)
    return page, page.locator(".jmi-root").first


def _focus_row(page, widget, qname: str) -> None:
    wb._row(widget, qname).locator(".jmi-c-size").click()
    wb._on_row(page, qname)


def test_typing_in_a_bar_replaces_its_prefilled_text(browser, jupyterlab):
    """Plan… opens with "auto" selected, Save… and Compare with… with their last text
    selected: what is typed replaces it (as in JupyterLab's rename and save dialogs)."""
    page, widget = _built(browser, jupyterlab, "prefilled.ipynb")
    _focus_row(page, widget, "model")
    typed = {}
    for key, field in (
        ("p", "jmi-plan-devices"),
        ("s", "jmi-save-path"),
        ("d", "jmi-compare-other"),
    ):
        for text in ("first", "cpu=64GiB"):  # the second time over the first one's text
            page.keyboard.press(key)
            assert field in wb._focus(page)["cls"], (key, wb._focus(page))
            page.keyboard.type(text)
            typed[key] = widget.locator(f".{field}").input_value()
            page.keyboard.press("Escape")
            wb._on_row(page, "model")
    assert typed == {"p": "cpu=64GiB", "s": "cpu=64GiB", "d": "cpu=64GiB"}, typed


# the focused row is within every box that scrolls it and within the window
_IN_VIEW = """(row) => {
  const r = row.getBoundingClientRect();
  for (let el = row.parentElement; el; el = el.parentElement) {
    const s = getComputedStyle(el);
    if (/(auto|scroll)/.test(s.overflowY) && el.scrollHeight > el.clientHeight) {
      const b = el.getBoundingClientRect();
      if (r.top < b.top - 1 || r.bottom > b.bottom + 1) return false;
    }
  }
  return r.top >= 0 && r.bottom <= window.innerHeight; }"""


def test_the_key_list_keeps_the_focused_row_in_view_at_330_px(browser, jupyterlab):
    """At 330 px the key list (?) above the tree is taller than what is left below the
    focused row: the notebook scrolls so that the row stays in view, focused.
    Screenshot (the page): test-artifacts/widget-jupyterlab4-keylist-330.png."""
    # a view lower than the widget, as on a laptop: the row at its bottom, the notebook scrolled
    page, widget = _built(browser, jupyterlab, "keylist.ipynb", height=640)
    wb._at_width(page, widget, 330)
    _focus_row(page, widget, "model")
    page.keyboard.press("End")
    wb._on_row(page, "lm_head")
    row = wb._row(widget, "lm_head")
    row.evaluate("(r) => r.scrollIntoView({ block: 'end' })")  # at the bottom of the view
    assert row.evaluate(_IN_VIEW)
    page.keyboard.press("?")
    widget.locator(".jmi-notice", has_text="Keys").wait_for(timeout=5_000)
    page.wait_for_timeout(300)
    page.screenshot(path=str(wb.ARTIFACTS / "widget-jupyterlab4-keylist-330.png"))  # as seen
    wb._on_row(page, "lm_head")
    assert row.evaluate(_IN_VIEW), row.bounding_box()


def test_enter_in_save_with_two_subtrees_ticked_says_why_in_the_live_region(browser, jupyterlab):
    """Save is unavailable with two subtrees ticked: Enter in its path field says why in the
    widget's live region (role=status) and leaves the focus in the field."""
    page, widget = _built(browser, jupyterlab, "save-two.ipynb")
    _focus_row(page, widget, "model.embed_tokens")
    page.keyboard.press("Space")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    wb._on_row(page, "model.norm")
    page.keyboard.press("Space")
    widget.locator(".jmi-seltotals", has_text="2 subtrees").wait_for(timeout=10_000)
    page.keyboard.press("s")
    page.keyboard.type("ckpt")
    page.keyboard.press("Enter")
    notice = widget.locator(".jmi-notice[role=status]")
    notice.wait_for(state="visible", timeout=5_000)
    assert notice.inner_text() == "Save: Select one subtree, or none for the whole model"
    assert "jmi-save-path" in wb._focus(page)["cls"], wb._focus(page)


# Per row: its name's end (a long name's last part, or a short name whole) shows whole in the
# name's cell, and the row says its whole name in its title and accessible name.
_DEEP_NAMES = """(root) => [...root.querySelectorAll('.jmi-rows .jmi-row')].map((row) => {
  const name = row.querySelector('.jmi-name'), cell = row.querySelector('.jmi-c-name');
  const end = name.querySelector('.jmi-name-end') ?? name;
  const r = end.getBoundingClientRect();
  const whole = r.width > 0 && end.scrollWidth <= end.clientWidth + 1
    && r.right <= cell.getBoundingClientRect().right + 1;
  return { q: name.title, end: end.textContent, whole, text: name.textContent,
           said: row.getAttribute('aria-label').startsWith(name.title) }; })"""


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_deep_long_names_keep_their_end_at_700_and_330_px(browser, jupyterlab, theme):
    """A decoder layer opened from the keyboard: at 700 and 330 px `input_layernorm` and
    `post_attention_layernorm` (depth 4) show their end ("…layernorm") whole, every other name
    is whole, and each row says its whole name. Screenshots:
    test-artifacts/widget-jupyterlab4-deep-<theme>-<px>.png."""
    page, widget = _built(browser, jupyterlab, f"deep-{theme}.ipynb", theme)
    _focus_row(page, widget, "model.layers")
    page.keyboard.press("ArrowRight")  # open the layers
    page.keyboard.press("ArrowDown")
    wb._on_row(page, "model.layers.0")
    page.keyboard.press("ArrowRight")  # open the first layer
    wb._row(widget, "model.layers.0.post_attention_layernorm").wait_for(timeout=5_000)
    found = {}
    for width in (700, 330):
        wb._at_width(page, widget, width)
        wb._row(widget, "model.layers.0.post_attention_layernorm").scroll_into_view_if_needed()
        widget.screenshot(path=str(wb.ARTIFACTS / f"widget-jupyterlab4-deep-{theme}-{width}.png"))
        found[width] = widget.evaluate(_DEEP_NAMES)
    for width, rows in found.items():
        assert all(r["whole"] and r["said"] for r in rows), (width, rows)
        deep = {r["q"]: r for r in rows if r["q"].endswith("layernorm")}
        for q in ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"):
            assert deep[q]["end"] == "layernorm", (width, deep)
            assert deep[q]["text"] == q.rsplit(".", 1)[1], (width, deep)
