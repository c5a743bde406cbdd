import { describe, expect, it } from 'vitest';

import { gather, minMaxIndices } from '../src/chart/decimate';

describe('minMaxIndices', () => {
  it('keeps everything when there are few points', () => {
    expect(Array.from(minMaxIndices([0, 1, 2], [5, 6, 7], 10))).toEqual([0, 1, 2]);
  });

  it('bounds the output and keeps first, last and every spike', () => {
    const n = 6000;
    const t = Float64Array.from({ length: n }, (_, i) => i / 10);
    const y = Float64Array.from({ length: n }, (_, i) => Math.sin(i / 50));
    y[1234] = 100; // a spike
    y[4321] = -100; // a dip
    const idx = minMaxIndices(t, y, 200);
    expect(idx.length).toBeLessThanOrEqual(2 * 200 + 2);
    expect(idx[0]).toBe(0);
    expect(idx[idx.length - 1]).toBe(n - 1);
    const kept = Array.from(idx);
    expect(kept).toContain(1234);
    expect(kept).toContain(4321);
    for (let k = 1; k < idx.length; k++) {
      expect(idx[k]).toBeGreaterThan(idx[k - 1]);
    }
    // max and min of the decimated series equal those of the full series
    const ys = gather(y, idx);
    expect(Math.max(...ys)).toBe(100);
    expect(Math.min(...ys)).toBe(-100);
  });

  it('buckets by time, so a dense burst does not crowd out a sparse stretch', () => {
    // 100 points at 1 Hz, then 5000 points at 100 Hz
    const t: number[] = [];
    for (let i = 0; i < 100; i++) {
      t.push(i);
    }
    for (let i = 0; i < 5000; i++) {
      t.push(100 + i / 100);
    }
    const y = t.map(v => v % 7);
    const idx = Array.from(minMaxIndices(t, y, 50));
    const sparse = idx.filter(i => i < 100).length;
    const dense = idx.filter(i => i >= 100).length;
    // the sparse first 100 s are two thirds of the time axis: most buckets belong to them
    expect(sparse).toBeGreaterThan(dense);
  });
});
