/**
 * mpnb's JupyterLab extension: the Distributed sidebar, the status bar item,
 * the commands (palette + notebook toolbar), `%%distributed` cell marking, and
 * the front end of the `mpnb.memory.MemoryChart` widget.
 */
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { EditorExtensionRegistry, IEditorExtensionRegistry } from '@jupyterlab/codemirror';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ToolbarButton } from '@jupyterlab/ui-components';
import { IJupyterWidgetRegistry } from '@jupyter-widgets/base';
import { DisposableDelegate } from '@lumino/disposable';
import { Menu } from '@lumino/widgets';

import { BENCHMARK_COMMAND, runChartBenchmark } from './benchmark';
import { DistributedCellMarker } from './cells';
import { addCommands, CommandIDs, PALETTE_CATEGORY } from './commands';
import { mpnbIcon } from './icons';
import { distributedMagicLine } from './magic';
import { ConnectionRegistry } from './registry';
import { DistributedSidebar, SIDEBAR_ID } from './sidebar';
import { StatusItem } from './statusbar';
import { MemoryChartModel, MemoryChartView, MODULE_NAME, MODULE_VERSION } from './widget';

const dashboardPlugin: JupyterFrontEndPlugin<void> = {
  id: 'mpnb:dashboard',
  description: 'Distributed sidebar, status bar item and commands for the notebook’s mpnb cluster.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ICommandPalette, IStatusBar, ILabShell],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    palette: ICommandPalette | null,
    statusBar: IStatusBar | null
  ) => {
    const registry = new ConnectionRegistry(tracker);
    addCommands(app, registry, SIDEBAR_ID);
    app.commands.addCommand(BENCHMARK_COMMAND, {
      label: 'mpnb: chart benchmark (tests)',
      execute: args => runChartBenchmark(app, args) as any
    });

    const sidebar = new DistributedSidebar(app.commands, registry);
    app.shell.add(sidebar, 'right', { rank: 200 });

    registry.added.connect((_, { panel, connection }) => new DistributedCellMarker(panel, connection));
    tracker.forEach(panel => {
      const connection = registry.get(panel);
      if (connection) {
        new DistributedCellMarker(panel, connection);
      }
    });

    if (palette) {
      for (const command of Object.values(CommandIDs)) {
        palette.addItem({ command, category: PALETTE_CATEGORY });
      }
    }

    if (statusBar) {
      const item = new StatusItem(registry, () => app.shell.activateById(SIDEBAR_ID));
      statusBar.registerStatusItem('mpnb:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => item.text !== null,
        activeStateChanged: item.activeChanged
      });
    }

    // Notebook toolbar: one "mpnb" button opening a menu of the commands.
    const menu = new Menu({ commands: app.commands });
    menu.addClass('mpnb-toolbar-menu');
    for (const command of [
      CommandIDs.start,
      CommandIDs.restart,
      CommandIDs.stop,
      CommandIDs.stopRanks,
      CommandIDs.configPanel,
      CommandIDs.dashboard
    ]) {
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
};

const magicPlugin: JupyterFrontEndPlugin<void> = {
  id: 'mpnb:distributed-magic',
  description: 'Marks the %%distributed line in code cells, keeping Python highlighting.',
  autoStart: true,
  requires: [IEditorExtensionRegistry],
  activate: (_app: JupyterFrontEnd, extensions: IEditorExtensionRegistry) => {
    extensions.addExtension({
      name: 'mpnb:distributed-magic',
      factory: () => EditorExtensionRegistry.createImmutableExtension(distributedMagicLine)
    });
  }
};

const widgetPlugin: JupyterFrontEndPlugin<void> = {
  id: 'mpnb:memory-chart-widget',
  description: 'Front end of the mpnb.memory.MemoryChart ipywidget.',
  autoStart: true,
  requires: [IJupyterWidgetRegistry],
  activate: (_app: JupyterFrontEnd, widgets: IJupyterWidgetRegistry) => {
    widgets.registerWidget({
      name: MODULE_NAME,
      version: MODULE_VERSION,
      exports: { MemoryChartModel, MemoryChartView }
    });
  }
};

export default [dashboardPlugin, magicPlugin, widgetPlugin];
