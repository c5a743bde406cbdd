/**
 * Rates of a cumulative counter (bytes sent over torch.distributed) for the chart. Averages
 * over intervals, not per-sample differences, so that drawing decimated rows keeps the bytes.
 */

/** recentRate averages over about this many seconds of the newest rows. */
export const SENT_NOW_SECONDS = 1;

/**
 * Average rate of the cumulative `counter` over each interval between kept rows `idx`.
 * An interval with a missing value or a decrease anywhere in it has no rate (NaN), so a
 * restarted engine never draws a negative or a made-up rate.
 */
export function intervalRates(t: ArrayLike<number>, counter: ArrayLike<number>, idx: Int32Array): Float64Array {
  const out = new Float64Array(idx.length).fill(NaN);
  for (let k = 1; k < idx.length; k++) {
    const a = idx[k - 1];
    const b = idx[k];
    let ok = Number.isFinite(counter[a]);
    for (let i = a + 1; ok && i <= b; i++) {
      ok = counter[i] >= counter[i - 1]; // false for NaN too
    }
    const dt = t[b] - t[a];
    if (ok && dt > 0) {
      out[k] = (counter[b] - counter[a]) / dt;
    }
  }
  return out;
}

/** Average rate of `counter` over the newest ~SENT_NOW_SECONDS (at least one interval), or null. */
export function recentRate(t: ArrayLike<number>, counter: ArrayLike<number>): number | null {
  const last = t.length - 1;
  let j = last - 1;
  if (j < 0 || !(counter[last] >= counter[j])) {
    return null; // one row, not measured, or restarted just now
  }
  const from = t[last] - SENT_NOW_SECONDS - 1e-6; // 1e-6: ten 0.1 s steps do not sum to exactly 1
  while (j > 0 && t[j - 1] >= from && counter[j] >= counter[j - 1]) {
    j--;
  }
  const dt = t[last] - t[j];
  return dt > 0 ? (counter[last] - counter[j]) / dt : null;
}
