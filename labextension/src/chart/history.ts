/**
 * Per-rank memory history: what the chart draws, fed by `samples` messages
 * (from the dashboard comm or the chart widget). Pure data, no DOM, so it is
 * unit-tested and shared by the sidebar and the in-notebook widget.
 */
import { gather, minMaxIndices } from './decimate';
import { intervalRates, recentRate } from './rates';
import { RingBuffer } from './ringbuffer';

/** One memory sample, as docs/internals.md specifies (bytes as numbers). */
export interface IMemorySample {
  rank: number;
  t: number;
  busy?: boolean;
  device_kind?: string;
  used: number;
  reserved?: number;
  peak?: number;
  capacity?: number;
  device_used?: number | null;
  oom_count?: number;
  parameters?: number;
  gradients?: number;
  optimizer?: number;
  activations?: number;
  other?: number;
  /** Cumulative bytes this rank sent over torch.distributed; null/absent where not measured. */
  comm_sent?: number | null;
}

/**
 * Stacking order, bottom to top. `activations` are what autograd saved for backward
 * (tracked by the engine); `other` is CUDA-allocated bytes beyond the four, 0 on CPU,
 * where the process RSS is drawn as its own line instead.
 */
export const CATEGORIES = ['parameters', 'gradients', 'optimizer', 'activations', 'other'] as const;
export type Category = (typeof CATEGORIES)[number];

// Column layout of each rank's ring buffer.
const T = 0;
const CAT0 = 1; // the categories: columns 1..5
const USED = 6;
const PEAK = 7;
const BUSY = 8;
const SENT = 9; // comm_sent, NaN when absent
const WIDTH = 10;
/** Index of the stack's top in `IRankSeries.stacked`. */
export const TOP = CATEGORIES.length - 1;

/** What one rank's chart draws: decimated, with cumulative (stacked) tops. */
export interface IRankSeries {
  rank: number;
  /** Seconds since the history's origin (the cell's start, else its first sample). */
  t: Float64Array;
  /** Raw per-category bytes, same length as `t`. */
  values: Record<Category, Float64Array>;
  /**
   * Cumulative tops of the shown categories: stacked[i] tops CATEGORIES[i]; a hidden
   * category adds nothing, so stacked[last] is the total of those shown.
   */
  stacked: Float64Array[];
  /** `used` per row: the process RSS on CPU, CUDA-allocated bytes on a GPU. */
  usedRows: Float64Array;
  /** Highest stacked total in the window, and when (seconds since the origin). */
  windowPeak: { t: number; value: number } | null;
  /** The engine's own peak (since its last reset), from the newest sample. */
  peak: number;
  used: number;
  busy: boolean;
  capacity: number;
  deviceKind: string;
  estimate: number | null;
  /**
   * Bytes/s sent at each kept row: the average over the interval from the previous kept
   * row (so decimation keeps the bytes: the area under the steps); NaN at row 0, where
   * comm_sent is missing, or where the counter went down (an engine restart) in between.
   */
  sentRate: Float64Array;
  /** Average bytes/s over the newest ~second of rows (rates.ts); null if not measured. */
  sentNow: number | null;
  /** Whether any sample in the window carried comm_sent. */
  sentMeasured: boolean;
  /** Rows kept before decimation (for tests and the benchmark). */
  rawLength: number;
}

interface IRankData {
  buffer: RingBuffer;
  version: number;
  capacity: number;
  deviceKind: string;
  oomCount: number;
}

/** Highest sample rate (Hz) the buffers are sized for; faster input keeps less history. */
export const MAX_RATE_HZ = 20;

export class MemoryHistory {
  private _ranks = new Map<number, IRankData>();
  private _estimate = new Map<number, number>();
  private _capacity = 0;
  private _origin = 0;
  private _firstT = NaN;
  private _historySeconds: number;
  private _listeners = new Set<() => void>();
  private _version = 0;
  private _settingsVersion = 0;

  constructor(historySeconds = 600) {
    this._historySeconds = MemoryHistory._checkSeconds(historySeconds);
  }

  /** Incremented on every change; the chart redraws when it moves. */
  get version(): number {
    return this._version;
  }

  get historySeconds(): number {
    return this._historySeconds;
  }

  set historySeconds(seconds: number) {
    this._historySeconds = MemoryHistory._checkSeconds(seconds);
    const capacity = this._bufferCapacity();
    for (const data of this._ranks.values()) {
      data.buffer = data.buffer.resized(capacity);
    }
    this._evict();
    this._settingsVersion++;
    this._changed();
  }

