/**
 * mpnb's JupyterLab extension. Three plugins, wired here from three parts:
 * - dashboard/: the `mpnb.dashboard` comm per notebook, the Distributed sidebar,
 *   the status bar item and the commands (palette + notebook toolbar);
 * - editor/: `%%distributed` cells marked, their magic line highlighted, and the
 *   per-rank status chips of the running one;
 * - chart/: the memory chart, and the front end of the kernel's `MemoryChart` widget.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { EditorExtensionRegistry, IEditorExtensionRegistry } from '@jupyterlab/codemirror';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { IJupyterWidgetRegistry } from '@jupyter-widgets/base';

import { MemoryChartModel, MemoryChartView, MODULE_NAME, MODULE_VERSION } from './chart/widget';
import { addCommands, addToPalette } from './dashboard/commands';
import { ConnectionRegistry } from './dashboard/registry';
import { DistributedSidebar, SIDEBAR_ID } from './dashboard/sidebar';
import { addStatusItem } from './dashboard/statusbar';
import { addToolbarButton } from './dashboard/toolbar';
import { markDistributedCells } from './editor/cellmarker';
import { distributedMagicLine } from './editor/highlight';

const dashboardPlugin: JupyterFrontEndPlugin<void> = {
  id: 'mpnb:dashboard',
  description: 'Distributed sidebar, status bar item and commands for the notebook’s mpnb cluster.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ICommandPalette, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    palette: ICommandPalette | null,
    statusBar: IStatusBar | null
  ) => {
    const registry = new ConnectionRegistry(tracker);
    addCommands(app, registry, SIDEBAR_ID);
    app.shell.add(new DistributedSidebar(app.commands, registry), 'right', { rank: 200 });
    markDistributedCells(registry);
    if (palette) {
      addToPalette(palette);
    }
    if (statusBar) {
      addStatusItem(statusBar, registry, () => app.shell.activateById(SIDEBAR_ID));
    }
    addToolbarButton(app);
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
  description: 'Front end of the mpnb.monitoring.chart.MemoryChart ipywidget.',
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
