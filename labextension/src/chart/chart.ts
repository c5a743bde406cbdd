/**
 * The one memory chart: per rank, stacked by category, estimate dashed,
 * capacity as a limit, peak marked, hover for exact numbers. Used by the
 * in-notebook widget (widget.ts) and the Distributed sidebar (sidebar.ts).
 *
 * Keeping up with 8 ranks x 10 Hz x 10 minutes: data lives in ring buffers
 * (history.ts), each draw is decimated to about one point pair per pixel, and
 * draws are coalesced to at most one per animation frame, and only when the
 * data changed and the chart is visible.
 */
import uPlot from 'uplot';

import { formatBytes, formatClock } from './format';
import { CATEGORIES, Category, IRankSeries, MemoryHistory } from './history';

export const CATEGORY_COLORS: Record<Category, string> = {
  parameters: '#4e79a7',
  gradients: '#f28e2b',
  optimizer: '#59a14f',
  other: '#bab0ac'
};
const CATEGORY_LABELS: Record<Category, string> = {
  parameters: 'params',
  gradients: 'grads',
  optimizer: 'optim',
  other: 'other'
};
// Y tick steps: 1, 2, 5 x 10^k of KiB, MiB, GiB, TiB, so ticks read "200 MiB", not "954 MiB".
const BYTE_STEPS = [2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40].flatMap(unit =>
  [1, 2, 5, 10, 20, 50, 100, 200, 500].map(m => m * unit)
);
// X tick steps in seconds: never below one second, so labels never repeat.
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400];
const ESTIMATE_COLOR = '#7b3294';
const CAPACITY_COLOR = '#d62728';
const PEAK_COLOR = '#d62728';
// Capacity is drawn when it is within this factor of the data; a CPU "capacity"
// is the machine's RAM and would flatten the chart.
const CAPACITY_IN_VIEW_FACTOR = 4;

export interface IMemoryChartOptions {
  /** Height of each rank's plot area in pixels. */
  plotHeight?: number;
  /** Ranks to show even before their first sample. */
  ranks?: number[];
}

/** Draw-time statistics, read by the browser benchmark. */
export interface IDrawStats {
  draws: number;
  totalMs: number;
  maxMs: number;
  /** Last draw durations (ms), newest last, at most 2000. */
  recent: number[];
  /** How many points the last draw handed to uPlot, over all ranks. */
  lastPoints: number;
}

export class MemoryChart {
  readonly node: HTMLDivElement;
  readonly stats: IDrawStats = { draws: 0, totalMs: 0, maxMs: 0, recent: [], lastPoints: 0 };
  /** Decimate for drawing (off only to measure what decimation saves). */
  decimate = true;
  private _plots = new Map<number, RankPlot>();
  private _plotsNode: HTMLDivElement;
  private _empty: HTMLDivElement;
  private _frame = 0;
  private _drawnVersion = -1;
  private _ranks: number[];
  private _unsubscribe: () => void;
  private _resize: ResizeObserver | null = null;
  private _visibility: IntersectionObserver | null = null;
  private _disposed = false;
  private _plotHeight: number;

  constructor(
    readonly history: MemoryHistory,
    options: IMemoryChartOptions = {}
  ) {
    this._plotHeight = options.plotHeight ?? 140;
    this._ranks = options.ranks ?? [];
    this.node = document.createElement('div');
    this.node.className = 'mpnb-memory-chart';
    this.node.appendChild(legendKey());
    this._empty = document.createElement('div');
    this._empty.className = 'mpnb-memory-chart-empty';
    this._empty.textContent = 'Waiting for memory samples…';
    this.node.appendChild(this._empty);
    this._plotsNode = document.createElement('div');
    this._plotsNode.className = 'mpnb-memory-chart-plots';
    this.node.appendChild(this._plotsNode);
    this._unsubscribe = history.subscribe(() => this.requestDraw());
    if (typeof ResizeObserver !== 'undefined') {
      // Widths come from here only: reading clientWidth while drawing would force a layout per rank.
      this._resize = new ResizeObserver(entries => {
        for (const entry of entries) {
          const plot = this._plots.get(Number((entry.target as HTMLElement).dataset.rank));
          plot?.setWidth(entry.contentRect.width);
        }
        this._drawnVersion = -1;
        this.requestDraw();
      });
    }
    if (typeof IntersectionObserver !== 'undefined') {
      // Ranks scrolled out of view are not drawn; they catch up when they come back.
      this._visibility = new IntersectionObserver(entries => {
        let stale = false;
        for (const entry of entries) {
          const plot = this._plots.get(Number((entry.target as HTMLElement).dataset.rank));
          if (plot) {
            plot.inView = entry.isIntersecting;
            stale = stale || (plot.inView && plot.drawnKey !== this._keyOf(plot));
          }
        }
        if (stale) {
          this._drawnVersion = -1;
          this.requestDraw();
        }
      });
    }
    this.requestDraw();
  }

