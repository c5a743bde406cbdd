/**
 * The y ranges of one rank's plot, kept apart from uPlot so they are unit-tested.
 *
 * The left axis is zoomed to what is shown (the categories not hidden, the estimate, the
 * capacity when it is near): on CPU parameters, gradients and optimizer state of a small
 * model are a few MiB, and an axis reaching to the ~400 MiB of the interpreter would draw
 * them, and the estimate, as a line on 0. The process RSS gets its own axis on the right.
 */
import { IRankSeries, TOP } from './history';

// Capacity is drawn when it is within this factor of the data; a CPU "capacity"
// is the machine's RAM and would flatten the chart.
export const CAPACITY_IN_VIEW_FACTOR = 4;
/** The smallest top of the left axis: a chart of empty categories still has a scale. */
export const MIN_TOP = 1024 * 1024;
/** Room above the highest value for the peak label. */
export const HEADROOM = 1.08;

export interface IScales {
  /** Top of the left (stacked categories) axis, bytes. */
  yMax: number;
  /** Whether the capacity line is drawn (it is within view). */
  capacityShown: boolean;
  /** Top of the right (process RSS) axis; 0 when there is none (a GPU rank). */
  rssMax: number;
}

export function scalesOf(series: IRankSeries, showEstimate = true): IScales {
  const dataMax = maxOf(series.stacked[TOP]);
  const estimate = showEstimate ? series.estimate ?? 0 : 0;
  const cuda = series.deviceKind === 'cuda';
  const capacityShown =
    cuda && series.capacity > 0 && series.capacity <= CAPACITY_IN_VIEW_FACTOR * Math.max(dataMax, estimate);
  const yMax = Math.max(dataMax, estimate, capacityShown ? series.capacity : 0, MIN_TOP) * HEADROOM;
  const rssMax = cuda ? 0 : Math.max(maxOf(series.usedRows), MIN_TOP) * HEADROOM;
  return { yMax, capacityShown, rssMax };
}

/** The smallest top of the bytes-sent axis (bytes/s): an idle rank still gets a scale. */
export const MIN_SENT_TOP = 1024;

/** Top of the communication panel's axis (bytes/s). */
export function sentMax(series: IRankSeries): number {
  return Math.max(maxOf(series.sentRate), MIN_SENT_TOP) * HEADROOM;
}

/** The largest value, at least 0; NaN is skipped. */
export function maxOf(values: ArrayLike<number>): number {
  let max = 0;
  for (let i = 0; i < values.length; i++) {
    if (values[i] > max) {
      max = values[i];
    }
  }
  return max;
}
