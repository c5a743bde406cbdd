/**
 * Marks `%%distributed` cells (class on the cell, the magic line highlighted by
 * highlight.ts) and shows which ranks of the running one (or of a `%mpnb run` script) are still busy.
 */
import { Cell } from '@jupyterlab/cells';
import { NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { IDisposable } from '@lumino/disposable';

import { DashboardConnection } from '../dashboard/connection';
import { rankChips } from '../dashboard/dom';
import { ConnectionRegistry } from '../dashboard/registry';
import { isDistributedSource } from './magicline';

export const DISTRIBUTED_CELL_CLASS = 'mpnb-distributed-cell';
const BADGE_CLASS = 'mpnb-cell-ranks';

export class DistributedCellMarker implements IDisposable {
  private _frame = 0;
  private _lastCell: Cell | null = null;
  private _disposed = false;

  constructor(
    private _panel: NotebookPanel,
    private _connection: DashboardConnection
  ) {
    const notebook = _panel.content;
    notebook.modelContentChanged.connect(this._schedule, this);
    notebook.modelChanged.connect(this._schedule, this);
    _connection.stateChanged.connect(this._schedule, this);
    NotebookActions.executionScheduled.connect(this._onScheduled, this);
    _panel.disposed.connect(() => this.dispose());
    this._schedule();
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    if (this._frame) {
      cancelAnimationFrame(this._frame);
    }
    NotebookActions.executionScheduled.disconnect(this._onScheduled, this);
    this._connection.stateChanged.disconnect(this._schedule, this);
  }

  private _onScheduled(_: unknown, args: { notebook: unknown; cell: Cell }): void {
    if (args.notebook === this._panel.content && isDistributedSource(args.cell.model.sharedModel.getSource())) {
      this._lastCell = args.cell;
    }
  }

  private _schedule(): void {
    if (!this._frame && !this._disposed) {
      this._frame = requestAnimationFrame(() => {
        this._frame = 0;
        this._update();
      });
    }
  }

  private _update(): void {
    if (this._disposed) {
      return;
    }
    const state = this._connection.state;
    const cellState = state.connection === 'connected' ? state.cell : null;
    let target: Cell | null = null;
    for (const cell of this._panel.content.widgets) {
      const distributed = cell.model.type === 'code' && isDistributedSource(cell.model.sharedModel.getSource());
      cell.toggleClass(DISTRIBUTED_CELL_CLASS, distributed);
      // A script's state (`%mpnb run`, labelled) belongs to the plain cell that ran it.
      const runsIt = distributed || (!!cellState?.label && cell.model.type === 'code');
      if (runsIt && cellState?.notebookCellId && cell.model.id === cellState.notebookCellId) {
        target = cell;
      }
    }
    if (!target && cellState && !cellState.label && this._lastCell && !this._lastCell.isDisposed) {
      target = this._lastCell;
    }
    for (const cell of this._panel.content.widgets) {
      const badge = cell.node.querySelector(`.${BADGE_CLASS}`);
      if (cell !== target) {
        badge?.remove();
        cell.toggleClass('mpnb-mod-ranks-busy', false);
      }
    }
    if (target && cellState) {
      const busy = Object.values(cellState.ranks).filter(s => s === 'running').length;
      const badge = document.createElement('div');
      badge.className = `${BADGE_CLASS} mpnb-status-${cellState.status}`;
      const label = document.createElement('span');
      label.className = 'mpnb-cell-ranks-label';
      label.textContent =
        cellState.status === 'running' ? `${busy} rank${busy === 1 ? '' : 's'} busy` : cellState.status;
      badge.append(label, rankChips(cellState.ranks));
      // A row of its own under the input, not over it: the chips never cover the code.
      target.node.querySelector(`.${BADGE_CLASS}`)?.remove();
      const input = target.node.querySelector(':scope > .jp-Cell-inputWrapper');
      target.node.insertBefore(badge, input ? input.nextSibling : null);
      target.toggleClass('mpnb-mod-ranks-busy', cellState.status === 'running');
    }
  }
}

/** One marker per notebook the registry follows: those open now and those opened later. */
export function markDistributedCells(registry: ConnectionRegistry): void {
  registry.added.connect((_, { panel, connection }) => new DistributedCellMarker(panel, connection));
  registry.tracker.forEach(panel => {
    const connection = registry.get(panel);
    if (connection) {
      new DistributedCellMarker(panel, connection);
    }
  });
}
