/** One rank of the memory chart: a header line, a uPlot and a hover readout. */
import uPlot from 'uplot';

import { formatBytes, formatClock } from './format';
import { CATEGORIES, IRankSeries } from './history';
import { CATEGORY_LABELS, PEAK_COLOR } from './legend';
import { plotOptions } from './plotoptions';

// Capacity is drawn when it is within this factor of the data; a CPU "capacity"
// is the machine's RAM and would flatten the chart.
const CAPACITY_IN_VIEW_FACTOR = 4;

export class RankPlot {
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
    const opts = plotOptions(this.node, this.width, this._height, {
      yMax: () => this._yMax,
      onCursor: idx => this._showReadout(idx),
      onDraw: u => this._drawPeak(u)
    });
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
