import { describe, expect, it } from 'vitest';

import { formatClock } from '../src/chart/format';
import { baseName, checkpointRows } from '../src/dashboard/checkpoints';
import { INITIAL_STATE, ICheckpoint, reduce } from '../src/dashboard/state';

const T = 1_760_000_000;

function checkpoint(path: string, t: number, extra: Partial<ICheckpoint> = {}): ICheckpoint {
  return {
    path,
    step: 40,
    strategy: 'zero',
    label: 'ZeRO-2',
    worldSize: 2,
    bytes: 3 * 1024 ** 2 + 200 * 1024,
    seconds: 0.314,
    t,
    ...extra
  };
}

describe('checkpointRows', () => {
  it('says what the sidebar shows for each checkpoint, newest first', () => {
    const rows = checkpointRows([
      checkpoint('/runs/a/step-20', T, { step: 20 }),
      checkpoint('/runs/a/step-40/', T + 60, { label: 'FSDP', strategy: 'fsdp', worldSize: 4, seconds: null }),
      checkpoint('/runs/b/step-40', T)
    ]);
    expect(rows.map(r => r.name)).toEqual(['step-40', 'step-40', 'step-20']);
    expect(rows.map(r => r.path)).toEqual(['/runs/a/step-40/', '/runs/b/step-40', '/runs/a/step-20']);
    const [fsdp, zero] = rows;
    expect(fsdp.layout).toBe('FSDP × 4');
    expect(fsdp.layoutTitle).toBe('written under FSDP by 4 ranks');
    expect(fsdp.savedTitle).not.toContain(' in ');
    expect(zero).toMatchObject({ step: '40', layout: 'ZeRO-2 × 2', size: '3.20 MiB' });
    expect(zero.saved).toBe(formatClock(T));
    expect(zero.savedTitle).toMatch(/ in 0\.31 s$/);
    expect(zero.sizeTitle).toBe("3,350,528 bytes on disk, all ranks' files");
  });

  it('names the strategy by its plain name when the kernel had no label, and one rank as such', () => {
    const [row] = checkpointRows([checkpoint('ckpt', T, { label: '', strategy: 'local', worldSize: 1 })]);
    expect(row.layout).toBe('local × 1');
    expect(row.layoutTitle).toBe('written under local by 1 rank');
    expect(row.name).toBe('ckpt');
  });

  it('is empty for no checkpoints (the section then shows its empty state)', () => {
    expect(checkpointRows([])).toEqual([]);
  });
});

describe('baseName', () => {
  it('keeps the last path part, trailing separators and Windows paths included', () => {
    expect(baseName('/a/b/step-4')).toBe('step-4');
    expect(baseName('/a/b/step-4//')).toBe('step-4');
    expect(baseName('C:\\runs\\step-4')).toBe('step-4');
    expect(baseName('/')).toBe('/');
  });
});

describe('checkpoints in the state message', () => {
  it('are parsed from the kernel record, and a record with a bad field is left out', () => {
    const record = {
      path: '/runs/step-4',
      step: 4,
      strategy: 'zero',
      label: 'ZeRO-3',
      world_size: 2,
      bytes: 10,
      seconds: 0.5,
      t: T
    };
    const s = reduce(INITIAL_STATE, {
      type: 'state',
      cluster: null,
      checkpoints: [record, { ...record, step: 'x' }, { ...record, path: '' }, null, { ...record, seconds: null }]
    });
    expect(s.checkpoints).toEqual([
      { path: '/runs/step-4', step: 4, strategy: 'zero', label: 'ZeRO-3', worldSize: 2, bytes: 10, seconds: 0.5, t: T },
      { path: '/runs/step-4', step: 4, strategy: 'zero', label: 'ZeRO-3', worldSize: 2, bytes: 10, seconds: null, t: T }
    ]);
    expect(reduce(INITIAL_STATE, { type: 'state' }).checkpoints).toEqual([]);
    expect(reduce(s, { type: 'no-kernel' }).checkpoints).toEqual([]);
  });
});
