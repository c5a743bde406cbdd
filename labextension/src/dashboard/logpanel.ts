/**
 * A read-only main-area tab with the end of one rank's engine log, fetched over the
 * `mpnb.dashboard` comm (the files are private and outside the notebook root, so the
 * file browser cannot open them).
 */
import { Widget } from '@lumino/widgets';

import { DashboardConnection } from './connection';
import { el } from './dom';
import { LOG_LINES, logBody, logTitle } from './enginelog';
import { mpnbIcon } from './icons';

export class EngineLogPanel extends Widget {
  private _path: HTMLElement;
  private _text: HTMLElement;

  constructor(
    readonly connection: DashboardConnection,
    readonly rank: number
  ) {
    super();
    this.id = engineLogPanelId(connection, rank);
    this.addClass('mpnb-log-panel');
    this.title.label = logTitle(rank);
    this.title.icon = mpnbIcon;
    this.title.closable = true;
    const bar = el('div', 'mpnb-log-bar');
    this._path = el('span', 'mpnb-log-path');
    const refresh = el('button', 'jp-Button jp-mod-styled mpnb-button mpnb-log-refresh', 'Refresh');
    refresh.onclick = () => void this.refresh();
    bar.append(this._path, refresh);
    this._text = el('pre', 'mpnb-log-text');
    this.node.append(bar, this._text);
  }

  /** Fetch the log's last LOG_LINES lines again and show them, scrolled to the end. */
  async refresh(): Promise<void> {
    this._text.textContent = 'Loading…';
    try {
      const reply = await this.connection.requestLog(this.rank, LOG_LINES);
      this._path.textContent = reply.path ? `last ${LOG_LINES} lines of ${reply.path}` : '';
      this._text.textContent = logBody(reply);
    } catch (e) {
      this._text.textContent = (e as Error).message;
    }
    this.node.scrollTop = this.node.scrollHeight;
  }
}

/** One tab per kernel and rank: opening it again refreshes that tab. */
export function engineLogPanelId(connection: DashboardConnection, rank: number): string {
  return `mpnb-engine-log-${connection.kernel?.id ?? 'none'}-${rank}`;
}
