/**
 * What one rank's uPlots look like: the memory plot (axes, tick steps, the stacked areas and the
 * reference lines) and the communication panel under it, which shares its x range and plot edges.
 */
import uPlot from 'uplot';

import { formatBytes, formatElapsed } from './format';
import { CATEGORIES, Category } from './history';
import { CAPACITY_COLOR, CATEGORY_COLORS, ESTIMATE_COLOR, RSS_COLOR, SENT_COLOR, SENT_FILL } from './legend';

// Y tick steps: 1, 2, 5 x 10^k of KiB, MiB, GiB, TiB, so ticks read "200 MiB", not "954 MiB".
const BYTE_STEPS = [2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40].flatMap(unit =>
  [1, 2, 5, 10, 20, 50, 100, 200, 500].map(m => m * unit)
);
// Rate tick steps: the same, plus plain bytes (an idle rank sends a few hundred B/s).
const RATE_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, ...BYTE_STEPS];
// Both plots of a rank get the same left axis and right edge, so their time axes line up.
const Y_AXIS_SIZE = 58;
const RIGHT_PAD = 25; // room for the last time label when there is no right axis
// X tick steps in seconds: never below one second, so labels never repeat.
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400];

/** What the plot asks of its owner while it lives. */
export interface IPlotCallbacks {
  /** Top of the y axis, read on every draw. */
  yMax: () => number;
  /** Top of the right (process RSS) axis, read on every draw. */
  rssMax: () => number;
  onCursor: (idx: number | null) => void;
  onDraw: (u: uPlot) => void;
}

interface IStyle {
  fg: string;
  grid: string;
  font: string;
}

function themeOf(node: HTMLElement): IStyle {
  const style = getComputedStyle(node);
  return {
    fg: style.getPropertyValue('--jp-ui-font-color2').trim() || '#616161',
    grid: style.getPropertyValue('--jp-border-color2').trim() || '#e0e0e0',
    font: `10px ${style.getPropertyValue('--jp-ui-font-family').trim() || 'sans-serif'}`
  };
}

/**
 * [top, right, bottom, left] (null = uPlot's own), so both plots of a rank end where the memory
 * plot's area ends: before its RSS axis on CPU (which the panel leaves empty), else RIGHT_PAD.
 */
function padding(rssAxis: boolean, ownsRssAxis: boolean, top: number | null, bottom: number | null): uPlot.Padding {
  const right = rssAxis ? (ownsRssAxis ? 0 : Y_AXIS_SIZE) : RIGHT_PAD;
  return [top, right, bottom, 0];
}

/**
 * Options for one rank's plot. Colours and fonts come from the JupyterLab theme of `node`;
 * the series are, in order: time (seconds since the cell started), the stacked tops (top
 * first), estimate, capacity, process RSS (on its own right axis, which only CPU ranks get).
 */
export function plotOptions(
  node: HTMLElement,
  width: number,
  height: number,
  callbacks: IPlotCallbacks,
  rssAxis: boolean,
  syncKey?: string
): uPlot.Options {
  const { fg, grid, font } = themeOf(node);
  const area = (c: Category): uPlot.Series => ({
    label: c,
    stroke: CATEGORY_COLORS[c],
    fill: CATEGORY_COLORS[c],
    width: 1,
    points: { show: false }
  });
  return {
    width,
    height,
    legend: { show: false },
    padding: padding(rssAxis, true, null, null),
    cursor: { drag: { x: false, y: false }, points: { show: false }, ...(syncKey ? { sync: { key: syncKey } } : {}) },
    scales: {
      x: { time: false },
      y: { range: () => [0, callbacks.yMax()] },
      rss: { range: () => [0, callbacks.rssMax()] }
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
        values: (_u, splits) => splits.map(v => formatElapsed(v))
      },
      {
        stroke: fg,
        font,
        size: Y_AXIS_SIZE,
        space: 24,
        incrs: BYTE_STEPS,
        grid: { stroke: grid, width: 1 },
        ticks: { stroke: grid, width: 1 },
        values: (_u, splits) => splits.map(v => formatBytes(v))
      },
      {
        scale: 'rss',
        side: 1,
        show: rssAxis,
        stroke: RSS_COLOR,
        font,
        size: rssAxis ? Y_AXIS_SIZE : 0,
        space: 24,
        incrs: BYTE_STEPS,
        grid: { show: false },
        ticks: { stroke: grid, width: 1 },
        values: (_u, splits) => splits.map(v => formatBytes(v))
      }
    ],
    // Top of the stack first: each area fills down to zero and the next one covers it.
    series: [
      {},
      ...[...CATEGORIES].reverse().map(area),
      { label: 'estimate', stroke: ESTIMATE_COLOR, width: 1.5, dash: [6, 4], points: { show: false } },
      { label: 'capacity', stroke: CAPACITY_COLOR, width: 1.5, points: { show: false } },
      { label: 'process RSS', scale: 'rss', stroke: RSS_COLOR, width: 1.5, points: { show: false } }
    ],
    hooks: {
      setCursor: [u => callbacks.onCursor(u.cursor.idx ?? null)],
      draw: [u => callbacks.onDraw(u)]
    }
  };
}

