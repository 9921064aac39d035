// Keyboard focus never falls to the page. When the element holding it goes away under it (the
// Cancel button once the action ends, a bar that closes, a control disabled because the kernel
// went away), focus moves to a sensible place in the widget: the focused tree row, or the banner
// of a widget that lost its model. When the person moves focus out of the widget themselves (a
// click elsewhere, Tab, Escape), it is left where they put it.

/** Whether `el` can hold keyboard focus now: in the page, not hidden, inert or disabled. */
export function usable(el: Element | null): boolean {
  if (!el || !el.isConnected) return false;
  if (el.closest("[hidden], [inert]")) return false;
  return !(el as HTMLButtonElement).disabled;
}

export class FocusKeeper {
  /** The element inside the widget that last had focus; null once the person left. */
  private last: HTMLElement | null = null;
  private scheduled = false;

  constructor(
    private readonly root: HTMLElement,
    /** Where focus goes when its element goes away. */
    private readonly fallback: () => HTMLElement | null,
  ) {
    root.addEventListener("focusin", (ev) => {
      this.last = ev.target as HTMLElement;
    });
    root.addEventListener("focusout", (ev) => {
      const to = ev.relatedTarget as Node | null;
      if (to && root.contains(to)) return;
      const from = ev.target as HTMLElement;
      // still usable after the event: the person moved focus away; else it was taken from it
      queueMicrotask(() => {
        if (this.last === from && usable(from)) this.last = null;
        this.check();
      });
    });
  }

  /** Check once the current re-render is done (many renders may ask in one go). */
  schedule(): void {
    if (this.scheduled) return;
    this.scheduled = true;
    queueMicrotask(() => {
      this.scheduled = false;
      this.check();
    });
  }

  /** Put focus back in the widget if its element went away while it held it. */
  check(): void {
    const last = this.last;
    if (!last) return;
    const active = document.activeElement as HTMLElement | null;
    const elsewhere = active && active !== document.body && !this.root.contains(active);
    if (elsewhere) {
      this.last = null; // the person is somewhere else on the page
      return;
    }
    if (active && this.root.contains(active) && usable(active)) return;
    if (usable(last)) return; // a click on the page's background: not ours to take back
    const to = this.fallback();
    if (to && to !== active) to.focus({ preventScroll: true });
  }
}