  /**
   * Changes when this rank's rows, or anything drawn for every rank (estimate,
   * capacity, window), changed: a chart can skip redrawing a rank whose key is the same.
   */
  drawKey(rank: number): string {
    return `${this._ranks.get(rank)?.version ?? -1}:${this._settingsVersion}`;
  }

  /** Device capacity override (bytes; 0 = use what the samples say). */
  get capacity(): number {
    return this._capacity;
  }

  set capacity(bytes: number) {
    this._capacity = Number.isFinite(bytes) && bytes > 0 ? bytes : 0;
    this._settingsVersion++;
    this._changed();
  }

  /**
   * Unix seconds the time axis counts from (the cell's start); 0 = the first sample
   * since the last reset. Every chart, live and static, shows seconds since the cell started.
   */
  get origin(): number {
    return this._origin > 0 ? this._origin : Number.isFinite(this._firstT) ? this._firstT : 0;
  }

  set origin(t: number) {
    this._origin = Number.isFinite(t) && t > 0 ? t : 0;
    this._settingsVersion++;
    this._changed();
  }

  /** Estimated bytes per rank, drawn as a dashed line. Keys may be strings ("0"). */
  setEstimate(estimate: Record<string, number> | null | undefined): void {
    this._estimate.clear();
    for (const [rank, bytes] of Object.entries(estimate ?? {})) {
      if (Number.isFinite(Number(rank)) && Number.isFinite(bytes)) {
        this._estimate.set(Number(rank), bytes);
      }
    }
    this._settingsVersion++;
    this._changed();
  }

  estimate(rank: number): number | null {
    return this._estimate.get(rank) ?? null;
  }

  /** Ranks ever seen (plus `expected`), ascending. */
  ranks(expected: number[] = []): number[] {
    return [...new Set([...this._ranks.keys(), ...expected])].sort((a, b) => a - b);
  }

  /** Rows held for a rank. */
  length(rank: number): number {
    return this._ranks.get(rank)?.buffer.length ?? 0;
  }

  /** The newest sample time over all ranks, or NaN. */
  latestTime(): number {
    let latest = NaN;
    for (const data of this._ranks.values()) {
      const t = data.buffer.last(T);
      if (!(t <= latest)) {
        latest = t;
      }
    }
    return latest;
  }

  /**
   * Append samples (any ranks, any order between ranks). A sample older than
   * or equal to its rank's newest is a duplicate and is dropped. Returns how
   * many were kept.
   */
  add(samples: IMemorySample[]): number {
    let kept = 0;
    const row = new Float64Array(WIDTH);
    for (const s of samples) {
      if (!s || !Number.isFinite(s.rank) || !Number.isFinite(s.t)) {
        continue;
      }
      const data = this._rank(s.rank);
      if (data.buffer.length > 0 && s.t <= data.buffer.last(T)) {
        continue;
      }
      const parameters = num(s.parameters);
      const gradients = num(s.gradients);
      const optimizer = num(s.optimizer);
      const activations = num(s.activations);
      const used = num(s.used);
      // CPU RSS is mostly the interpreter, not tensors: never stacked (older engines sent it as other).
      const derived = s.device_kind === 'cpu' ? 0 : Math.max(0, used - parameters - gradients - optimizer - activations);
      const other = s.device_kind === 'cpu' ? 0 : s.other === undefined ? derived : num(s.other);
      if (!(s.t >= this._firstT)) {
        this._firstT = s.t; // the earliest sample since the reset (NaN compares false)
      }
      row[T] = s.t;
      row[CAT0] = parameters;
      row[CAT0 + 1] = gradients;
      row[CAT0 + 2] = optimizer;
      row[CAT0 + 3] = activations;
      row[CAT0 + 4] = other;
      row[USED] = used;
      row[PEAK] = Math.max(num(s.peak), used);
      row[BUSY] = s.busy ? 1 : 0;
      row[SENT] = typeof s.comm_sent === 'number' && Number.isFinite(s.comm_sent) ? s.comm_sent : NaN;
      data.buffer.push(row);
      data.version++;
      if (s.capacity) {
        data.capacity = s.capacity;
      }
      if (s.device_kind) {
        data.deviceKind = s.device_kind;
      }
      data.oomCount = num(s.oom_count);
      kept++;
    }
    if (kept > 0) {
      this._evict();
      this._changed();
    }
    return kept;
  }

  /** Forget every sample (a `reset` message, or a new cluster). */
  reset(): void {
    this._ranks.clear();
    this._firstT = NaN;
    this._settingsVersion++;
    this._changed();
  }

