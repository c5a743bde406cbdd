// Unit tests for the extension's pure logic (no browser): `npm test`.
import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['labextension/test/**/*.test.ts'],
    environment: 'node'
  }
});
