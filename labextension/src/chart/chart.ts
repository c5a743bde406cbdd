/**
 * The one memory chart: per rank, stacked by category, estimate dashed,
 * capacity as a limit, peak marked, hover for exact numbers. Used by the
 * in-notebook widget (widget.ts) and the Distributed sidebar
 * (../dashboard/sidebar.ts); one RankPlot (rankplot.ts) per rank.
 *
 * Keeping up with 8 ranks x 10 Hz x 10 minutes: data lives in ring buffers
 * (history.ts), each draw is decimated to about one point pair per pixel, and
 * draws are coalesced to at most one per animation frame, and only when the
 * data changed and the chart is visible.
 */
import { Category, MemoryHistory } from './history';
import { legendKey } from './legend';
import { RankPlot } from './rankplot';

export interface IMemoryChartOptions {
  /** Height of each rank's plot area in pixels. */
  plotHeight?: number;
  /** Ranks to show even before their first sample. */
  ranks?: number[];
  /** Categories hidden at first (the key's buttons toggle them). */
  hidden?: Category[];
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
  /** Categories the key has hidden: not stacked, and the axis zooms to the rest. */
  readonly hidden: Set<Category>;
  /** Whether the key has hidden the bytes-sent panels. */
  commHidden = false;
  private _commKey: HTMLElement | null;
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
    this.hidden = new Set(options.hidden ?? []);
    const key = legendKey(this.hidden, c => this.toggle(c), {
      hidden: () => this.commHidden,
      onToggle: () => this.toggleComm()
    });
    this._commKey = key.querySelector<HTMLElement>('[data-comm]');
    if (this._commKey) {
      this._commKey.hidden = true; // until a rank reports comm_sent (never on CUDA/NCCL)
    }
    this.node.appendChild(key);
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

  /** Hide a shown category or show a hidden one, in every rank. */
  toggle(category: Category): void {
    if (!this.hidden.delete(category)) {
      this.hidden.add(category);
    }
    this.invalidate();
    this.requestDraw();
  }

  /** Hide or show the bytes-sent panels in every rank. */
  toggleComm(): void {
    this.commHidden = !this.commHidden;
    this.invalidate();
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
      const series = this.history.series(rank, buckets, this.hidden);
      points += series.t.length;
      plot.update(series, this.hidden, !this.commHidden);
      plot.drawnKey = plot.drawn ? key : '';
    }
    if (this._commKey) {
      this._commKey.hidden = ![...this._plots.values()].some(p => p.commMeasured);
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
    return `${this.history.drawKey(plot.rank)}:${plot.width}:${[...this.hidden].join(',')}:${this.commHidden}`;
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
