/**
 * The sidebar's "Checkpoints" section: what `trainer.save(path)` wrote in this session, newest
 * first. `checkpointRows` decides what each row says (pure, unit-tested); `checkpointSection`
 * builds the DOM from it.
 */
import { formatBytes, formatClock } from '../chart/format';
import { el, note } from './dom';
import { ICheckpoint } from './state';

export const CHECKPOINTS_HEADING = 'Checkpoints';
export const NO_CHECKPOINTS = 'No checkpoint saved in this session — trainer.save(path) writes one';
/** Rows shown; older checkpoints are counted below the table (the kernel keeps them all). */
export const MAX_ROWS = 10;

/** One table row, as text. */
export interface ICheckpointRow {
  /** The directory's own name ("step-40"); the full path is `path`, shown on hover. */
  name: string;
  path: string;
  step: string;
  /** Strategy × world size: "ZeRO-2 × 2". */
  layout: string;
  layoutTitle: string;
  size: string;
  sizeTitle: string;
  /** When the save finished, "14:03:07"; the date and the save's duration on hover. */
  saved: string;
  savedTitle: string;
}

/** "/runs/exp1/step-40/" -> "step-40" (a Windows path too). */
export function baseName(path: string): string {
  const trimmed = path.replace(/[\\/]+$/, '');
  return trimmed.split(/[\\/]/).pop() || path;
}

/** The rows newest first: by finishing time, and for equal times the one the kernel listed last. */
export function checkpointRows(checkpoints: ICheckpoint[]): ICheckpointRow[] {
  return checkpoints
    .map((c, i) => ({ c, i }))
    .sort((a, b) => b.c.t - a.c.t || b.i - a.i)
    .map(({ c }) => {
      const strategy = c.label || c.strategy || '?';
      const ranks = `${c.worldSize} rank${c.worldSize === 1 ? '' : 's'}`;
      const took = c.seconds === null ? '' : ` in ${c.seconds < 10 ? c.seconds.toFixed(2) : c.seconds.toFixed(0)} s`;
      return {
        name: baseName(c.path),
        path: c.path,
        step: String(c.step),
        layout: `${strategy} × ${c.worldSize}`,
        layoutTitle: `written under ${strategy} by ${ranks}`,
        size: formatBytes(c.bytes),
        sizeTitle: `${c.bytes.toLocaleString('en-US')} bytes on disk, all ranks' files`,
        saved: formatClock(c.t),
        savedTitle: `saved ${new Date(c.t * 1000).toLocaleString()}${took}`
      };
    });
}

/**
 * The heading and either the list or the empty state's note. Two lines a checkpoint, not a table:
 * the sidebar is ~260 px wide, and a five-column table left the name no room.
 *   step-40                     14:03:07
 *   step 40 · ZeRO-2 × 2 · 3.20 MiB
 */
export function checkpointSection(checkpoints: ICheckpoint[]): HTMLElement[] {
  const heading = el('h3', 'mpnb-sidebar-section', CHECKPOINTS_HEADING);
  const box = el('div', 'mpnb-checkpoints');
  const all = checkpointRows(checkpoints);
  const rows = all.slice(0, MAX_ROWS);
  if (rows.length === 0) {
    box.append(note(NO_CHECKPOINTS));
    return [heading, box];
  }
  for (const r of rows) {
    const row = el('div', 'mpnb-checkpoint-row');
    row.dataset.path = r.path;
    const top = el('div', 'mpnb-checkpoint-top');
    const name = el('span', 'mpnb-checkpoint-name', r.name);
    name.title = r.path;
    top.append(name, titled(el('span', 'mpnb-checkpoint-saved', r.saved), r.savedTitle));
    const details = el('div', 'mpnb-checkpoint-details');
    // Each item stays whole; the line wraps only between them.
    details.append(
      el('span', 'mpnb-checkpoint-step', `step\u00a0${r.step}`),
      document.createTextNode(' · '),
      titled(el('span', 'mpnb-checkpoint-layout', r.layout.replace(/ /g, '\u00a0')), r.layoutTitle),
      document.createTextNode(' · '),
      titled(el('span', 'mpnb-checkpoint-size', r.size.replace(/ /g, '\u00a0')), r.sizeTitle)
    );
    row.append(top, details);
    box.append(row);
  }
  const older = all.length - rows.length;
  if (older > 0) {
    box.append(note(`and ${older} older checkpoint${older === 1 ? '' : 's'}`));
  }
  return [heading, box];
}

function titled(node: HTMLElement, title: string): HTMLElement {
  node.title = title;
  return node;
}
