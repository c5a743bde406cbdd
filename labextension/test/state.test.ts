import { describe, expect, it } from 'vitest';

import { INITIAL_STATE, reduce } from '../src/dashboard/state';
import { activity, busyRanks, lastRun, shortStrategy, statusText } from '../src/dashboard/summary';

const stateMessage = {
  type: 'state' as const,
  cluster: {
    ranks: [
      { rank: 1, host: 'h', pid: 11, device: 'cpu', alive: true, busy: false },
      { rank: 0, host: 'h', pid: 10, device: 'cpu', alive: true, busy: false }
    ],
    backend: 'gloo',
    world_size: 2
  },
  strategy: 'ZeRO-2 · fp32 · mb 8',
  cell: null
};

describe('reduce', () => {
  it('parses a state message, sorting ranks', () => {
    const s = reduce(INITIAL_STATE, stateMessage);
    expect(s.connection).toBe('connected');
    expect(s.cluster?.ranks.map(r => r.rank)).toEqual([0, 1]);
    expect(s.cluster?.backend).toBe('gloo');
    expect(s.strategy).toBe('ZeRO-2 · fp32 · mb 8');
    expect(s.cell).toBeNull();
  });

  it('tolerates malformed fields instead of breaking the sidebar', () => {
    const s = reduce(INITIAL_STATE, {
      type: 'state',
      cluster: { ranks: [null, { rank: 'x' }, { rank: 2 }] },
      strategy: 5,
      cell: { status: 'bogus' },
      estimate: { '0': 'a', '1': 7 }
    });
    expect(s.cluster?.ranks.map(r => r.rank)).toEqual([2]);
    expect(s.cluster?.world_size).toBe(1);
    expect(s.strategy).toBe('');
    expect(s.cell).toBeNull();
    expect(s.estimate).toEqual({ '1': 7 });
  });

  it('updates busy flags from samples, keeping identity when nothing changed', () => {
    const s = reduce(INITIAL_STATE, stateMessage);
    const same = reduce(s, { type: 'samples', samples: [{ rank: 0, t: 1, used: 1, busy: false }] });
    expect(same).toBe(s);
    const busy = reduce(s, {
      type: 'samples',
      samples: [
        { rank: 0, t: 2, used: 1, busy: true },
        { rank: 0, t: 1, used: 1, busy: false }
      ]
    });
    expect(busy.cluster?.ranks[0].busy).toBe(true);
    expect(busy.cluster?.ranks[1].busy).toBe(false);
  });

  it('resets on connection events', () => {
    const s = reduce(INITIAL_STATE, stateMessage);
    expect(reduce(s, { type: 'unavailable' })).toEqual({ ...INITIAL_STATE, connection: 'unavailable' });
    expect(reduce(s, { type: 'no-kernel' }).cluster).toBeNull();
  });
});

describe('status text', () => {
  it('reads "mpnb · 2 ranks · ZeRO-2 · idle/running"', () => {
    const s = reduce(INITIAL_STATE, stateMessage);
    expect(statusText(s)).toBe('mpnb · 2 ranks · ZeRO-2 · idle');
    const running = reduce(s, {
      ...stateMessage,
      cell: { id: 'c1', notebook_cell_id: 'abc', status: 'running', ranks: { '0': 'running', '1': 'done' } }
    });
    expect(running.cell?.notebookCellId).toBe('abc');
    expect(statusText(running)).toBe('mpnb · 2 ranks · ZeRO-2 · running');
    expect(busyRanks(running)).toEqual([0]);
  });

  it('is hidden without mpnb, says so without a cluster, and reports dead ranks', () => {
    expect(statusText(INITIAL_STATE)).toBeNull();
    expect(statusText(reduce(INITIAL_STATE, { type: 'unavailable' }))).toBeNull();
    expect(statusText(reduce(INITIAL_STATE, { type: 'state', cluster: null }))).toBe('mpnb · no cluster');
    const one = reduce(INITIAL_STATE, {
      type: 'state',
      cluster: { ranks: [{ rank: 0, alive: false }], backend: 'gloo', world_size: 1 },
      strategy: 'DDP · fp32'
    });
    expect(statusText(one)).toBe('mpnb · 1 rank · DDP · 1 rank down');
    expect(activity(one)).toBe('1 rank down');
  });

  it('falls back to busy ranks when no cell is running', () => {
    const s = reduce(INITIAL_STATE, stateMessage);
    const b = reduce(s, { type: 'samples', samples: [{ rank: 1, t: 1, used: 1, busy: true }] });
    expect(busyRanks(b)).toEqual([1]);
    expect(activity(b)).toBe('running');
    expect(shortStrategy('FSDP · bf16')).toBe('FSDP');
    expect(shortStrategy('')).toBe('');
  });
});

