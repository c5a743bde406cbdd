import { describe, expect, it } from 'vitest';

import { formatElapsed } from '../src/chart/format';
import { CATEGORIES, IMemorySample, MemoryHistory, TOP } from '../src/chart/history';
import { HEADROOM, scalesOf } from '../src/chart/scale';

const KiB = 1024;
const MiB = 1024 * KiB;

/** A CPU rank training a ~235 K-parameter model: a few MiB of tensors under ~400 MiB of RSS. */
function cpuSample(t: number, extra: Partial<IMemorySample> = {}): IMemorySample {
  return {
    rank: 0,
    t,
    busy: true,
    device_kind: 'cpu',
    used: 400 * MiB,
    peak: 410 * MiB,
    capacity: 24 * 1024 * MiB,
    parameters: 920 * KiB,
    gradients: 920 * KiB,
    optimizer: 1840 * KiB,
    activations: 4 * MiB,
    other: 0,
    ...extra
  };
}

describe('the chart on CPU', () => {
  it('stacks the tensor categories and keeps the process RSS apart', () => {
    const h = new MemoryHistory(60);
    h.add([cpuSample(100), cpuSample(100.1, { other: 390 * MiB, used: 401 * MiB })]);
    const s = h.series(0, 100);
    // RSS is never stacked as "other" on CPU, even from an older engine that sent it so
    expect(Array.from(s.values.other)).toEqual([0, 0]);
    expect(s.stacked[TOP][1]).toBe(920 * KiB + 920 * KiB + 1840 * KiB + 4 * MiB);
    expect(Array.from(s.usedRows)).toEqual([400 * MiB, 401 * MiB]);
  });

  it('zooms the left axis to the categories and the estimate, RSS on its own axis', () => {
    const h = new MemoryHistory(60);
    h.add([cpuSample(1), cpuSample(2)]);
    h.setEstimate({ '0': 9 * MiB });
    const scales = scalesOf(h.series(0, 100));
    expect(scales.yMax).toBeCloseTo(9 * MiB * HEADROOM);
    expect(scales.yMax).toBeLessThan(10 * MiB); // not 400 MiB: parameters stay visible
    expect(scales.rssMax).toBeCloseTo(400 * MiB * HEADROOM);
    expect(scales.capacityShown).toBe(false); // the machine's RAM would flatten the chart
  });

  it('hides categories: they add nothing to the stack and the axis zooms to the rest', () => {
    const h = new MemoryHistory(60);
    h.add([cpuSample(1)]);
    const hidden = new Set(['activations', 'optimizer'] as const);
    const s = h.series(0, 100, hidden);
    const ai = CATEGORIES.indexOf('activations');
    expect(s.stacked[ai][0]).toBe(s.stacked[CATEGORIES.indexOf('gradients')][0]); // neither optimizer nor activations
    expect(s.stacked[TOP][0]).toBe(2 * 920 * KiB);
    expect(s.values.activations[0]).toBe(4 * MiB); // the readout still knows the value
    expect(s.windowPeak?.value).toBe(2 * 920 * KiB);
    expect(scalesOf(s).yMax).toBeCloseTo(2 * 920 * KiB * HEADROOM);
    expect(scalesOf(h.series(0, 100)).yMax).toBeCloseTo(((920 * 2 + 1840) * KiB + 4 * MiB) * HEADROOM);
  });

  it('on a GPU stacks "other" (allocated beyond the categories) and draws no RSS axis', () => {
    const h = new MemoryHistory(60);
    h.add([cpuSample(1, { device_kind: 'cuda', other: 90 * MiB, used: 100 * MiB, capacity: 200 * MiB })]);
    const s = h.series(0, 10);
    expect(s.values.other[0]).toBe(90 * MiB);
    const scales = scalesOf(s);
    expect(scales.rssMax).toBe(0);
    expect(scales.capacityShown).toBe(true);
    expect(scales.yMax).toBeCloseTo(200 * MiB * HEADROOM);
  });
});

describe('the time axis', () => {
  it('counts seconds from the cell start, else from the first sample', () => {
    const h = new MemoryHistory(60);
    h.add([cpuSample(1000.5), cpuSample(1001.5)]);
    expect(Array.from(h.series(0, 10).t)).toEqual([0, 1]);
    h.origin = 1000; // the widget's t0: when the cell started
    const s = h.series(0, 10);
    expect(Array.from(s.t)).toEqual([0.5, 1.5]);
    expect(s.windowPeak?.t).toBe(0.5);
    h.origin = 0;
    h.reset();
    h.add([cpuSample(2000)]);
    expect(h.series(0, 10).t[0]).toBe(0);
    expect(h.origin).toBe(2000);
  });

  it('labels elapsed seconds, not the wall clock', () => {
    expect(formatElapsed(0)).toBe('0 s');
    expect(formatElapsed(45.4)).toBe('45 s');
    expect(formatElapsed(90)).toBe('1:30');
    expect(formatElapsed(3723)).toBe('1:02:03');
  });
});
