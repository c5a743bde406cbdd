/**
 * A fixed-capacity ring buffer of numeric rows stored column by column.
 *
 * Memory samples arrive forever (10 Hz per rank); the charts only ever show the
 * last `history_seconds`. Typed-array columns keep 8 ranks x 10 minutes at a
 * few hundred KB with no garbage per sample, which keeps drawing smooth.
 */
export class RingBuffer {
  private _columns: Float64Array[];
  private _start = 0;
  private _length = 0;

  constructor(
    private _capacity: number,
    readonly width: number
  ) {
    if (!(_capacity >= 1) || !(width >= 1)) {
      throw new Error(`RingBuffer needs capacity >= 1 and width >= 1, got ${_capacity}, ${width}`);
    }
    this._capacity = Math.floor(_capacity);
    this._columns = Array.from({ length: width }, () => new Float64Array(this._capacity));
  }

  get capacity(): number {
    return this._capacity;
  }

  get length(): number {
    return this._length;
  }

  /** Append one row; when full, the oldest row is overwritten. */
  push(row: ArrayLike<number>): void {
    const slot = (this._start + this._length) % this._capacity;
    for (let c = 0; c < this.width; c++) {
      this._columns[c][slot] = c < row.length ? row[c] : NaN;
    }
    if (this._length < this._capacity) {
      this._length++;
    } else {
      this._start = (this._start + 1) % this._capacity;
    }
  }

  /** Value of column `col` in row `i`, where row 0 is the oldest kept. */
  get(col: number, i: number): number {
    if (i < 0 || i >= this._length) {
      throw new RangeError(`row ${i} outside 0..${this._length - 1}`);
    }
    return this._columns[col][(this._start + i) % this._capacity];
  }

  /** The newest value of a column, or NaN when empty. */
  last(col: number): number {
    return this._length === 0 ? NaN : this.get(col, this._length - 1);
  }

  /** Copy rows [from, to) of one column, oldest first, into a fresh array. */
  column(col: number, from = 0, to = this._length): Float64Array {
    from = Math.max(0, from);
    to = Math.min(this._length, to);
    const out = new Float64Array(Math.max(0, to - from));
    if (out.length === 0) {
      return out;
    }
    // At most two contiguous runs (before and after the wrap point): block copies, no per-row modulo.
    const src = this._columns[col];
    const first = (this._start + from) % this._capacity;
    const run = Math.min(out.length, this._capacity - first);
    out.set(src.subarray(first, first + run), 0);
    if (run < out.length) {
      out.set(src.subarray(0, out.length - run), run);
    }
    return out;
  }

  /**
   * Index of the first row whose value in `col` is >= `value`, assuming the
   * column is sorted ascending (time). Binary search: O(log n).
   */
  lowerBound(col: number, value: number): number {
    let lo = 0;
    let hi = this._length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (this.get(col, mid) < value) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo;
  }

  /** Drop the oldest rows while `col` is below `value` (evict by time). */
  dropBelow(col: number, value: number): number {
    const n = this.lowerBound(col, value);
    this._start = (this._start + n) % this._capacity;
    this._length -= n;
    return n;
  }

  clear(): void {
    this._start = 0;
    this._length = 0;
  }

  /** A new buffer with another capacity that keeps the newest rows. */
  resized(capacity: number): RingBuffer {
    const next = new RingBuffer(capacity, this.width);
    const keep = Math.min(this._length, next.capacity);
    const row = new Float64Array(this.width);
    for (let i = this._length - keep; i < this._length; i++) {
      for (let c = 0; c < this.width; c++) {
        row[c] = this.get(c, i);
      }
      next.push(row);
    }
    return next;
  }
}