  /** Ranks to show even without samples (the cluster's ranks). */
  setRanks(ranks: number[]): void {
    this._ranks = [...ranks];
    this._drawnVersion = -1;
    this.requestDraw();
  }

  /** Forget what was drawn, so the next draw redraws every rank. */
  invalidate(): void {
    for (const plot of this._plots.values()) {
      plot.drawnKey = '';
    }
    this._drawnVersion = -1;
  }

  /** Schedule a draw on the next animation frame; many calls, one draw. */
  requestDraw(): void {
    if (this._frame || this._disposed) {
      return;
    }
    this._frame = requestAnimationFrame(() => {
      this._frame = 0;
      this.drawNow();
    });
  }

  /** Draw now if the data changed since the last draw and the chart is visible. */
  drawNow(): boolean {
    if (this._disposed || this.history.version === this._drawnVersion) {
      return false;
    }
    const start = performance.now();
    const ranks = this.history.ranks(this._ranks);
    this._empty.style.display = ranks.length === 0 ? '' : 'none';
    for (const [rank, plot] of this._plots) {
      if (!ranks.includes(rank)) {
        plot.dispose();
        this._plots.delete(rank);
      }
    }
    let points = 0;
    for (const rank of ranks) {
      let plot = this._plots.get(rank);
      if (!plot) {
        plot = new RankPlot(rank, this._plotHeight);
        this._insertPlot(rank, plot);
      }
      const key = this._keyOf(plot);
      if (!plot.inView || plot.drawnKey === key) {
        points += plot.points;
        continue;
      }
      // One bucket per two pixels, at most two rows each: about one point per pixel.
      const buckets = this.decimate ? Math.max(25, plot.width / 2) : Number.MAX_SAFE_INTEGER;
      const series = this.history.series(rank, buckets);
      points += series.t.length;
      plot.update(series);
      plot.drawnKey = plot.drawn ? key : '';
    }
    this._drawnVersion = this.history.version;
    const ms = performance.now() - start;
    const s = this.stats;
    s.draws++;
    s.totalMs += ms;
    s.maxMs = Math.max(s.maxMs, ms);
    s.lastPoints = points;
    s.recent.push(ms);
    if (s.recent.length > 2000) {
      s.recent.splice(0, s.recent.length - 2000);
    }
    return true;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    if (this._frame) {
      cancelAnimationFrame(this._frame);
    }
    this._unsubscribe();
    this._resize?.disconnect();
    this._visibility?.disconnect();
    for (const plot of this._plots.values()) {
      plot.dispose();
    }
    this._plots.clear();
    this.node.remove();
  }

  private _keyOf(plot: RankPlot): string {
    return `${this.history.drawKey(plot.rank)}:${plot.width}`;
  }

  private _insertPlot(rank: number, plot: RankPlot): void {
    this._plots.set(rank, plot);
    this._visibility?.observe(plot.node);
    this._resize?.observe(plot.host);
    const after = [...this._plots.entries()]
      .filter(([r]) => r > rank)
      .sort((a, b) => a[0] - b[0])[0];
    this._plotsNode.insertBefore(plot.node, after ? after[1].node : null);
  }
}

/** One rank: a header line, a uPlot and a hover readout. */
class RankPlot {
  readonly node: HTMLDivElement;
  /** False while scrolled out of view (IntersectionObserver). */
  inView = true;
  /** What was drawn last (history key + width); '' = needs drawing. */
  drawnKey = '';
  private _title: HTMLSpanElement;
  private _summary: HTMLSpanElement;
  readonly host: HTMLDivElement;
  private _width = 0;
  private _readout: HTMLDivElement;
  private _plot: uPlot | null = null;
  private _series: IRankSeries | null = null;
  private _yMax = 1;
  private _capacityShown = false;

