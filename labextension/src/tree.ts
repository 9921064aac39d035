// The model tree on the page: parsing the compact JSON the kernel sends, which rows are
// visible (expansion, filtering) and the tri-state selection.  No DOM here, so it is easy
// to unit-test and fast on trees of thousands of modules.

import { PATCH, type PatchRow, ROW, type Row } from "./rows";

// A row's fields have positions on the wire; they are named in one place, the kernel's
// jupyter_metainit/jupyter/row_schema.py, from which ./rows.ts is generated.
export type { PatchRow, Row };

export interface TreeJSON {
  v: number;
  types: string[];
  nodes: Row[];
}
export const UNCHECKED = 0;
export const CHECKED = 1;
export const PARTIAL = 2;

export interface VisibleRow {
  node: number;
  depth: number;
  /** The node matches the filter (only set while filtering). */
  match: boolean;
}

export class Tree {
  readonly n: number;
  readonly parent: Int32Array;
  readonly depth: Int32Array;
  readonly name: string[] = [];
  readonly qname: string[] = [];
  readonly type: string[] = [];
  readonly info: string[] = [];
  readonly own: Uint8Array;
  readonly repI: Int32Array;
  readonly repN: Int32Array;
  readonly children: number[][] = [];
  readonly index = new Map<string, number>();
  params: Float64Array;
  bytes: Float64Array;
  /** Bytes attributed to the subtree (a tied tensor to its first holder): shares add up. */
  share: Float64Array;
  state: string[] = [];
  dtype: string[] = [];
  /** Device deferred tensors will go to, when not the CPU. */
  target: string[] = [];
  /** Other nodes holding one of this node's own tensors (tied weights). */
  tied: number[][] = [];
  /** "checkpoint" or "mixed" when values come from a file, else "". */
  source: string[] = [];
  /** "fast" / "mixed" when real tensors hold fast-RNG values (not eager's), else "". */
  values: string[] = [];
  /** Lower-cased "qualified name \u0000 type" for filtering. */
  private readonly haystack: string[] = [];

  constructor(json: TreeJSON) {
    const rows = json.nodes;
    const n = (this.n = rows.length);
    this.parent = new Int32Array(n);
    this.depth = new Int32Array(n);
    this.own = new Uint8Array(n);
    this.repI = new Int32Array(n);
    this.repN = new Int32Array(n);
    this.params = new Float64Array(n);
    this.bytes = new Float64Array(n);
    this.share = new Float64Array(n);
    for (let i = 0; i < n; i++) {
      const row = rows[i];
      const p = row[ROW.parent];
      const name = row[ROW.name];
      const bytes = row[ROW.bytes];
      const tied = row[ROW.tied];
      this.parent[i] = p;
      this.depth[i] = p < 0 ? 0 : this.depth[p] + 1;
      this.name.push(name);
      const q = p <= 0 ? name : `${this.qname[p]}.${name}`;
      this.qname.push(p < 0 ? "" : q);
      this.type.push(json.types[row[ROW.type]] ?? "?");
      this.params[i] = row[ROW.params];
      this.bytes[i] = bytes;
      this.state.push(row[ROW.state]);
      this.dtype.push(row[ROW.dtype] ?? "");
      this.share[i] = row[ROW.share_bytes] ?? bytes;
      this.target.push(row[ROW.target] ?? "");
      this.tied.push(Array.isArray(tied) ? tied : []);
      this.source.push(row[ROW.source] ?? "");
      this.values.push(row[ROW.values] ?? "");
      this.repI[i] = row[ROW.rep_i];
      this.repN[i] = row[ROW.rep_n];
      this.info.push(row[ROW.info] ?? "");
      this.own[i] = row[ROW.own] ?? 0;
      this.children.push([]);
      if (p >= 0) this.children[p].push(i);
      this.index.set(this.qname[i], i);
      this.haystack.push(`${this.qname[i]}\u0000${this.type[i]}`.toLowerCase());
    }
  }

  /** Apply the rows the kernel says changed. */
  applyPatch(rows: PatchRow[]): void {
    for (const row of rows) {
      const node = row[PATCH.node];
      if (node < 0 || node >= this.n) continue;
      this.params[node] = row[PATCH.params];
      this.bytes[node] = row[PATCH.bytes];
      this.state[node] = row[PATCH.state];
      const dtype = row[PATCH.dtype];
      const share = row[PATCH.share_bytes];
      const target = row[PATCH.target];
      const source = row[PATCH.source];
      const values = row[PATCH.values];
      if (dtype !== undefined) this.dtype[node] = dtype;
      if (share !== undefined) this.share[node] = share;
      if (target !== undefined) this.target[node] = target;
      if (source !== undefined) this.source[node] = source;
      if (values !== undefined) this.values[node] = values;
    }
  }

  /** Total bytes of the whole model (the root counts tied tensors once). */
  get totalBytes(): number {
    return this.n ? this.bytes[0] : 0;
  }

  /** When node's children are all identical blocks: [count, their type]. */
  repeatedChildren(node: number): [number, string] | null {
    const kids = this.children[node];
    if (kids.length < 2) return null;
    const first = kids[0];
    if (this.repN[first] !== kids.length) return null;
    return [kids.length, this.type[first]];
  }

  /** Whether `count` siblings from `first` on, built identical, still are: same dtype and
   *  size (one cast to bfloat16, say, is not identical to the others any more). */
  stillIdentical(first: number, count: number): boolean {
    const kids = this.children[this.parent[first]] ?? [];
    const at = kids.indexOf(first);
    for (const k of kids.slice(at + 1, at + count)) {
      if (this.dtype[k] !== this.dtype[first] || this.bytes[k] !== this.bytes[first]) return false;
    }
    return true;
  }