describe('a script run with %mpnb run', () => {
  const script = (status: string, ranks: Record<string, string>, label: unknown = 'train.py') =>
    reduce(reduce(INITIAL_STATE, stateMessage), {
      ...stateMessage,
      cell: { id: 'c2', notebook_cell_id: 'nb', status, ranks, label }
    });

  it('names the script with its state in the status bar, where a cell says running/idle', () => {
    const running = script('running', { '0': 'running', '1': 'running' });
    expect(running.cell?.label).toBe('train.py');
    expect(statusText(running)).toBe('mpnb · 2 ranks · ZeRO-2 · train.py running');
    expect(busyRanks(running)).toEqual([0, 1]);
    expect(statusText(script('done', { '0': 'done', '1': 'done' }))).toBe('mpnb · 2 ranks · ZeRO-2 · train.py done');
    expect(activity(script('failed', { '0': 'failed', '1': 'stopped' }))).toBe('train.py failed');
    expect(activity(script('stopped', { '0': 'stopped', '1': 'stopped' }))).toBe('train.py stopped');
    // A finished cell without a label reads as before.
    const cell = script('done', { '0': 'done', '1': 'done' }, null);
    expect(cell.cell?.label).toBeNull();
    expect(statusText(cell)).toBe('mpnb · 2 ranks · ZeRO-2 · idle');
  });

  it('lets dead ranks and busy ranks speak first', () => {
    const s = script('done', { '0': 'done', '1': 'done' });
    const busy = reduce(s, { type: 'samples', samples: [{ rank: 1, t: 1, used: 1, busy: true }] });
    expect(activity(busy)).toBe('running');
    const down = reduce(INITIAL_STATE, {
      ...stateMessage,
      cluster: { ...stateMessage.cluster, ranks: [{ rank: 0, alive: false }, { rank: 1 }] },
      cell: { id: 'c2', status: 'failed', ranks: { '0': 'failed', '1': 'failed' }, label: 'train.py' }
    });
    expect(activity(down)).toBe('1 rank down');
  });

  it('gives the sidebar row a heading, the file name and a hover text; cells keep theirs', () => {
    const s = script('running', { '1': 'done', '0': 'running' });
    expect(lastRun(s.cell!)).toEqual({
      heading: 'Last script',
      label: 'train.py',
      title: 'train.py on ranks 0, 1: running'
    });
    const cell = script('failed', { '0': 'failed' }, null);
    expect(lastRun(cell.cell!)).toEqual({ heading: 'Last distributed cell', label: null, title: 'cell on rank 0: failed' });
  });

  it('ignores a label that is not a name and cuts a long one', () => {
    expect(script('running', { '0': 'running' }, 42).cell?.label).toBeNull();
    expect(script('running', { '0': 'running' }, '  \n ').cell?.label).toBeNull();
    expect(script('running', { '0': 'running' }, 'my\ntrain.py').cell?.label).toBe('my train.py');
    const long = script('running', { '0': 'running' }, 'x'.repeat(200)).cell?.label ?? '';
    expect(long).toHaveLength(60);
    expect(long.endsWith('…')).toBe(true);
  });
});
