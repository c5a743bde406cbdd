/** The notebook toolbar's "mpnb" button: opens a menu of the cluster commands. */
import type { JupyterFrontEnd } from '@jupyterlab/application';
import type { NotebookPanel } from '@jupyterlab/notebook';
import { ToolbarButton } from '@jupyterlab/ui-components';
import { DisposableDelegate } from '@lumino/disposable';
import { Menu } from '@lumino/widgets';

import { CommandIDs } from './commands';
import { mpnbIcon } from './icons';

const MENU_COMMANDS = [
  CommandIDs.start,
  CommandIDs.restart,
  CommandIDs.stop,
  CommandIDs.stopRanks,
  CommandIDs.configPanel,
  CommandIDs.dashboard
];

export function addToolbarButton(app: JupyterFrontEnd): void {
  const menu = new Menu({ commands: app.commands });
  menu.addClass('mpnb-toolbar-menu');
  for (const command of MENU_COMMANDS) {
    menu.addItem({ command });
  }
  app.docRegistry.addWidgetExtension('Notebook', {
    createNew: (panel: NotebookPanel) => {
      const button = new ToolbarButton({
        icon: mpnbIcon,
        label: 'mpnb',
        className: 'mpnb-toolbar-button',
        tooltip: 'mpnb cluster: start, stop, restart, stop ranks, config panel, dashboard',
        onClick: () => {
          const rect = button.node.getBoundingClientRect();
          menu.open(rect.left, rect.bottom);
        }
      });
      panel.toolbar.insertAfter('cellType', 'mpnb', button);
      return new DisposableDelegate(() => button.dispose());
    }
  });
}
