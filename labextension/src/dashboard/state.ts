/**
 * The dashboard's view of one kernel: what the `mpnb.dashboard` comm said
 * last, folded by a pure reducer so the sidebar, the status bar and the cell
 * markers agree and the logic is unit-tested without a browser.
 */
import type { IMemorySample } from '../chart/history';

export type RankCellStatus = 'running' | 'done' | 'failed' | 'stopped';

export interface IRankState {
  rank: number;
  host: string;
  pid: number | null;
  device: string;
  alive: boolean;
  busy: boolean;
}

export interface IClusterState {
  ranks: IRankState[];
  backend: string;
  world_size: number;
}

export interface ICellState {
  id: string | null;
  /** The Jupyter cell id of the notebook cell that ran it (added by the kernel when known). */
  notebookCellId: string | null;
  status: RankCellStatus;
  ranks: Record<string, RankCellStatus>;
  /** What ran, when it was not a cell: a script's file name ("train.py") for `%mpnb run`; else null. */
  label: string | null;
}

/**
 * connecting: comm opened, no answer yet. connected: the kernel answered.
 * unavailable: the kernel closed the comm at once (mpnb is not loaded there).
 * no-kernel: the notebook has no running kernel.
 */
export type ConnectionStatus = 'no-kernel' | 'connecting' | 'connected' | 'unavailable';

/** A checkpoint `trainer.save(path)` wrote in this session (the kernel's `MemoryStore.checkpoints()`). */
export interface ICheckpoint {
  /** The directory on the engines' host, absolute. */
  path: string;
  step: number;
  /** The trainer's strategy ("zero") and how the status bar names it ("ZeRO-2"). */
  strategy: string;
  label: string;
  worldSize: number;
  /** All ranks' files together. */
  bytes: number;
  /** How long the save took, when known. */
  seconds: number | null;
  /** Unix seconds when it finished. */
  t: number;
}

export interface IDashboardState {
  connection: ConnectionStatus;
  cluster: IClusterState | null;
  strategy: string;
  cell: ICellState | null;
  estimate: Record<string, number>;
  /** Oldest first, one per path, as the kernel sent them. */
  checkpoints: ICheckpoint[];
}

export const INITIAL_STATE: IDashboardState = {
  connection: 'no-kernel',
  cluster: null,
  strategy: '',
  cell: null,
  estimate: {},
  checkpoints: []
};

/** Everything that changes the state: comm messages plus connection events. */
export type DashboardEvent =
  | {
      type: 'state';
      cluster?: unknown;
      strategy?: unknown;
      cell?: unknown;
      estimate?: unknown;
      checkpoints?: unknown;
    }
  | { type: 'samples'; samples: IMemorySample[] }
  | { type: 'connecting' }
  | { type: 'unavailable' }
  | { type: 'no-kernel' };

export function reduce(state: IDashboardState, event: DashboardEvent): IDashboardState {
  switch (event.type) {
    case 'state':
      return {
        connection: 'connected',
        cluster: parseCluster(event.cluster),
        strategy: typeof event.strategy === 'string' ? event.strategy : '',
        cell: parseCell(event.cell),
        estimate: parseEstimate(event.estimate),
        checkpoints: parseCheckpoints(event.checkpoints)
      };
    case 'samples':
      return applySamples(state, event.samples);
    case 'connecting':
      return { ...INITIAL_STATE, connection: 'connecting' };
    case 'unavailable':
      return { ...INITIAL_STATE, connection: 'unavailable' };
    case 'no-kernel':
      return { ...INITIAL_STATE };
    default:
      return state;
  }
}

/** Samples carry each rank's `busy` flag more often than `state` messages do. */
function applySamples(state: IDashboardState, samples: IMemorySample[]): IDashboardState {
  if (!state.cluster || !Array.isArray(samples) || samples.length === 0) {
    return state;
  }
  const busy = new Map<number, { t: number; busy: boolean }>();
  for (const s of samples) {
    const seen = busy.get(s.rank);
    if (typeof s.busy === 'boolean' && (!seen || s.t >= seen.t)) {
      busy.set(s.rank, { t: s.t, busy: s.busy });
    }
  }
  let changed = false;
  const ranks = state.cluster.ranks.map(r => {
    const b = busy.get(r.rank);
    if (b && b.busy !== r.busy) {
      changed = true;
      return { ...r, busy: b.busy };
    }
    return r;
  });
  return changed ? { ...state, cluster: { ...state.cluster, ranks } } : state;
}

