// Human-readable numbers: the twin of jupyter_metainit/core/runtime/format.py, tested against the
// same cases (test/format_cases.json): binary bytes and K/M/B/T counts, three digits.

/** Three significant digits, trailing zeros kept (1.50, 15.0, 150). */
function threeDigits(v: number): string {
  const a = Math.abs(v);
  if (a >= 99.95) return v.toFixed(0);
  if (a >= 9.995) return v.toFixed(1);
  return v.toFixed(2);
}

const BYTE_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

export function humanBytes(n: number): string {
  let v = n;
  for (let u = 0; u < BYTE_UNITS.length; u++) {
    if (Math.abs(v) < 999.5 || u === BYTE_UNITS.length - 1) {
      return u === 0 ? `${Math.round(v)} B` : `${threeDigits(v)} ${BYTE_UNITS[u]}`;
    }
    v /= 1024;
  }
  return "";
}

const COUNT_UNITS: Array<[string, number]> = [
  ["T", 1e12],
  ["B", 1e9],
  ["M", 1e6],
  ["K", 1e3],
];

export function humanCount(n: number): string {
  for (const [unit, scale] of COUNT_UNITS) {
    if (Math.abs(n) >= scale * 0.9995) return `${threeDigits(n / scale)} ${unit}`;
  }
  return `${Math.trunc(n)}`;
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
