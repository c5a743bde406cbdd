/** What one rank's uPlot looks like: axes, tick steps, the stacked areas and the reference lines. */
import uPlot from 'uplot';

import { formatBytes, formatElapsed } from './format';
import { CATEGORIES, Category } from './history';
import { CAPACITY_COLOR, CATEGORY_COLORS, ESTIMATE_COLOR, RSS_COLOR } from './legend';

// Y tick steps: 1, 2, 5 x 10^k of KiB, MiB, GiB, TiB, so ticks read "200 MiB", not "954 MiB".
const BYTE_STEPS = [2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40].flatMap(unit =>
  [1, 2, 5, 10, 20, 50, 100, 200, 500].map(m => m * unit)
);
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
  rssAxis: boolean
): uPlot.Options {
  const style = getComputedStyle(node);
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
  return {
    width,
    height,
    legend: { show: false },
    cursor: { drag: { x: false, y: false }, points: { show: false } },
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
        size: 58,
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
        size: rssAxis ? 58 : 0,
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
