/**
 * Commands in the palette and the notebook toolbar. Cluster commands run
 * `%mpnb ...` in the current notebook's kernel (loading the extension first);
 * "stop all ranks" is a kernel interrupt, which mpnb turns into a cooperative
 * stop on every rank.
 */
import type { JupyterFrontEnd } from '@jupyterlab/application';
import { ICommandPalette, Notification } from '@jupyterlab/apputils';
import { NotebookActions } from '@jupyterlab/notebook';
import { refreshIcon, runIcon, settingsIcon, stopIcon, textEditorIcon } from '@jupyterlab/ui-components';

import { mpnbIcon } from './icons';
import { executeInKernel, LOAD_MPNB } from './kernelexec';
import { EngineLogPanel, engineLogPanelId } from './logpanel';
import { ConnectionRegistry } from './registry';

export const CommandIDs = {
  start: 'mpnb:start-cluster',
  stop: 'mpnb:stop-cluster',
  restart: 'mpnb:restart-cluster',
  stopRanks: 'mpnb:stop-ranks',
  configPanel: 'mpnb:open-config-panel',
  dashboard: 'mpnb:open-dashboard',
  engineLog: 'mpnb:show-engine-log'
} as const;

export const PALETTE_CATEGORY = 'mpnb (distributed)';

export function addCommands(app: JupyterFrontEnd, registry: ConnectionRegistry, sidebarId: string): void {
  const { commands } = app;
  const kernel = () => registry.currentPanel?.sessionContext.session?.kernel ?? null;
  const hasKernel = () => kernel() !== null;

  const runMagic = async (line: string, pending: string, done: string): Promise<void> => {
    const k = kernel();
    if (!k) {
      Notification.error('This notebook has no running kernel: start one first.');
      return;
    }
    const connection = registry.current;
    const result = executeInKernel(k, `${LOAD_MPNB}\n${line}`).then(r => {
      connection?.refresh();
      if (!r.ok) {
        throw new Error(r.error ?? 'failed');
      }
      return r.text;
    });
    Notification.promise(result, {
      pending: { message: pending, options: { autoClose: false } },
      success: { message: () => done, options: { autoClose: 3000 } },
      error: { message: (e: unknown) => `${line} failed: ${(e as Error).message}` }
    });
    await result.catch(() => undefined);
  };

  commands.addCommand(CommandIDs.start, {
    label: 'Start mpnb Cluster',
    caption: 'Start one engine per GPU (2 CPU engines without GPUs): %mpnb start',
    icon: runIcon,
    isEnabled: hasKernel,
    execute: args => {
      const n = Number(args.n);
      const line = Number.isInteger(n) && n > 0 ? `%mpnb start -n ${n}` : '%mpnb start';
      return runMagic(line, 'Starting the mpnb cluster…', 'mpnb cluster started');
    }
  });
  commands.addCommand(CommandIDs.stop, {
    label: 'Stop mpnb Cluster',
    caption: 'Stop every engine of this kernel’s cluster: %mpnb stop',
    icon: stopIcon,
    isEnabled: hasKernel,
    execute: () => runMagic('%mpnb stop', 'Stopping the mpnb cluster…', 'mpnb cluster stopped')
  });
  commands.addCommand(CommandIDs.restart, {
    label: 'Restart mpnb Cluster',
    caption: 'Restart the engines (namespaces are lost): %mpnb restart',
    icon: refreshIcon,
    isEnabled: hasKernel,
    execute: () => runMagic('%mpnb restart', 'Restarting the mpnb cluster…', 'mpnb cluster restarted')
  });
  commands.addCommand(CommandIDs.stopRanks, {
    label: 'Stop All Ranks',
    caption: 'Interrupt the kernel: every rank stops the running distributed cell at the same step',
    icon: stopIcon,
    isEnabled: hasKernel,
    execute: async () => {
      await kernel()?.interrupt();
    }
  });
  commands.addCommand(CommandIDs.configPanel, {
    label: 'Open mpnb Config Panel',
    caption: 'Insert a cell below with mpnb.config_panel() and run it',
    icon: settingsIcon,
    isEnabled: () => registry.currentPanel !== null,
    execute: async () => {
      const panel = registry.currentPanel;
      if (!panel) {
        return;
      }
      // A just-opened notebook may still be starting its kernel; running before that would skip the cell.
      await panel.sessionContext.ready;
      const notebook = panel.content;
      NotebookActions.insertBelow(notebook);
      const cell = notebook.activeCell;
      if (!cell) {
        return;
      }
      cell.model.sharedModel.setSource('import mpnb\nmpnb.config_panel()');
      // The new cell can be below the fold (from the sidebar, the active cell is anywhere):
      // bring it to the top of the view, again once the panel has rendered under it.
      await notebook.scrollToCell(cell, 'start');
      await NotebookActions.run(notebook, panel.sessionContext);
      if (!cell.isDisposed) {
        await notebook.scrollToCell(cell, 'start');
      }
    }
  });
  commands.addCommand(CommandIDs.dashboard, {
    label: 'Open Distributed Dashboard',
    caption: 'Show the Distributed sidebar: ranks, strategy, memory, last cell',
    icon: mpnbIcon,
    execute: () => {
      app.shell.activateById(sidebarId);
    }
  });
  addLogCommand(app, registry);
}

function addLogCommand(app: JupyterFrontEnd, registry: ConnectionRegistry): void {
  const rankOf = (args: { rank?: unknown }): number => {
    const rank = Number(args.rank);
    return Number.isInteger(rank) && rank >= 0 ? rank : 0;
  };
  app.commands.addCommand(CommandIDs.engineLog, {
    label: args => (args.rank === undefined ? 'Show mpnb Engine Log' : `Show Engine Log of Rank ${rankOf(args)}`),
    caption: args =>
      `The last lines of rank ${rankOf(args)}’s engine log (compiler and library output), read-only`,
    icon: textEditorIcon,
    isEnabled: () => !!registry.current?.state.cluster,
    execute: async args => {
      const connection = registry.current;
      if (!connection) {
        return;
      }
      const rank = rankOf(args);
      const id = engineLogPanelId(connection, rank);
      let panel = Array.from(app.shell.widgets('main')).find(w => w.id === id) as EngineLogPanel | undefined;
      if (!panel) {
        panel = new EngineLogPanel(connection, rank);
        app.shell.add(panel, 'main', { mode: 'split-right' });
      }
      app.shell.activateById(id);
      await panel.refresh();
    }
  });
}

export function addToPalette(palette: ICommandPalette): void {
  for (const command of Object.values(CommandIDs)) {
    palette.addItem({ command, category: PALETTE_CATEGORY });
  }
}
