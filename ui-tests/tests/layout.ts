/**
 * Layout checks the browser tests share: measured in the page from the rendered boxes, so they
 * fail when something covers code, cuts a label or splits a number from its unit.
 */
import type { Locator } from '@playwright/test';

/** How far (px) the rank badge of `cell` reaches into its code editor; 0 when clear of it. */
export async function badgeOverlap(cell: Locator): Promise<number> {
  return cell.evaluate(node => {
    const badge = node.querySelector('.mpnb-cell-ranks');
    const editor = node.querySelector('.jp-InputArea-editor');
    if (!badge || !editor) {
      return -1;
    }
    const a = badge.getBoundingClientRect();
    const b = editor.getBoundingClientRect();
    const dx = Math.min(a.right, b.right) - Math.max(a.left, b.left);
    const dy = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
    return dx > 0 && dy > 0 ? Math.min(dx, dy) : 0;
  });
}

/**
 * The visible labels under `root` matching `selector` that do not show whole: text wider than
 * its box (an ellipsis or a clip), or a box reaching past `clipSelector`'s (e.g. the tab bar).
 */
export async function cutLabels(root: Locator, selector: string, clipSelector?: string): Promise<string[]> {
  return root.evaluate(
    (node, { selector, clipSelector }) => {
      const cut: string[] = [];
      for (const label of Array.from(node.querySelectorAll<HTMLElement>(selector))) {
        const box = label.getBoundingClientRect();
        if (box.width === 0 || box.height === 0) {
          continue; // hidden (another tab, a collapsed box)
        }
        const clip = clipSelector ? label.closest(clipSelector)?.getBoundingClientRect() : undefined;
        const pastClip = clip !== undefined && (box.right > clip.right + 0.5 || box.left < clip.left - 0.5);
        if (label.scrollWidth > label.clientWidth + 1 || pastClip) {
          cut.push(`${(label.textContent ?? '').trim()} (${label.scrollWidth}px text in ${label.clientWidth}px)`);
        }
      }
      return cut;
    },
    { selector, clipSelector }
  );
}

/**
 * Items of a " · "-separated line (e.g. "used 1.2 GiB · peak 1.3 GiB · est 7.83 MiB") that a
 * line break splits, e.g. "7.83" at the end of one line and "MiB" on the next.
 */
export async function splitItems(line: Locator): Promise<string[]> {
  return line.evaluate(node => {
    const text = node.firstChild;
    if (!text || text.nodeType !== Node.TEXT_NODE) {
      return [];
    }
    const value = text.textContent ?? '';
    const split: string[] = [];
    let start = 0;
    for (const item of value.split(' · ')) {
      const range = document.createRange();
      range.setStart(text, start);
      range.setEnd(text, start + item.length);
      const tops = new Set(Array.from(range.getClientRects()).map(r => Math.round(r.top)));
      if (tops.size > 1) {
        split.push(item);
      }
      start += item.length + ' · '.length;
    }
    return split;
  });
}