function parseCluster(value: unknown): IClusterState | null {
  if (!value || typeof value !== 'object') {
    return null;
  }
  const v = value as Record<string, unknown>;
  const ranks = Array.isArray(v.ranks) ? v.ranks : [];
  const parsed: IRankState[] = ranks
    .filter((r): r is Record<string, unknown> => !!r && typeof r === 'object')
    .map(r => ({
      rank: Number(r.rank),
      host: String(r.host ?? ''),
      pid: typeof r.pid === 'number' ? r.pid : null,
      device: String(r.device ?? ''),
      alive: r.alive !== false,
      busy: r.busy === true
    }))
    .filter(r => Number.isFinite(r.rank))
    .sort((a, b) => a.rank - b.rank);
  return {
    ranks: parsed,
    backend: String(v.backend ?? ''),
    world_size: typeof v.world_size === 'number' ? v.world_size : parsed.length
  };
}

const CELL_STATUSES: RankCellStatus[] = ['running', 'done', 'failed', 'stopped'];

function isCellStatus(value: unknown): value is RankCellStatus {
  return CELL_STATUSES.includes(value as RankCellStatus);
}

function parseCell(value: unknown): ICellState | null {
  if (!value || typeof value !== 'object') {
    return null;
  }
  const v = value as Record<string, unknown>;
  if (!isCellStatus(v.status)) {
    return null;
  }
  const ranks: Record<string, RankCellStatus> = {};
  if (v.ranks && typeof v.ranks === 'object') {
    for (const [rank, status] of Object.entries(v.ranks as Record<string, unknown>)) {
      if (isCellStatus(status)) {
        ranks[rank] = status;
      }
    }
  }
  const str = (x: unknown): string | null => (x === null || x === undefined ? null : String(x));
  return {
    id: str(v.id),
    notebookCellId: str(v.notebook_cell_id),
    status: v.status,
    ranks,
    label: parseLabel(v.label)
  };
}

// A file name fits; anything longer is cut so the status bar keeps its other items in view.
const MAX_LABEL = 60;

function parseLabel(value: unknown): string | null {
  if (typeof value !== 'string') {
    return null;
  }
  const label = value.replace(/\s+/g, ' ').trim();
  if (!label) {
    return null;
  }
  return label.length > MAX_LABEL ? `${label.slice(0, MAX_LABEL - 1)}…` : label;
}

function parseEstimate(value: unknown): Record<string, number> {
  const out: Record<string, number> = {};
  if (value && typeof value === 'object') {
    for (const [rank, bytes] of Object.entries(value as Record<string, unknown>)) {
      if (typeof bytes === 'number' && Number.isFinite(bytes)) {
        out[rank] = bytes;
      }
    }
  }
  return out;
}

/** The kernel's checkpoint records; an entry with a missing or odd field is left out, not shown half. */
function parseCheckpoints(value: unknown): ICheckpoint[] {
  if (!Array.isArray(value)) {
    return [];
  }
  const num = (x: unknown): x is number => typeof x === 'number' && Number.isFinite(x);
  const out: ICheckpoint[] = [];
  for (const item of value) {
    if (!item || typeof item !== 'object') {
      continue;
    }
    const c = item as Record<string, unknown>;
    if (typeof c.path !== 'string' || !c.path || !num(c.step) || !num(c.world_size) || !num(c.bytes) || !num(c.t)) {
      continue;
    }
    const strategy = typeof c.strategy === 'string' ? c.strategy : '';
    out.push({
      path: c.path,
      step: c.step,
      strategy,
      label: typeof c.label === 'string' && c.label ? c.label : strategy,
      worldSize: c.world_size,
      bytes: c.bytes,
      seconds: num(c.seconds) ? c.seconds : null,
      t: c.t
    });
  }
  return out;
}
