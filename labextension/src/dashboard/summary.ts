/** What the status bar and the sidebar say about a dashboard state: pure, unit-tested. */
import { ICellState, IDashboardState } from './state';

/** "ZeRO-2 · fp32 · mb 8" -> "ZeRO-2": the part the status bar has room for. */
export function shortStrategy(line: string): string {
  return line.split('·')[0].trim();
}

/** Ranks of the running distributed cell that have not finished yet. */
export function busyRanks(state: IDashboardState): number[] {
  if (state.cell?.status === 'running') {
    const running = Object.entries(state.cell.ranks)
      .filter(([, status]) => status === 'running')
      .map(([rank]) => Number(rank));
    if (running.length > 0 || Object.keys(state.cell.ranks).length > 0) {
      return running.sort((a, b) => a - b);
    }
  }
  return (state.cluster?.ranks ?? []).filter(r => r.busy).map(r => r.rank);
}

/**
 * A few words for what the cluster is doing: "idle", "running", "1 rank down". After
 * `%mpnb run train.py` the script is named with its state ("train.py running", "train.py done",
 * "train.py failed", "train.py stopped") until the next distributed cell replaces it.
 */
export function activity(state: IDashboardState): string {
  const cluster = state.cluster;
  if (!cluster) {
    return 'no cluster';
  }
  const dead = cluster.ranks.filter(r => !r.alive).length;
  if (dead > 0) {
    return `${dead} rank${dead === 1 ? '' : 's'} down`;
  }
  const script = state.cell?.label ?? null;
  if (state.cell?.status === 'running') {
    return script ? `${script} running` : 'running';
  }
  if (cluster.ranks.some(r => r.busy)) {
    return 'running';
  }
  return script && state.cell ? `${script} ${state.cell.status}` : 'idle';
}

/** What the sidebar's last-run section shows: a script by its file name, a `%%distributed` cell by its state. */
export interface ILastRun {
  heading: string;
  /** The script's file name, or null for a cell (whose row shows its state alone). */
  label: string | null;
  /** Hover text: "train.py on ranks 0, 1: running". */
  title: string;
}

export function lastRun(cell: ICellState): ILastRun {
  const ranks = Object.keys(cell.ranks)
    .map(Number)
    .sort((a, b) => a - b);
  const on = ranks.length ? ` on rank${ranks.length === 1 ? '' : 's'} ${ranks.join(', ')}` : '';
  return {
    heading: cell.label ? 'Last script' : 'Last distributed cell',
    label: cell.label,
    title: `${cell.label ?? 'cell'}${on}: ${cell.status}`
  };
}

/**
 * The status bar text, e.g. "mpnb · 2 ranks · ZeRO-2 · running"; null hides
 * the item (mpnb is not loaded in this kernel, or there is no kernel).
 */
export function statusText(state: IDashboardState): string | null {
  if (state.connection !== 'connected') {
    return null;
  }
  if (!state.cluster) {
    return 'mpnb · no cluster';
  }
  const n = state.cluster.world_size || state.cluster.ranks.length;
  const parts = ['mpnb', `${n} rank${n === 1 ? '' : 's'}`];
  const strategy = shortStrategy(state.strategy);
  if (strategy) {
    parts.push(strategy);
  }
  parts.push(activity(state));
  return parts.join(' · ');
}
