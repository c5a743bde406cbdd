import { LabIcon } from '@jupyterlab/ui-components';

// Four ranks (squares) joined by a bus: the Distributed sidebar and toolbar menu.
const svg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
<g class="jp-icon3" fill="#616161">
<rect x="2" y="3" width="8" height="7" rx="1.5"/><rect x="14" y="3" width="8" height="7" rx="1.5"/>
<rect x="2" y="14" width="8" height="7" rx="1.5"/><rect x="14" y="14" width="8" height="7" rx="1.5"/>
<rect x="11" y="5.5" width="2" height="13"/>
</g></svg>`;

export const mpnbIcon = new LabIcon({ name: 'mpnb:cluster', svgstr: svg });
