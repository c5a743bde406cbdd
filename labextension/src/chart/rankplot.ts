/**
 * One rank of the memory chart: a header line, the memory uPlot, under it a small uPlot of
 * the bytes sent per second (only where the rank reports comm_sent) and a hover readout.
 */
import uPlot from 'uplot';

import { formatBytes, formatElapsed } from './format';
import { CATEGORIES, Category, IRankSeries, TOP } from './history';
import { CATEGORY_LABELS, PEAK_COLOR } from './legend';
import { commPlotOptions, formatRate, plotOptions, stepData } from './plotoptions';
import { scalesOf, sentMax } from './scale';

/** Height of the communication panel, CSS pixels. */
export const COMM_HEIGHT = 50;
let plotCount = 0; // for cursor-sync keys: two charts may show the same rank

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
  private _rssMax = 1;
  private _rssAxis = false;
  private _capacityShown = false;
  private _commHost: HTMLDivElement;
  private _commPlot: uPlot | null = null;
  private _commMax = 1;
  private _syncKey = `mpnb-rank-plot-${++plotCount}`;

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
    this._commHost = document.createElement('div');
    this._commHost.className = 'mpnb-rank-chart-comm';
    this._commHost.hidden = true;
    this._readout = document.createElement('div');
    this._readout.className = 'mpnb-rank-chart-readout';
    this.node.append(header, this.host, this._commHost, this._readout);
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

  /** Whether the last series carried comm_sent (the key shows its toggle then). */
  get commMeasured(): boolean {
    return this._series?.sentMeasured ?? false;
  }

  /** Whether the communication panel is shown. */
  get commShown(): boolean {
    return !this._commHost.hidden;
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
      if (this._commPlot && width > 0) {
        this._commPlot.setSize({ width, height: COMM_HEIGHT });
      }
    }
  }

  /**
   * Draw `series`; `hidden` categories get no area (their stacked tops add nothing). The
   * communication panel is drawn when `commShown` and the rank reports comm_sent.
   */
  update(series: IRankSeries, hidden: ReadonlySet<Category> = new Set(), commShown = true): void {
    this._series = series;
    const n = series.t.length;
    const estimate = series.estimate;
    const scales = scalesOf(series);
    this._capacityShown = scales.capacityShown;
    this._yMax = scales.yMax;
    this._rssMax = scales.rssMax;
    const cpu = series.deviceKind === 'cpu';
    this._title.textContent = `rank ${series.rank}${series.deviceKind ? ` · ${series.deviceKind}` : ''}${
      series.busy ? ' · busy' : ''
    }`;
    this.node.classList.toggle('mpnb-mod-busy', series.busy);
    this.node.dataset.points = String(n);
    this.node.dataset.parameters = String(n > 0 ? series.values.parameters[n - 1] : 0);
    const summary = cpu
      ? [`RSS ${formatBytes(series.used)}`, `peak RSS ${formatBytes(series.peak)}`]
      : [`allocated ${formatBytes(series.used)}`, `peak ${formatBytes(series.peak)}`];
    if (estimate !== null) {
      summary.push(`est ${formatBytes(estimate)}`);
    }
    if (series.capacity > 0) {
      summary.push(`of ${formatBytes(series.capacity)}`);
    }
    if (series.sentNow !== null && (series.busy || series.sentNow > 0)) {
      summary.push(`sent ${formatRate(series.sentNow)}`);
    }
    // No-break spaces inside an item: a narrow sidebar wraps between items, never "7.83 | MiB".
    this._summary.textContent = summary.map(item => item.replace(/ /g, '\u00a0')).join(' · ');
    const showComm = commShown && series.sentMeasured;
    this._commHost.hidden = !showComm;
    if (this._plot && this._rssAxis !== cpu) {
      this._destroyPlots(); // the device became known: add or drop the RSS axis (and the panel's matching edge)
    }
    if (!this._plot) {
      if (this.width <= 0) {
        return;
      }
      this._rssAxis = cpu;
      this._plot = this._create();
    }
    const fill = (value: number | null, show: boolean): (number | null)[] =>
      new Array(n).fill(show && value !== null ? value : null);
    const plot = this._plot;
    // batch: draw now, not in a microtask, so the draw-time statistics are honest.
    const tops = CATEGORIES.map((c, i) => (hidden.has(c) ? fill(null, false) : series.stacked[i])).reverse();
    plot.batch(() => plot.setData([
      series.t,
      ...tops,
      fill(estimate, estimate !== null),
      fill(series.capacity, this._capacityShown),
      cpu ? series.usedRows : fill(null, false)
    ] as uPlot.AlignedData));
    if (showComm) {
      this._commMax = sentMax(series);
      const comm = (this._commPlot ??= this._createComm());
      comm.batch(() => comm.setData([series.t, stepData(series.sentRate)] as uPlot.AlignedData));
    }
    this._showReadout(this._plot.cursor.idx ?? null);
  }

  dispose(): void {
    this._destroyPlots();
    this.node.remove();
  }

  private _destroyPlots(): void {
    this._plot?.destroy();
    this._plot = null;
    this._commPlot?.destroy();
    this._commPlot = null;
  }

  private _create(): uPlot {
    const opts = plotOptions(this.node, this.width, this._height, {
      yMax: () => this._yMax,
      rssMax: () => this._rssMax,
      onCursor: idx => this._showReadout(idx),
      onDraw: u => this._drawPeak(u)
    }, this._rssAxis, this._syncKey);
    return new uPlot(opts, opts.series.map(() => []) as unknown as uPlot.AlignedData, this.host);
  }

  private _createComm(): uPlot {
    const opts = commPlotOptions(this.node, this.width, COMM_HEIGHT, {
      yMax: () => this._commMax,
      onCursor: idx => this._showReadout(idx)
    }, this._rssAxis, this._syncKey);
    return new uPlot(opts, opts.series.map(() => []) as unknown as uPlot.AlignedData, this._commHost);
  }

  /** Exact numbers under the cursor, or the newest sample when not hovering. */
  private _showReadout(idx: number | null): void {
    const s = this._series;
    if (!s || s.t.length === 0) {
      this._readout.textContent = 'no samples yet';
      return;
    }
    const i = idx === null || idx < 0 || idx >= s.t.length ? s.t.length - 1 : idx;
    const cpu = s.deviceKind === 'cpu';
    const parts = CATEGORIES.filter(c => !cpu || c !== 'other').map(
      c => `${CATEGORY_LABELS[c]} ${formatBytes(s.values[c][i])}`
    );
    parts.push(`stack ${formatBytes(s.stacked[TOP][i])}`);
    if (cpu) {
      parts.push(`RSS ${formatBytes(s.usedRows[i])}`);
    }
    if (s.sentMeasured) {
      // The row's interval (from the row before); "now" is the newest second, as in the header.
      parts.push(`sent ${formatRate(idx === null ? s.sentNow ?? NaN : s.sentRate[i])}`);
    }
    this._readout.textContent = `${idx === null ? 'now' : formatElapsed(s.t[i])} · ${parts.join(' · ')}`;
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
