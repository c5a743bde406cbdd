/**
 * Test-only extension, loaded by the browser tests' JupyterLab server alone
 * (ui-tests/jupyter_server_test_config.py): adds `mpnb:chart-benchmark`.
 * It bundles the chart code compiled for mpnb's own extension (../../../lib),
 * so the benchmark measures the chart that ships.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';

import { BENCHMARK_COMMAND, runChartBenchmark } from './benchmark';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'mpnb-chart-benchmark:plugin',
  description: 'mpnb chart benchmark for the browser tests.',
  autoStart: true,
  activate: (app: JupyterFrontEnd) => {
    app.commands.addCommand(BENCHMARK_COMMAND, {
      label: 'mpnb: chart benchmark (tests)',
      execute: args => runChartBenchmark(app, args) as any
    });
  }
};

export default plugin;
