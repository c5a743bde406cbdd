/**
 * The "Distributed" sidebar: the current notebook's cluster (ranks, strategy,
 * last distributed cell or `%mpnb run` script, checkpoints saved in this session)
 * and its live per-rank memory chart.
 */
import type { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { MemoryChart } from '../chart/chart';
import { checkpointSection } from './checkpoints';
import { CommandIDs } from './commands';
import { DashboardConnection } from './connection';
import { el, note, rankChips, wholeItems } from './dom';
import { mpnbIcon } from './icons';
import { ConnectionRegistry } from './registry';
import { IDashboardState } from './state';
import { activity, lastRun } from './summary';

export const SIDEBAR_ID = 'mpnb-distributed-sidebar';

export class DistributedSidebar extends Widget {
  private _connection: DashboardConnection | null = null;
  private _chart: MemoryChart | null = null;
  private _notebookLabel: HTMLElement;
  private _stateNode: HTMLElement;
  private _memoryNode: HTMLElement;
  private _chartHost: HTMLElement;
  private _checkpointsNode: HTMLElement;

  constructor(
    private _commands: CommandRegistry,
    private _registry: ConnectionRegistry
  ) {
    super();
    this.id = SIDEBAR_ID;
    this.addClass('mpnb-sidebar');
    this.title.icon = mpnbIcon;
    this.title.caption = 'Distributed';
    const header = el('div', 'mpnb-sidebar-header');
    header.append(el('h2', 'mpnb-sidebar-title', 'Distributed'));
    this._notebookLabel = el('div', 'mpnb-sidebar-notebook');
    header.append(this._notebookLabel);
    this._stateNode = el('div', 'mpnb-sidebar-state');
    this._memoryNode = el('div', 'mpnb-sidebar-memory');
    this._memoryNode.append(el('h3', 'mpnb-sidebar-section', 'Memory per rank'));
    this._chartHost = el('div', 'mpnb-sidebar-chart');
    this._memoryNode.append(this._chartHost);
    // Below the chart: a run that saves every K steps grows this list, and the chart stays in place.
    this._checkpointsNode = el('div', 'mpnb-sidebar-checkpoints');
    this.node.append(header, this._stateNode, this._memoryNode, this._checkpointsNode);
    _registry.currentChanged.connect((_, connection) => this.setConnection(connection));
    _registry.currentStateChanged.connect(() => this._render());
    this.setConnection(_registry.current);
  }

  setConnection(connection: DashboardConnection | null): void {
    if (connection === this._connection && (connection === null || this._chart)) {
      this._render();
      return;
    }
    this._chart?.dispose();
    this._chart = null;
    this._connection = connection;
    if (connection) {
      this._chart = new MemoryChart(connection.history, { plotHeight: 120 });
      this._chartHost.append(this._chart.node);
    }
    this._render();
  }

  protected onAfterShow(): void {
    this._chart?.requestDraw();
  }

  private _render(): void {
    const panel = this._registry.currentPanel;
    this._notebookLabel.textContent = panel ? panel.context.path : 'No notebook open';
    const state = this._connection?.state ?? null;
    this._stateNode.replaceChildren(...this._sections(state));
    const cluster = state?.connection === 'connected' ? state.cluster : null;
    this._memoryNode.style.display = cluster ? '' : 'none';
    this._checkpointsNode.replaceChildren(...(cluster && state ? checkpointSection(state.checkpoints) : []));
    this._chart?.setRanks(cluster ? cluster.ranks.map(r => r.rank) : []);
    this.node.dataset.connection = state?.connection ?? 'none';
  }

  private _sections(state: IDashboardState | null): HTMLElement[] {
    if (!state) {
      return [note('Open a notebook to see its cluster.')];
    }
    switch (state.connection) {
      case 'no-kernel':
        return [note('This notebook has no running kernel.')];
      case 'connecting':
        return [note('Connecting to the kernel…')];
      case 'unavailable':
        return [this._howToStart(true)];
      default:
        break;
    }
    if (!state.cluster) {
      return [this._howToStart(false)];
    }
    const cluster = state.cluster;
    const out: HTMLElement[] = [];

    const summary = el('div', 'mpnb-sidebar-summary');
    summary.append(
      // "sleep.py running" stays on one line: the line wraps between items only.
      el(
        'span',
        'mpnb-sidebar-activity',
        wholeItems(`${cluster.world_size} ranks · ${cluster.backend} · ${activity(state)}`)
      )
    );
    out.push(summary);
    const strategy = el('div', 'mpnb-strategy');
    strategy.append(
      el('span', 'mpnb-label', 'Strategy '),
      el('span', 'mpnb-strategy-line', wholeItems(state.strategy) || '—')
    );
    out.push(strategy);
    out.push(this._buttons());

    const table = el('table', 'mpnb-ranks');
    const head = el('tr');
    for (const name of ['rank', 'host', 'device', 'state', '']) {
      head.append(el('th', undefined, name));
    }
    table.append(head);
    for (const r of cluster.ranks) {
      const row = el('tr', 'mpnb-rank-row');
      row.dataset.rank = String(r.rank);
      const stateText = !r.alive ? 'down' : r.busy ? 'busy' : 'idle';
      row.classList.add(`mpnb-rank-${stateText}`);
      const dot = el('span', 'mpnb-dot');
      const cell = el('td', 'mpnb-rank-state');
      cell.append(dot, document.createTextNode(stateText));
      row.append(el('td', undefined, String(r.rank)), el('td', undefined, r.host), el('td', undefined, r.device), cell);
      row.append(this._logLink(r.rank));
      row.title = r.pid === null ? '' : `pid ${r.pid}`;
      table.append(row);
    }
    out.push(table);

    if (!state.cell) {
      out.push(el('h3', 'mpnb-sidebar-section', 'Last distributed cell'));
      out.push(note('No distributed cell has run yet.'));
    } else {
      // A script (`%mpnb run train.py`) shows like a cell, led by its file name.
      const run = lastRun(state.cell);
      out.push(el('h3', 'mpnb-sidebar-section', run.heading));
      const cellNode = el('div', `mpnb-last-cell mpnb-status-${state.cell.status}`);
      cellNode.title = run.title;
      if (run.label) {
        cellNode.classList.add('mpnb-last-script');
        cellNode.append(el('span', 'mpnb-last-cell-label', run.label));
      }
      cellNode.append(el('span', 'mpnb-last-cell-status', state.cell.status));
      cellNode.append(rankChips(state.cell.ranks));
      out.push(cellNode);
    }
    return out;
  }

  private _howToStart(notLoaded: boolean): HTMLElement {
    const box = el('div', 'mpnb-sidebar-empty');
    box.append(
      el(
        'p',
        undefined,
        notLoaded ? 'mpnb is not loaded in this notebook’s kernel.' : 'No cluster is running in this kernel.'
      ),
      el('p', undefined, 'Start one from a cell:'),
      el('pre', 'mpnb-code', notLoaded ? '%load_ext mpnb\n%mpnb start' : '%mpnb start'),
      el('p', undefined, 'or with the button (one engine per GPU; 2 CPU engines without GPUs):')
    );
    box.append(this._button(CommandIDs.start, 'Start cluster', 'mpnb-start-button jp-mod-styled jp-mod-accept'));
    return box;
  }

  private _buttons(): HTMLElement {
    const bar = el('div', 'mpnb-sidebar-buttons');
    bar.append(
      this._button(CommandIDs.stopRanks, 'Stop ranks', 'mpnb-stop-ranks-button jp-mod-styled jp-mod-warn'),
      this._button(CommandIDs.restart, 'Restart', 'mpnb-restart-button jp-mod-styled jp-mod-reject'),
      this._button(CommandIDs.stop, 'Stop cluster', 'mpnb-stop-button jp-mod-styled jp-mod-reject'),
      this._button(CommandIDs.configPanel, 'Config panel', 'mpnb-config-button jp-mod-styled jp-mod-reject')
    );
    return bar;
  }

  /** Opens the end of the rank's engine log (where compiler and library output goes) in a tab. */
  private _logLink(rank: number): HTMLElement {
    const cell = el('td', 'mpnb-rank-log');
    const link = el('button', 'mpnb-log-link', 'log') as HTMLButtonElement;
    link.title = this._commands.caption(CommandIDs.engineLog, { rank });
    link.onclick = () => void this._commands.execute(CommandIDs.engineLog, { rank });
    cell.append(link);
    return cell;
  }

  private _button(command: string, label: string, cls: string): HTMLButtonElement {
    const button = el('button', `jp-Button mpnb-button ${cls}`, label) as HTMLButtonElement;
    button.title = this._commands.caption(command);
    button.onclick = () => void this._commands.execute(command);
    return button;
  }
}
