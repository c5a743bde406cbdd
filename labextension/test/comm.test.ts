import { afterEach, describe, expect, it, vi } from 'vitest';

import { IMemorySample, MemoryHistory } from '../src/chart/history';
import { formatRate, rateTick, stepData } from '../src/chart/plotoptions';
import { MIN_SENT_TOP, HEADROOM, sentMax } from '../src/chart/scale';

const KiB = 1024;
const MiB = 1024 * KiB;

function sample(t: number, comm_sent?: number | null, extra: Partial<IMemorySample> = {}): IMemorySample {
  return { rank: 0, t, busy: true, device_kind: 'cpu', used: 400 * MiB, parameters: MiB, comm_sent, ...extra };
}

function historyOf(points: [number, number | null | undefined][]): MemoryHistory {
  const h = new MemoryHistory(600);
  h.add(points.map(([t, sent]) => sample(t, sent)));
  return h;
}

describe('bytes sent per second', () => {
  it('is the average rate over each interval between drawn rows, none at the first', () => {
    const s = historyOf([[0, 0], [1, 1000], [2, 3000]]).series(0, 100);
    expect(Array.from(s.sentRate)).toEqual([NaN, 1000, 2000]);
    expect(s.sentMeasured).toBe(true);
  });

  it('keeps the bytes when decimating: the area under the steps is what was sent', () => {
    const h = new MemoryHistory(600);
    const samples: IMemorySample[] = [];
    let sent = 5000;
    for (let i = 0; i < 6000; i++) {
      // bursts of traffic at irregular times, memory that wiggles so min/max picks odd rows
      sent += (i % 37 < 5 ? 300 * KiB : 120) + (i % 11) * 7;
      samples.push(sample(1000 + i / 10 + (i % 3) * 0.01, sent, { gradients: ((i * 7919) % 101) * KiB }));
    }
    h.add(samples);
    const s = h.series(0, 150);
    expect(s.rawLength).toBe(6000);
    expect(s.t.length).toBeLessThan(400); // decimated
    let bytes = 0;
    for (let k = 1; k < s.t.length; k++) {
      bytes += s.sentRate[k] * (s.t[k] - s.t[k - 1]);
    }
    const first = samples[0].comm_sent as number;
    expect(bytes / (sent - first)).toBeCloseTo(1, 9);
  });

  it('has no rate where the counter went down (a restarted engine) or is missing', () => {
    const s = historyOf([[0, 0], [1, 5000], [2, 100], [3, 600], [4, null], [5, 900], [6, 1900], [7, undefined]]).series(
      0,
      100
    );
    expect(Array.from(s.sentRate)).toEqual([NaN, 5000, NaN, 500, NaN, NaN, 1000, NaN]);
    for (const v of s.sentRate) {
      expect(v < 0).toBe(false);
    }
    expect(s.sentMeasured).toBe(true);
    expect(s.sentNow).toBeNull(); // the newest sample has no count
  });

  it('has no rate for a drawn interval that hides a restart, even when it ends higher', () => {
    const h = new MemoryHistory(600);
    const samples: IMemorySample[] = [];
    for (let i = 0; i < 1000; i++) {
      // the engine restarts at row 500; after it the counter passes its old value
      samples.push(sample(i / 10, i < 500 ? i * 100 : (i - 500) * 1000));
    }
    h.add(samples);
    const s = h.series(0, 10); // ~20 rows drawn: the restart falls inside one interval
    const restart = 50; // seconds
    let spanned = 0;
    for (let k = 1; k < s.t.length; k++) {
      const spansRestart = s.t[k - 1] < restart && s.t[k] >= restart;
      spanned += spansRestart ? 1 : 0;
      expect(Number.isNaN(s.sentRate[k])).toBe(spansRestart);
    }
    expect(spanned).toBe(1);
  });

  it('is not measured without comm_sent (CUDA ranks, before a process group)', () => {
    const s = historyOf([[0, undefined], [1, null], [2, undefined]]).series(0, 100);
    expect(s.sentMeasured).toBe(false);
    expect(s.sentNow).toBeNull();
    expect(Array.from(s.sentRate).every(Number.isNaN)).toBe(true);
    const none = new MemoryHistory(60).series(3, 100);
    expect(none.sentMeasured).toBe(false);
    expect(none.sentNow).toBeNull();
    expect(none.sentRate.length).toBe(0);
  });

  it('now: the average over the newest second', () => {
    // 10 Hz: 0..3 s at 1000 B/s, then 4000 B/s
    const points: [number, number][] = [];
    let sent = 0;
    for (let i = 0; i <= 50; i++) {
      points.push([i / 10, sent]);
      sent += i < 30 ? 100 : 400;
    }
    expect(historyOf(points).series(0, 100).sentNow).toBeCloseTo(4000, 6);
    // 1 Hz (idle): the last interval, even when a little over a second
    expect(historyOf([[0, 0], [1.02, 102], [2.05, 205]]).series(0, 100).sentNow).toBeCloseTo(100, 6);
    // only one sample, or the counter restarted just now: no rate
    expect(historyOf([[0, 10]]).series(0, 100).sentNow).toBeNull();
    expect(historyOf([[0, 900], [1, 10]]).series(0, 100).sentNow).toBeNull();
    // a restart within the second: the rate since it
    expect(historyOf([[0, 0], [0.5, 9000], [0.7, 0], [1, 300]]).series(0, 100).sentNow).toBeCloseTo(1000, 6);
  });

  it('is drawn step-after: each interval over its own time span, gaps as null', () => {
    expect(stepData([NaN, 1000, 2000])).toEqual([1000, 2000, 2000]);
    expect(stepData([NaN, 10, NaN, 30])).toEqual([10, null, 30, 30]);
    expect(stepData([NaN])).toEqual([null]);
    expect(stepData([])).toEqual([]);
  });

  it('has an axis in bytes per second, never flat at zero', () => {
    expect(formatRate(1536)).toBe('1.50 KiB/s');
    expect(formatRate(NaN)).toBe('—');
    const s = historyOf([[0, 0], [1, 3 * MiB]]).series(0, 100);
    expect(sentMax(s)).toBeCloseTo(3 * MiB * HEADROOM);
    expect(sentMax(historyOf([[0, 0], [1, 0]]).series(0, 100))).toBeCloseTo(MIN_SENT_TOP * HEADROOM);
    // one labelled line, a round rate under the top, so the panel's scale is readable
    expect(rateTick(45 * MiB)).toEqual([20 * MiB]);
    expect(rateTick(MIN_SENT_TOP * HEADROOM)).toEqual([500]);
    expect(rateTick(0)).toEqual([]);
  });
});