  /**
   * The rows of one rank's window, decimated to about `buckets` time buckets
   * (2 rows each at most), with the tops of the categories not `hidden` stacked, ready to draw.
   */
  series(rank: number, buckets: number, hidden: ReadonlySet<Category> = new Set()): IRankSeries {
    const data = this._ranks.get(rank);
    const empty = new Float64Array(0);
    if (!data || data.buffer.length === 0) {
      const values = {} as Record<Category, Float64Array>;
      CATEGORIES.forEach(c => (values[c] = empty));
      return {
        rank,
        t: empty,
        values,
        stacked: CATEGORIES.map(() => empty),
        usedRows: empty,
        windowPeak: null,
        peak: 0,
        used: 0,
        busy: false,
        capacity: this._capacity || (data?.capacity ?? 0),
        deviceKind: data?.deviceKind ?? '',
        estimate: this.estimate(rank),
        sentRate: empty,
        sentNow: null,
        sentMeasured: false,
        rawLength: 0
      };
    }
    const buf = data.buffer;
    const n = buf.length;
    const t = buf.column(T);
    const raw = CATEGORIES.map((_, c) => buf.column(CAT0 + c));
    const shown = CATEGORIES.map(c => !hidden.has(c));
    const total = new Float64Array(n);
    let peakIndex = 0;
    for (let i = 0; i < n; i++) {
      let sum = 0;
      for (let c = 0; c < raw.length; c++) {
        sum += shown[c] ? raw[c][i] : 0;
      }
      total[i] = sum;
      if (total[i] > total[peakIndex]) {
        peakIndex = i;
      }
    }
    const idx = minMaxIndices(t, total, buckets);
    const values = {} as Record<Category, Float64Array>;
    CATEGORIES.forEach((name, c) => (values[name] = gather(raw[c], idx)));
    const stacked: Float64Array[] = [];
    let acc = new Float64Array(idx.length);
    CATEGORIES.forEach((name, c) => {
      const next = new Float64Array(idx.length);
      const v = values[name];
      for (let k = 0; k < idx.length; k++) {
        next[k] = acc[k] + (shown[c] ? v[k] : 0);
      }
      stacked.push(next);
      acc = next;
    });
    const sent = buf.column(SENT);
    const origin = this.origin;
    const times = gather(t, idx);
    for (let k = 0; k < times.length; k++) {
      times[k] -= origin;
    }
    return {
      rank,
      t: times,
      values,
      stacked,
      usedRows: gather(buf.column(USED), idx),
      windowPeak: { t: t[peakIndex] - origin, value: total[peakIndex] },
      peak: buf.last(PEAK),
      used: buf.last(USED),
      busy: buf.last(BUSY) === 1,
      capacity: this._capacity || data.capacity,
      deviceKind: data.deviceKind,
      estimate: this.estimate(rank),
      sentRate: intervalRates(t, sent, idx),
      sentNow: recentRate(t, sent),
      sentMeasured: sent.some(Number.isFinite),
      rawLength: n
    };
  }

  /** Call `listener` after every change; returns the unsubscribe function. */
  subscribe(listener: () => void): () => void {
    this._listeners.add(listener);
    return () => this._listeners.delete(listener);
  }

  private _rank(rank: number): IRankData {
    let data = this._ranks.get(rank);
    if (!data) {
      data = {
        buffer: new RingBuffer(this._bufferCapacity(), WIDTH),
        version: 0,
        capacity: 0,
        deviceKind: '',
        oomCount: 0
      };
      this._ranks.set(rank, data);
    }
    return data;
  }

  private _bufferCapacity(): number {
    return Math.ceil(this._historySeconds * MAX_RATE_HZ) + 16;
  }

  /** Keep only the last `historySeconds` relative to the newest sample of any rank. */
  private _evict(): void {
    const latest = this.latestTime();
    if (Number.isFinite(latest)) {
      for (const data of this._ranks.values()) {
        if (data.buffer.dropBelow(T, latest - this._historySeconds) > 0) {
          data.version++;
        }
      }
    }
  }

  private _changed(): void {
    this._version++;
    for (const listener of [...this._listeners]) {
      listener();
    }
  }

  private static _checkSeconds(seconds: number): number {
    if (!(Number.isFinite(seconds) && seconds > 0)) {
      throw new Error(`history_seconds must be a positive number of seconds, got ${seconds}`);
    }
    return seconds;
  }
}

function num(value: number | null | undefined): number {
  return typeof value === 'number' && Number.isFinite(value) ? value : 0;
}
