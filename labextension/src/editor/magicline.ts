/** Recognising `%%distributed` cells: pure, shared by the cell marker and the editor decoration. */

/** IPython only honours a cell magic on the cell's first non-blank line, unindented. */
export const DISTRIBUTED_MAGIC = /^%%distributed(\s|$)/;

/** True when the cell's first non-blank line is the `%%distributed` cell magic. */
export function isDistributedSource(source: string): boolean {
  for (const line of source.split('\n')) {
    if (line.trim() !== '') {
      return DISTRIBUTED_MAGIC.test(line);
    }
  }
  return false;
}
