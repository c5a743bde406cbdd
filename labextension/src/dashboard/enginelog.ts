/**
 * The `log` reply of the `mpnb.dashboard` comm: the end of one rank's engine log
 * (compiler and library output kept out of cells). Pure, so it is unit-tested without a browser.
 */

/** Lines the log panel asks for (the kernel caps what it sends). */
export const LOG_LINES = 200;

export interface IEngineLog {
  id: string;
  rank: number;
  /** The log file on the rank's host ("" when the kernel has none for the rank). */
  path: string;
  text: string;
  /** Why there is no log ("" when there is one). */
  error: string;
}

/** A `{"type": "log", ...}` comm message, or null for anything else. */
export function parseLogReply(data: unknown): IEngineLog | null {
  if (!data || typeof data !== 'object') {
    return null;
  }
  const v = data as Record<string, unknown>;
  if (v.type !== 'log' || typeof v.id !== 'string') {
    return null;
  }
  const str = (x: unknown): string => (typeof x === 'string' ? x : '');
  return { id: v.id, rank: Number(v.rank), path: str(v.path), text: str(v.text), error: str(v.error) };
}

/** The main-area tab's title. */
export function logTitle(rank: number): string {
  return `mpnb log · rank ${rank}`;
}

/** What the panel's <pre> shows: the log's end, or why there is nothing. */
export function logBody(reply: IEngineLog): string {
  if (reply.error) {
    return reply.error;
  }
  if (!reply.text) {
    return (
      'Nothing logged yet (or the log is on the rank’s own host, out of this kernel’s reach).\n' +
      'Compiler, linker and library output of this rank goes here instead of the notebook.'
    );
  }
  return reply.text;
}
