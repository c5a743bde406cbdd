import { describe, expect, it } from 'vitest';

import { IMemorySample, MAX_RATE_HZ, MemoryHistory, TOP } from '../src/chart/history';

const MiB = 1024 * 1024;

function sample(rank: number, t: number, extra: Partial<IMemorySample> = {}): IMemorySample {
  return {
    rank,
    t,
    busy: true,
    device_kind: 'cuda',
    used: 500 * MiB,
    peak: 600 * MiB,
    capacity: 8192 * MiB,
    parameters: 100 * MiB,
    gradients: 100 * MiB,
    optimizer: 200 * MiB,
    other: 100 * MiB,
    ...extra
  };
}

describe('MemoryHistory', () => {
  it('keeps samples per rank and stacks categories bottom to top', () => {
    const h = new MemoryHistory(60);
    expect(h.add([sample(1, 10), sample(0, 10), sample(0, 11, { gradients: 0 })])).toBe(3);
    expect(h.ranks()).toEqual([0, 1]);
    expect(h.ranks([3])).toEqual([0, 1, 3]);
    const s = h.series(0, 100);
    expect(Array.from(s.t)).toEqual([0, 1]); // seconds since the first sample
    expect(Array.from(s.stacked[0])).toEqual([100 * MiB, 100 * MiB]);
    expect(Array.from(s.stacked[1])).toEqual([200 * MiB, 100 * MiB]);
    expect(Array.from(s.stacked[TOP])).toEqual([500 * MiB, 400 * MiB]);
    expect(s.windowPeak).toEqual({ t: 0, value: 500 * MiB });
    expect(s.values.gradients[1]).toBe(0);
    expect(s.capacity).toBe(8192 * MiB);
    expect(s.deviceKind).toBe('cuda');
    expect(s.busy).toBe(true);
  });

  it('derives "other" from CUDA-allocated bytes when a sample lacks it, and drops duplicates', () => {
    const h = new MemoryHistory(60);
    const s = sample(0, 5);
    delete s.other;
    h.add([s, sample(0, 5), sample(0, 4)]);
    expect(h.length(0)).toBe(1);
    expect(h.series(0, 10).values.other[0]).toBe(100 * MiB);
  });

  it('forgets samples older than history_seconds relative to the newest', () => {
    const h = new MemoryHistory(10);
    const samples: IMemorySample[] = [];
    for (let i = 0; i < 300; i++) {
      samples.push(sample(0, i / 10), sample(1, i / 10));
    }
    h.add(samples);
    // newest t = 29.9, keep t >= 19.9; the axis still counts from the first sample (t = 0)
    expect(h.series(0, 1000).t[0]).toBeCloseTo(19.9, 6);
    expect(h.length(0)).toBe(101);
    h.historySeconds = 2;
    expect(h.length(1)).toBe(21);
    expect(() => (h.historySeconds = 0)).toThrow(/history_seconds/);
  });

  it('holds 8 ranks x 10 Hz x 10 min and decimates what it draws', () => {
    const h = new MemoryHistory(600);
    const samples: IMemorySample[] = [];
    for (let i = 0; i < 6000; i++) {
      for (let r = 0; r < 8; r++) {
        samples.push(sample(r, 1000 + i / 10, { gradients: (i % 97) * MiB }));
      }
    }
    expect(h.add(samples)).toBe(48000);
    for (let r = 0; r < 8; r++) {
      expect(h.length(r)).toBe(6000);
    }
    const s = h.series(3, 300);
    expect(s.rawLength).toBe(6000);
    expect(s.t.length).toBeLessThanOrEqual(602);
    expect(s.windowPeak?.value).toBe(496 * MiB);
    expect(Math.max(...s.stacked[TOP])).toBe(496 * MiB);
    // the buffer is sized for faster sampling too
    expect(600 * MAX_RATE_HZ).toBeGreaterThan(6000);
  });

  it('notifies listeners, takes estimates with string keys, and resets', () => {
    const h = new MemoryHistory(60);
    let calls = 0;
    const off = h.subscribe(() => calls++);
    h.add([sample(0, 1)]);
    h.setEstimate({ '0': 123, '1': 456, bad: 1 });
    expect(h.estimate(1)).toBe(456);
    expect(h.series(0, 10).estimate).toBe(123);
    h.capacity = 42;
    expect(h.series(0, 10).capacity).toBe(42);
    const v = h.version;
    h.reset();
    expect(h.version).toBeGreaterThan(v);
    expect(h.ranks()).toEqual([]);
    off();
    h.add([sample(0, 2)]);
    expect(calls).toBe(4);
  });
});
