/** Small DOM builders shared by the sidebar and the `%%distributed` cell badges. */

/** One chip per rank with its state in the distributed cell ("0: running"), sorted by rank. */
export function rankChips(ranks: Record<string, string>): HTMLElement {
  const chips = el('span', 'mpnb-rank-chips');
  for (const rank of Object.keys(ranks).sort((a, b) => Number(a) - Number(b))) {
    const chip = el('span', `mpnb-chip mpnb-status-${ranks[rank]}`, `${rank}: ${ranks[rank]}`);
    chip.dataset.rank = rank;
    chip.title = `rank ${rank}: ${ranks[rank]}`;
    chips.append(chip);
  }
  return chips;
}

/** "ZeRO-2 · mb 8 × accum 1" with no-break spaces inside items: a line wraps only at " · ". */
export function wholeItems(line: string): string {
  return line
    .split(' · ')
    .map(item => item.replace(/ /g, '\u00a0'))
    .join(' · ');
}

/** A muted paragraph: what the sidebar says when there is nothing to show. */
export function note(text: string): HTMLElement {
  return el('p', 'mpnb-note', text);
}

/** `<tag class="cls">text</tag>` */
export function el(tag: string, cls?: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}