/** Just enough DOM for RankPlot before it has a width (no uPlot is made then). */
class FakeElement {
  className = '';
  textContent = '';
  hidden = false;
  dataset: Record<string, string> = {};
  children: FakeElement[] = [];
  classList = { toggle: (): void => undefined };
  append(...nodes: FakeElement[]): void {
    this.children.push(...nodes);
  }
  remove(): void {
    return;
  }
}

describe('the rank plot', () => {
  afterEach(() => {
    vi.unstubAllGlobals();
  });

  async function rankPlot() {
    vi.stubGlobal('document', { createElement: () => new FakeElement() });
    const { RankPlot } = await import('../src/chart/rankplot');
    return new RankPlot(0, 100);
  }

  const summaryOf = (node: unknown): string =>
    ((node as FakeElement).children[0].children[1] as FakeElement).textContent;

  it('hides the communication panel without comm_sent and shows it with', async () => {
    const plot = await rankPlot();
    plot.update(historyOf([[0, undefined], [1, undefined]]).series(0, 100));
    expect(plot.commShown).toBe(false);
    expect(plot.commMeasured).toBe(false);
    expect(summaryOf(plot.node)).not.toContain('sent');

    plot.update(historyOf([[0, 0], [1, 2 * MiB]]).series(0, 100));
    expect(plot.commShown).toBe(true);
    expect(summaryOf(plot.node)).toContain('sent\u00a02.00\u00a0MiB/s');

    // the key's toggle hides it in every rank
    plot.update(historyOf([[0, 0], [1, 2 * MiB]]).series(0, 100), new Set(), false);
    expect(plot.commShown).toBe(false);
  });

  it('says "sent" in the header while busy or sending, not when idle at 0', async () => {
    const plot = await rankPlot();
    const idle = new MemoryHistory(60);
    idle.add([sample(0, 500, { busy: false }), sample(1, 500, { busy: false })]);
    plot.update(idle.series(0, 100));
    expect(plot.commShown).toBe(true); // measured: the panel draws its zero line
    expect(summaryOf(plot.node)).not.toContain('sent');
    const busy = new MemoryHistory(60);
    busy.add([sample(0, 500), sample(1, 500)]);
    plot.update(busy.series(0, 100));
    expect(summaryOf(plot.node)).toContain('sent\u00a00\u00a0B/s');
  });
});
