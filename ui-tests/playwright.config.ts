/**
 * Browser tests of the mpnb extension (galata + Playwright) in Debian's Chromium.
 * Run with `npm run test:e2e` (or `make test-e2e`): starts `.venv/bin/jupyter lab` on
 * 127.0.0.1 and a free port, in a fresh temp notebook directory, with a random token made for
 * this run (XSRF checks stay on: every request carries the token, which the server accepts
 * instead of an XSRF cookie).
 */
import { execFileSync } from 'child_process';
import { randomBytes } from 'crypto';
import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';

// eslint-disable-next-line @typescript-eslint/no-var-requires
const baseConfig = require('@jupyterlab/galata/lib/playwright-config');

const root = path.resolve(__dirname, '..');
const venvBin = path.join(root, '.venv', 'bin');
const jupyter = fs.existsSync(path.join(venvBin, 'jupyter')) ? path.join(venvBin, 'jupyter') : 'jupyter';
const python = fs.existsSync(path.join(venvBin, 'python')) ? path.join(venvBin, 'python') : 'python3';

// The config is evaluated again in every worker: pick the port and directory once and pass them on.
if (!process.env.MPNB_E2E_PORT) {
  process.env.MPNB_E2E_PORT = execFileSync(python, [
    '-c',
    'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
  ])
    .toString()
    .trim();
}
if (!process.env.JUPYTERLAB_GALATA_ROOT_DIR) {
  process.env.JUPYTERLAB_GALATA_ROOT_DIR = fs.mkdtempSync(path.join(os.tmpdir(), 'mpnb-e2e-'));
}
// The token travels in the environment (readable by this user only), never on the command line,
// which every local user can read in /proc/<pid>/cmdline.
if (!process.env.MPNB_E2E_TOKEN) {
  process.env.MPNB_E2E_TOKEN = randomBytes(32).toString('hex');
}
const port = process.env.MPNB_E2E_PORT;
const baseURL = `http://127.0.0.1:${port}`;

export default {
  ...baseConfig,
  testDir: './tests',
  outputDir: path.join(root, 'test-results'),
  reporter: [['list']],
  workers: 1,
  fullyParallel: false,
  retries: 0,
  timeout: 240_000,
  expect: { timeout: 30_000 },
  use: {
    ...baseConfig.use,
    baseURL,
    // On every request of the pages and of the `request` fixture: galata's own helpers (the test
    // folder, kernel and session clean-up) call the REST API through `request`, without a page
    // to read the token from, so the header is how they authenticate.
    extraHTTPHeaders: { Authorization: `token ${process.env.MPNB_E2E_TOKEN}` },
    browserName: 'chromium',
    viewport: { width: 1440, height: 900 },
    trace: 'off',
    video: 'off',
    screenshot: 'only-on-failure',
    launchOptions: {
      // Debian's Chromium; Playwright's own browser downloads are not available here.
      executablePath: process.env.MPNB_CHROMIUM ?? '/usr/bin/chromium',
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-quic',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync'
      ]
    }
  },
  webServer: {
    command: [
      jupyter,
      'lab',
      `--config=${path.join(__dirname, 'jupyter_server_test_config.py')}`,
      `--port=${port}`,
      '--ServerApp.ip=127.0.0.1',
      '--no-browser',
      '--allow-root'
    ].join(' '),
    url: `${baseURL}/lab`,
    timeout: 120_000,
    reuseExistingServer: false,
    stdout: 'ignore',
    stderr: 'pipe',
    env: {
      ...process.env,
      OMP_NUM_THREADS: '1',
      DS_ACCELERATOR: 'cpu',
      TORCH_EXTENSIONS_DIR: process.env.TORCH_EXTENSIONS_DIR ?? path.join(os.homedir(), '.cache', 'mpnb', 'torch_extensions'),
      PATH: `${venvBin}:${process.env.PATH}`
    }
  }
};
