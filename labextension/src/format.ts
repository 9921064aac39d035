// Human-readable numbers, matching the kernel side's units (binary bytes, B/M/K params).

export function humanBytes(n: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let u = 0;
  while (Math.abs(n) >= 1024 && u < units.length - 1) {
    n /= 1024;
    u++;
  }
  return u === 0 ? `${Math.round(n)} B` : `${n.toFixed(1)} ${units[u]}`;
}

export function humanCount(n: number): string {
  const a = Math.abs(n);
  if (a >= 1e12) return `${(n / 1e12).toFixed(2)} T`;
  if (a >= 1e9) return `${(n / 1e9).toFixed(2)} B`;
  if (a >= 1e6) return `${(n / 1e6).toFixed(1)} M`;
  if (a >= 1e3) return `${(n / 1e3).toFixed(1)} K`;
  return `${n}`;
}

export function percent(part: number, whole: number): string {
  if (!whole) return "";
  const p = (100 * part) / whole;
  if (p === 0) return "0%";
  if (p < 0.1) return "<0.1%";
  return p >= 10 ? `${p.toFixed(0)}%` : `${p.toFixed(1)}%`;
}

/** CSS class suffix for a state badge: deferred, cpu, cuda, mixed, none. */
export function stateKind(state: string): string {
  if (!state) return "none";
  if (state === "deferred" || state === "mixed" || state === "cpu") return state;
  if (state.startsWith("cuda")) return "cuda";
  return "other";
}
