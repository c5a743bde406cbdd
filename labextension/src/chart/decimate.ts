/**
 * Min/max decimation for drawing: a chart a few hundred pixels wide cannot show
 * 6000 points per rank, and drawing them all is what makes charts fall behind.
 * Per time bucket (about one pixel) we keep the rows holding the lowest and the
 * highest value, so spikes (the peaks people look for) survive.
 */

/**
 * Indices (ascending) of the rows to draw.
 *
 * @param t - sample times, ascending
 * @param y - the value whose extremes must survive (the stacked total)
 * @param buckets - how many time buckets (roughly the plot width in pixels)
 */
export function minMaxIndices(t: ArrayLike<number>, y: ArrayLike<number>, buckets: number): Int32Array {
  const n = Math.min(t.length, y.length);
  buckets = Math.max(1, Math.floor(buckets));
  if (n <= 2 * buckets + 2) {
    return Int32Array.from({ length: n }, (_, i) => i);
  }
  const t0 = t[0];
  const span = t[n - 1] - t0;
  const out = new Int32Array(2 * buckets + 2);
  let count = 0;
  const emit = (i: number): void => {
    if (count === 0 || out[count - 1] !== i) {
      out[count++] = i;
    }
  };
  emit(0);
  let bucket = -1;
  let lo = -1;
  let hi = -1;
  const flush = (): void => {
    if (lo < 0) {
      return;
    }
    if (lo < hi) {
      emit(lo);
      emit(hi);
    } else {
      emit(hi);
      emit(lo);
    }
  };
  for (let i = 1; i < n - 1; i++) {
    const b = span > 0 ? Math.min(buckets - 1, Math.floor(((t[i] - t0) / span) * buckets)) : 0;
    if (b !== bucket) {
      flush();
      bucket = b;
      lo = hi = i;
    } else {
      if (y[i] < y[lo]) {
        lo = i;
      }
      if (y[i] > y[hi]) {
        hi = i;
      }
    }
  }
  flush();
  emit(n - 1);
  return out.slice(0, count);
}

/** Gather `src[indices[k]]` into a new array. */
export function gather(src: ArrayLike<number>, indices: Int32Array): Float64Array {
  const out = new Float64Array(indices.length);
  for (let k = 0; k < indices.length; k++) {
    out[k] = src[indices[k]];
  }
  return out;
}
