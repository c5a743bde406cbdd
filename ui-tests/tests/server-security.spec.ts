/**
 * The browser tests' own JupyterLab is not open to anyone else while they run: it listens on
 * 127.0.0.1 only, refuses REST calls without this run's token, and keeps XSRF checks on for
 * cookie-authenticated calls. (galata's defaults turn all of that off; see
 * ui-tests/jupyter_server_test_config.py and tests/unit/test_e2e_server_config.py.)
 */
import { APIRequestContext, expect, request as newRequest, test } from '@playwright/test';
import * as fs from 'fs';

const port = Number(process.env.MPNB_E2E_PORT);
const token = process.env.MPNB_E2E_TOKEN ?? '';
const baseURL = `http://127.0.0.1:${port}`;

/** Local addresses (hex, as the kernel writes them) of the TCP sockets listening on `port`. */
function listeningAddresses(port: number): string[] {
  const addresses: string[] = [];
  for (const table of ['/proc/net/tcp', '/proc/net/tcp6']) {
    if (!fs.existsSync(table)) {
      continue;
    }
    for (const line of fs.readFileSync(table, 'utf8').split('\n').slice(1)) {
      const fields = line.trim().split(/\s+/);
      if (fields.length < 4 || fields[3] !== '0A') {
        continue; // not LISTEN
      }
      const [address, portHex] = fields[1].split(':');
      if (parseInt(portHex, 16) === port) {
        addresses.push(address);
      }
    }
  }
  return addresses;
}

/** A request context with exactly these headers (the config's token header is not added). */
function client(headers: Record<string, string>, storageState?: Awaited<ReturnType<APIRequestContext['storageState']>>) {
  return newRequest.newContext({ baseURL, extraHTTPHeaders: headers, storageState });
}

test('the test server listens on 127.0.0.1 only', () => {
  const addresses = listeningAddresses(port);
  expect(addresses.length).toBeGreaterThan(0);
  // 127.0.0.1 in /proc/net/tcp's little-endian hex; nothing on 0.0.0.0 or in tcp6.
  expect(addresses).toEqual(addresses.map(() => '0100007F'));
});

test('the REST API refuses requests without the right token', async ({ request }) => {
  expect(token.length).toBeGreaterThanOrEqual(64);
  const anonymous = await client({});
  const wrong = await client({ Authorization: `token ${'0'.repeat(64)}` });
  for (const api of [anonymous, wrong]) {
    for (const path of ['/api/contents', '/api/kernels', '/api/sessions', '/api/terminals']) {
      expect([401, 403]).toContain((await api.get(path)).status());
    }
    expect([401, 403]).toContain((await api.post('/api/kernels', { data: { name: 'python3' } })).status());
    await api.dispose();
  }
  // The config's `request` fixture carries the token, as galata's helpers need.
  expect((await request.get('/api/contents')).status()).toBe(200);
});

test('cookie-authenticated writes need the XSRF token', async () => {
  // Log in with the token once: the server answers with its login and _xsrf cookies.
  const login = await client({ Authorization: `token ${token}` });
  expect((await login.get('/lab')).status()).toBe(200);
  const state = await login.storageState();
  await login.dispose();
  const xsrf = state.cookies.find(cookie => cookie.name === '_xsrf');
  expect(xsrf).toBeTruthy();

  const browserLike = await client({}, state);
  expect((await browserLike.get('/api/contents')).status()).toBe(200);
  const create = { data: { type: 'directory' } };
  expect((await browserLike.post('/api/contents', create)).status()).toBe(403);
  const allowed = await browserLike.post('/api/contents', { ...create, headers: { 'X-XSRFToken': xsrf!.value } });
  expect(allowed.status()).toBe(201);
  const { path } = await allowed.json();
  expect((await browserLike.delete(`/api/contents/${path}`, { headers: { 'X-XSRFToken': xsrf!.value } })).status()).toBe(
    204
  );
  await browserLike.dispose();
});
