// GENERATED from jupyter_metainit/jupyter/row_schema.py; do not edit. Regenerate with
// python -m jupyter_metainit.jupyter.row_schema > labextension/src/rows.ts

/** A tree row's fields by position (ModuleTree.to_json). */
export const ROW = {
  parent: 0,
  name: 1,
  type: 2,
  params: 3,
  bytes: 4,
  state: 5,
  rep_i: 6,
  rep_n: 7,
  info: 8,
  own: 9,
  dtype: 10,
  share_bytes: 11,
  target: 12,
  tied: 13,
  source: 14,
  values: 15,
} as const;

export type Row = [
  parent: number,
  name: string,
  type: number,
  params: number,
  bytes: number,
  state: string,
  rep_i: number,
  rep_n: number,
  info: string,
  own: number,
  dtype?: string,
  share_bytes?: number,
  target?: string,
  tied?: number[],
  source?: string,
  values?: string,
];

/** A tree row's fields by name (what rowOf takes). */
export interface RowFields {
  parent: number;
  name: string;
  type: number;
  params: number;
  bytes: number;
  state: string;
  rep_i: number;
  rep_n: number;
  info: string;
  own: number;
  dtype?: string;
  share_bytes?: number;
  target?: string;
  tied?: number[];
  source?: string;
  values?: string;
}

/** A tree row from its fields by name, in the kernel's positions. */
export function rowOf(f: RowFields): Row {
  return [f.parent, f.name, f.type, f.params, f.bytes, f.state, f.rep_i, f.rep_n, f.info, f.own, f.dtype, f.share_bytes, f.target, f.tied, f.source, f.values];
}

/** A patch row (a node whose statistics changed) by position. */
export const PATCH = {
  node: 0,
  params: 1,
  bytes: 2,
  state: 3,
  dtype: 4,
  share_bytes: 5,
  target: 6,
  source: 7,
  values: 8,
} as const;

export type PatchRow = [
  node: number,
  params: number,
  bytes: number,
  state: string,
  dtype?: string,
  share_bytes?: number,
  target?: string,
  source?: string,
  values?: string,
];
