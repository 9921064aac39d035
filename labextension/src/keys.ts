// The widget's actions as one table: each has a key pressed on a tree row, a label, what it
// acts on and why it cannot run now, and a handler. The buttons show the same table (their
// aria-keyshortcuts and the key in their tooltip); a new action is one more entry.

/** What an action acts on: the ticked rows, or the focused row when none is ticked. */
export interface Target {
  names: string[];
  /** The names are the ticked rows (the selection summary, fit included, describes them). */
  ticked: boolean;
  /** Per name, the state of its row ("deferred", "cpu", "mixed", ""). */
  states: string[];
}

export interface Action {
  /** Stable id ("mat-cpu", "free", "plan"...). */
  id: string;
  /** `aria-keyshortcuts` value of its key on a tree row: "M", "Shift+M", "1". */
  shortcut: string;
  /** What it is, in words, for the key list ("Materialize → CPU"). */
  label: string;
  /** What it does, when it can (its button's tooltip). */
  what?: string;
  /** Why it cannot run now for `target`; "" when it can. */
  blocked(target: Target): string;
  /** Carry it out for `target`. */
  run(target: Target): void;
  /** The button it is on, if any (gets the key's `aria-keyshortcuts`). */
  button?: HTMLButtonElement;
  /** After its key: the element that takes the focus (a bar's first field); none: the row. */
  focusAfter?(): HTMLElement | null;
}

/** `"Shift+M"` -> `"Shift+M"`, `"M"` -> `"m"`: the key as the tooltip writes it. */
export function keyText(shortcut: string): string {
  return shortcut.includes("+") ? shortcut : shortcut.toLowerCase();
}

/** Whether the key event presses `shortcut` (letters by their key, Shift as written). */
export function pressed(shortcut: string, ev: KeyboardEvent): boolean {
  if (ev.altKey || ev.ctrlKey || ev.metaKey) return false;
  const parts = shortcut.split("+");
  const key = parts[parts.length - 1];
  const shift = parts.includes("Shift");
  if (/^[0-9]$/.test(key)) return ev.key === key && !ev.shiftKey;
  // a symbol ("?") is what the layout types, Shift or not
  if (!/^[a-z]$/i.test(key)) return ev.key === key;
  return ev.key.toLowerCase() === key.toLowerCase() && ev.shiftKey === shift;
}

/** The action a key on a tree row runs, if any. */
export function actionFor(actions: Action[], ev: KeyboardEvent): Action | undefined {
  return actions.find((a) => pressed(a.shortcut, ev));
}

/** Put the action's key on its button: `aria-keyshortcuts`, read out by screen readers. */
export function declareKey(action: Action): void {
  action.button?.setAttribute("aria-keyshortcuts", action.shortcut);
}

/** The tooltip of a button whose action has a key: what it does (or why not), then the key. */
export function withKey(why: string, shortcut: string | null): string {
  return shortcut ? `${why} (key on a tree row: ${keyText(shortcut)})` : why;
}

/** Every key of the tree in one line, for `?`. */
export function keyList(actions: Action[]): string {
  const seen = new Set<string>();
  const parts: string[] = [];
  for (const a of actions) {
    if (seen.has(a.shortcut)) continue;
    seen.add(a.shortcut);
    parts.push(`${keyText(a.shortcut)} ${a.label}`);
  }
  return `Keys on a tree row (they act on the ticked rows, or on the focused one): ${parts.join(" · ")} · ↑↓←→ Home End move · Space ticks · Enter opens · Esc back to the notebook`;
}
