/**
 * One DashboardConnection per open notebook, and which one is current.
 * The sidebar and the status bar follow the current notebook; the cell
 * markers follow their own notebook.
 */
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ISignal, Signal } from '@lumino/signaling';

import { DashboardConnection } from './connection';
import { IDashboardState } from './state';

export class ConnectionRegistry {
  private _connections = new Map<NotebookPanel, DashboardConnection>();
  private _current: DashboardConnection | null = null;
  private _currentChanged = new Signal<this, DashboardConnection | null>(this);
  private _currentStateChanged = new Signal<this, IDashboardState>(this);
  private _added = new Signal<this, { panel: NotebookPanel; connection: DashboardConnection }>(this);

  constructor(readonly tracker: INotebookTracker) {
    tracker.widgetAdded.connect((_, panel) => this._add(panel));
    tracker.forEach(panel => this._add(panel));
    tracker.currentChanged.connect(() => this._setCurrent());
    this._setCurrent();
  }

  /** The current notebook's connection (the last notebook focused). */
  get current(): DashboardConnection | null {
    return this._current;
  }

  get currentPanel(): NotebookPanel | null {
    return this.tracker.currentWidget;
  }

  get currentChanged(): ISignal<this, DashboardConnection | null> {
    return this._currentChanged;
  }

  /** State changes of whichever connection is current. */
  get currentStateChanged(): ISignal<this, IDashboardState> {
    return this._currentStateChanged;
  }

  get added(): ISignal<this, { panel: NotebookPanel; connection: DashboardConnection }> {
    return this._added;
  }

  get(panel: NotebookPanel): DashboardConnection | undefined {
    return this._connections.get(panel);
  }

  private _add(panel: NotebookPanel): void {
    if (this._connections.has(panel)) {
      return;
    }
    const connection = new DashboardConnection(panel.sessionContext);
    this._connections.set(panel, connection);
    connection.stateChanged.connect((_, state) => {
      if (connection === this._current) {
        this._currentStateChanged.emit(state);
      }
    });
    panel.disposed.connect(() => {
      this._connections.delete(panel);
      connection.dispose();
      if (this._current === connection) {
        this._setCurrent();
      }
    });
    this._added.emit({ panel, connection });
    if (this.tracker.currentWidget === panel) {
      this._setCurrent();
    }
  }

  private _setCurrent(): void {
    const panel = this.tracker.currentWidget;
    const next = panel ? (this._connections.get(panel) ?? null) : null;
    if (next !== this._current) {
      this._current = next;
      this._currentChanged.emit(next);
    }
  }
}
