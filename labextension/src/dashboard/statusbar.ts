/** Status bar item "mpnb · 2 ranks · ZeRO-2 · running"; clicking opens the sidebar. */
import type { IStatusBar } from '@jupyterlab/statusbar';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { mpnbIcon } from './icons';
import { ConnectionRegistry } from './registry';
import { statusText } from './summary';

export class StatusItem extends Widget {
  private _text: string | null = null;
  private _label: HTMLSpanElement;
  private _activeChanged = new Signal<this, void>(this);

  constructor(
    private _registry: ConnectionRegistry,
    onClick: () => void
  ) {
    super();
    this.addClass('mpnb-status-item');
    this.addClass('jp-StatusBar-GroupItem');
    const icon = mpnbIcon.element({ tag: 'span', className: 'mpnb-status-icon' });
    this._label = document.createElement('span');
    this._label.className = 'mpnb-status-text jp-StatusBar-TextItem';
    this.node.append(icon, this._label);
    this.node.title = 'Open the Distributed sidebar';
    this.node.onclick = onClick;
    _registry.currentChanged.connect(() => this._update());
    _registry.currentStateChanged.connect(() => this._update());
    this._update();
  }

  /** The text shown, or null when hidden. */
  get text(): string | null {
    return this._text;
  }

  get activeChanged(): ISignal<this, void> {
    return this._activeChanged;
  }

  private _update(): void {
    const state = this._registry.current?.state;
    const text = state ? statusText(state) : null;
    if (text !== this._text) {
      const wasActive = this._text !== null;
      this._text = text;
      this._label.textContent = text ?? '';
      if (wasActive !== (text !== null)) {
        this._activeChanged.emit();
      }
    }
  }
}

/** Show the item on the left of JupyterLab's status bar while mpnb is loaded in the current kernel. */
export function addStatusItem(statusBar: IStatusBar, registry: ConnectionRegistry, onClick: () => void): void {
  const item = new StatusItem(registry, onClick);
  statusBar.registerStatusItem('mpnb:status', {
    item,
    align: 'left',
    rank: 4,
    isActive: () => item.text !== null,
    activeStateChanged: item.activeChanged
  });
}