/** What the communication panel asks of its owner. */
export interface ICommCallbacks {
  /** Top of the rate axis (bytes/s), read on every draw. */
  yMax: () => number;
  onCursor: (idx: number | null) => void;
}

/**
 * The panel under a rank's memory plot: bytes sent per second as a filled step area. Its
 * series holds, at row k, the rate of the interval from row k to row k+1 (stepData), drawn
 * "step after", so each interval's average covers exactly that interval. No time labels (the
 * memory plot has them); the same left axis width and right edge as the memory plot.
 */
export function commPlotOptions(
  node: HTMLElement,
  width: number,
  height: number,
  callbacks: ICommCallbacks,
  rssAxis: boolean,
  syncKey?: string
): uPlot.Options {
  const { fg, grid, font } = themeOf(node);
  return {
    width,
    height,
    legend: { show: false },
    padding: padding(rssAxis, false, 6, 2), // no time labels: little room above and below
    cursor: { drag: { x: false, y: false }, points: { show: false }, ...(syncKey ? { sync: { key: syncKey } } : {}) },
    scales: {
      x: { time: false },
      y: { range: () => [0, callbacks.yMax()] }
    },
    axes: [
      {
        size: 0, // grid lines at the memory plot's time ticks, no labels
        space: 70,
        incrs: TIME_STEPS,
        grid: { stroke: grid, width: 1 },
        ticks: { show: false },
        values: (_u, splits) => splits.map(() => '')
      },
      {
        stroke: fg,
        font,
        size: Y_AXIS_SIZE,
        gap: 3,
        splits: (_u, _axis, _min, max) => rateTick(max),
        grid: { stroke: grid, width: 1 },
        ticks: { stroke: grid, width: 1, size: 4 },
        values: (_u, splits) => splits.map(v => formatRate(v))
      }
    ],
    series: [
      {},
      {
        label: 'sent/s',
        stroke: SENT_COLOR,
        fill: SENT_FILL,
        width: 1,
        points: { show: false },
        paths: uPlot.paths.stepped!({ align: 1, alignGaps: 1 })
      }
    ],
    hooks: {
      setCursor: [u => callbacks.onCursor(u.cursor.idx ?? null)]
    }
  };
}

/** The one labelled line a 50 px panel has room for: the largest round rate under the axis top. */
export function rateTick(top: number): number[] {
  const step = [...RATE_STEPS].reverse().find(v => v <= top * 0.8);
  return step === undefined ? [] : [step];
}

/** 1536 -> "1.50 KiB/s". */
export function formatRate(bytesPerSecond: number): string {
  return Number.isFinite(bytesPerSecond) ? `${formatBytes(bytesPerSecond)}/s` : '—';
}

/**
 * Per-row interval rates (value at k = the interval ending at row k, NaN = none) as uPlot
 * "step after" data: value at k = the interval starting at row k, null = a gap. The last row
 * repeats the one before it, so the last interval reaches the right edge.
 */
export function stepData(rate: ArrayLike<number>): (number | null)[] {
  const n = rate.length;
  const out: (number | null)[] = new Array(n);
  for (let k = 0; k < n - 1; k++) {
    const v = rate[k + 1];
    out[k] = Number.isFinite(v) ? v : null;
  }
  if (n > 0) {
    out[n - 1] = n > 1 ? out[n - 2] : null;
  }
  return out;
}