  /** Nodes open at first: every node above `depth` that has children. */
  expandedToDepth(depth: number): Set<number> {
    const open = new Set<number>();
    for (let i = 0; i < this.n; i++) {
      if (this.depth[i] < depth && this.children[i].length) open.add(i);
    }
    return open;
  }

  /** Nodes whose qualified name or type contains `query` (case-insensitive). */
  matches(query: string): Uint8Array {
    const q = query.trim().toLowerCase();
    const out = new Uint8Array(this.n);
    if (!q) return out;
    for (let i = 0; i < this.n; i++) {
      if (this.haystack[i].includes(q)) out[i] = 1;
    }
    return out;
  }

  /**
   * The rows to show, in order.  Without a query: every node whose ancestors are all
   * expanded.  With one: the matches and their ancestors (revealed even when collapsed),
   * plus the children of matches the person expanded.
   */
  visibleRows(expanded: Set<number>, query = ""): VisibleRow[] {
    const out: VisibleRow[] = [];
    if (!this.n) return out;
    const q = query.trim();
    if (!q) {
      const stack = [0];
      while (stack.length) {
        const node = stack.pop() as number;
        out.push({ node, depth: this.depth[node], match: false });
        if (expanded.has(node)) {
          const kids = this.children[node];
          for (let k = kids.length - 1; k >= 0; k--) stack.push(kids[k]);
        }
      }
      return out;
    }
    const match = this.matches(q);
    // reveal[i]: i is a match or has a matching descendant
    const reveal = new Uint8Array(this.n);
    for (let i = this.n - 1; i >= 0; i--) {
      if (match[i]) reveal[i] = 1;
      if (reveal[i] && this.parent[i] >= 0) reveal[this.parent[i]] = 1;
    }
    // free[i]: shown because an ancestor match was expanded by the person
    const stack: Array<[number, boolean]> = [[0, false]];
    while (stack.length) {
      const [node, free] = stack.pop() as [number, boolean];
      if (!free && !reveal[node]) continue;
      out.push({ node, depth: this.depth[node], match: match[node] === 1 });
      const kids = this.children[node];
      const openAll = free ? expanded.has(node) : match[node] === 1 && expanded.has(node);
      for (let k = kids.length - 1; k >= 0; k--) stack.push([kids[k], openAll]);
    }
    return out;
  }

  /** CHECKED / PARTIAL / UNCHECKED for every node, given the selected subtree roots. */
  checkStates(selected: Set<number>): Uint8Array {
    const st = new Uint8Array(this.n);
    for (let i = 0; i < this.n; i++) {
      const p = this.parent[i];
      if (selected.has(i) || (p >= 0 && st[p] === CHECKED)) st[i] = CHECKED;
    }
    for (const node of selected) {
      let p = this.parent[node];
      while (p >= 0 && st[p] === UNCHECKED) {
        st[p] = PARTIAL;
        p = this.parent[p];
      }
    }
    return st;
  }

  /**
   * Canonical selection (the same rule as the kernel's): no node inside another selected
   * one, and a tensor-less node whose children are all selected stands for them.
   */
  normalize(nodes: Iterable<number>): number[] {
    const sel = new Set<number>();
    for (const n of nodes) if (n >= 0 && n < this.n) sel.add(n);
    for (const node of [...sel]) {
      for (let p = this.parent[node]; p >= 0; p = this.parent[p]) {
        if (sel.has(p)) {
          sel.delete(node);
          break;
        }
      }
    }
    const parents = new Set<number>();
    for (const n of sel) if (n > 0) parents.add(this.parent[n]);
    const queue = [...parents].sort((a, b) => b - a);
    while (queue.length) {
      const p = queue.shift() as number;
      const kids = this.children[p];
      if (!sel.has(p) && kids.length && !this.own[p] && kids.every((k) => sel.has(k))) {
        for (const k of kids) sel.delete(k);
        sel.add(p);
        if (p > 0 && !queue.includes(this.parent[p])) {
          queue.push(this.parent[p]);
          queue.sort((a, b) => b - a);
        }
      }
    }
    return [...sel].sort((a, b) => a - b);
  }

  /** The selection after clicking node's checkbox. */
  toggle(selected: Set<number>, node: number): number[] {
    const st = this.checkStates(selected);
    const sel = new Set(selected);
    if (st[node] === CHECKED) {
      // find the selected ancestor-or-self and replace it by everything but `node`'s path
      const path: number[] = [];
      let a = node;
      while (!sel.has(a)) {
        path.push(a);
        a = this.parent[a];
      }
      sel.delete(a);
      // walk down from a to node, selecting the siblings of the path
      let cur = a;
      for (let i = path.length - 1; i >= 0; i--) {
        const next = path[i];
        for (const k of this.children[cur]) if (k !== next) sel.add(k);
        cur = next;
      }
      return this.normalize(sel);
    }
    // select node: drop its selected descendants
    for (const s of [...sel]) {
      for (let p = this.parent[s]; p >= 0; p = this.parent[p]) {
        if (p === node) {
          sel.delete(s);
          break;
        }
      }
    }
    sel.add(node);
    return this.normalize(sel);
  }

  namesOf(nodes: Iterable<number>): string[] {
    return [...nodes].map((n) => this.qname[n]);
  }

  nodesOf(names: Iterable<string>): number[] {
    const out: number[] = [];
    for (const name of names) {
      const n = this.index.get(name);
      if (n !== undefined) out.push(n);
    }
    return out;
  }
}