  constructor(
    readonly rank: number,
    private _height: number
  ) {
    this.node = document.createElement('div');
    this.node.className = 'mpnb-rank-chart';
    this.node.dataset.rank = String(rank);
    const header = document.createElement('div');
    header.className = 'mpnb-rank-chart-header';
    this._title = document.createElement('span');
    this._title.className = 'mpnb-rank-chart-title';
    this._summary = document.createElement('span');
    this._summary.className = 'mpnb-rank-chart-summary';
    header.append(this._title, this._summary);
    this.host = document.createElement('div');
    this.host.className = 'mpnb-rank-chart-plot';
    this.host.dataset.rank = String(rank);
    this._readout = document.createElement('div');
    this._readout.className = 'mpnb-rank-chart-readout';
    this.node.append(header, this.host, this._readout);
    this._title.textContent = `rank ${rank}`;
  }

  /** Plot width in CSS pixels (0 until the ResizeObserver measured it). */
  get width(): number {
    return this._width;
  }

  /** Whether the uPlot exists (it needs a width, i.e. the chart attached). */
  get drawn(): boolean {
    return this._plot !== null;
  }

  /** Number of points currently drawn (for tests: "the chart has points"). */
  get points(): number {
    return this._series?.t.length ?? 0;
  }

  setWidth(width: number): void {
    width = Math.floor(width);
    if (width !== this._width) {
      this._width = width;
      if (this._plot && width > 0) {
        this._plot.setSize({ width, height: this._height });
      }
    }
  }

  update(series: IRankSeries): void {
    this._series = series;
    const n = series.t.length;
    const dataMax = maxOf(series.stacked[3]);
    const estimate = series.estimate;
    this._capacityShown =
      series.capacity > 0 && series.capacity <= CAPACITY_IN_VIEW_FACTOR * Math.max(dataMax, estimate ?? 0);
    this._yMax =
      Math.max(dataMax, estimate ?? 0, this._capacityShown ? series.capacity : 0, 1024 * 1024) * 1.08;
    this._title.textContent = `rank ${series.rank}${series.deviceKind ? ` · ${series.deviceKind}` : ''}${
      series.busy ? ' · busy' : ''
    }`;
    this.node.classList.toggle('mpnb-mod-busy', series.busy);
    this.node.dataset.points = String(n);
    this.node.dataset.parameters = String(n > 0 ? series.values.parameters[n - 1] : 0);
    const summary = [`used ${formatBytes(series.used)}`, `peak ${formatBytes(series.peak)}`];
    if (estimate !== null) {
      summary.push(`est ${formatBytes(estimate)}`);
    }
    if (series.capacity > 0) {
      summary.push(`of ${formatBytes(series.capacity)}`);
    }
    this._summary.textContent = summary.join(' · ');
    if (!this._plot) {
      if (this.width <= 0) {
        return;
      }
      this._plot = this._create();
    }
    const fill = (value: number | null, show: boolean): (number | null)[] =>
      new Array(n).fill(show && value !== null ? value : null);
    const plot = this._plot;
    // batch: draw now, not in a microtask, so the draw-time statistics are honest.
    plot.batch(() => plot.setData([
      series.t,
      series.stacked[3],
      series.stacked[2],
      series.stacked[1],
      series.stacked[0],
      fill(estimate, estimate !== null),
      fill(series.capacity, this._capacityShown)
    ] as uPlot.AlignedData));
    this._showReadout(this._plot.cursor.idx ?? null);
  }

  dispose(): void {
    this._plot?.destroy();
    this._plot = null;
    this.node.remove();
  }

  private _create(): uPlot {
    const style = getComputedStyle(this.node);
    const fg = style.getPropertyValue('--jp-ui-font-color2').trim() || '#616161';
    const grid = style.getPropertyValue('--jp-border-color2').trim() || '#e0e0e0';
    const font = `10px ${style.getPropertyValue('--jp-ui-font-family').trim() || 'sans-serif'}`;
    const area = (c: Category): uPlot.Series => ({
      label: c,
      stroke: CATEGORY_COLORS[c],
      fill: CATEGORY_COLORS[c],
      width: 1,
      points: { show: false }
    });
    const opts: uPlot.Options = {
      width: this.width,
      height: this._height,
      legend: { show: false },
      cursor: { drag: { x: false, y: false }, points: { show: false } },
      scales: {
        x: { time: true },
        y: { range: () => [0, this._yMax] }
      },
      axes: [
        {
          stroke: fg,
          font,
          size: 24,
          space: 70,
          incrs: TIME_STEPS,
          grid: { stroke: grid, width: 1 },
          ticks: { stroke: grid, width: 1 },
          values: (_u, splits, _axis, _space, step) => splits.map(v => formatClock(v, step < 60))
        },
        {
          stroke: fg,
          font,
          size: 58,
          space: 24,
          incrs: BYTE_STEPS,
          grid: { stroke: grid, width: 1 },
          ticks: { stroke: grid, width: 1 },
          values: (_u, splits) => splits.map(v => formatBytes(v))
        }
      ],
      // Top of the stack first: each area fills down to zero and the next one covers it.
      series: [
        {},
        area('other'),
        area('optimizer'),
        area('gradients'),
        area('parameters'),
        { label: 'estimate', stroke: ESTIMATE_COLOR, width: 1.5, dash: [6, 4], points: { show: false } },
        { label: 'capacity', stroke: CAPACITY_COLOR, width: 1.5, points: { show: false } }
      ],
      hooks: {
        setCursor: [u => this._showReadout(u.cursor.idx ?? null)],
        draw: [u => this._drawPeak(u)]
      }
    };
    return new uPlot(opts, [[], [], [], [], [], [], []], this.host);
  }

  /** Exact numbers under the cursor, or the newest sample when not hovering. */
  private _showReadout(idx: number | null): void {
    const s = this._series;
    if (!s || s.t.length === 0) {
      this._readout.textContent = 'no samples yet';
      return;
    }
    const i = idx === null || idx < 0 || idx >= s.t.length ? s.t.length - 1 : idx;
    const parts = CATEGORIES.map(c => `${CATEGORY_LABELS[c]} ${formatBytes(s.values[c][i])}`);
    parts.push(`total ${formatBytes(s.stacked[3][i])}`);
    this._readout.textContent = `${idx === null ? 'now' : formatClock(s.t[i])} · ${parts.join(' · ')}`;
  }

  /** A marker and label at the highest stacked total in the window. */
  private _drawPeak(u: uPlot): void {
    const peak = this._series?.windowPeak;
    if (!peak || peak.value <= 0) {
      return;
    }
    const x = u.valToPos(peak.t, 'x', true);
    const y = u.valToPos(peak.value, 'y', true);
    const ctx = u.ctx;
    const r = 4 * devicePixelRatio;
    ctx.save();
    ctx.fillStyle = PEAK_COLOR;
    ctx.beginPath();
    ctx.moveTo(x, y - r * 0.2);
    ctx.lineTo(x - r, y - r * 1.8);
    ctx.lineTo(x + r, y - r * 1.8);
    ctx.closePath();
    ctx.fill();
    ctx.font = `${10 * devicePixelRatio}px sans-serif`;
    const label = `peak ${formatBytes(peak.value)}`;
    const width = ctx.measureText(label).width;
    const left = u.bbox.left;
    const right = u.bbox.left + u.bbox.width;
    const tx = Math.min(Math.max(x - width / 2, left), right - width);
    ctx.fillText(label, tx, Math.max(y - r * 2.2, u.bbox.top + 10 * devicePixelRatio));
    ctx.restore();
  }
}

function maxOf(values: Float64Array): number {
  let max = 0;
  for (let i = 0; i < values.length; i++) {
    if (values[i] > max) {
      max = values[i];
    }
  }
  return max;
}

/** The colour key shared by all ranks of one chart. */
function legendKey(): HTMLDivElement {
  const key = document.createElement('div');
  key.className = 'mpnb-memory-chart-key';
  const item = (cls: string, label: string, color: string): void => {
    const span = document.createElement('span');
    span.className = 'mpnb-key-item';
    const swatch = document.createElement('span');
    swatch.className = `mpnb-key-swatch ${cls}`;
    swatch.style.setProperty('--mpnb-key-color', color);
    span.append(swatch, document.createTextNode(label));
    key.appendChild(span);
  };
  for (const c of CATEGORIES) {
    item('mpnb-key-area', c, CATEGORY_COLORS[c]);
  }
  item('mpnb-key-dashed', 'estimate', ESTIMATE_COLOR);
  item('mpnb-key-line', 'capacity', CAPACITY_COLOR);
  item('mpnb-key-peak', 'peak', PEAK_COLOR);
  return key;
}
