/**
 * One notebook's link to its kernel's mpnb session over the `mpnb.dashboard`
 * comm (protocol in docs/internals.md). Created per notebook panel, so data
 * keeps arriving while another notebook is shown, and each notebook's sidebar
 * shows its own kernel's cluster.
 */
import type { ISessionContext } from '@jupyterlab/apputils';
import type { Kernel, KernelMessage } from '@jupyterlab/services';
import { UUID } from '@lumino/coreutils';
import { IDisposable } from '@lumino/disposable';
import { ISignal, Signal } from '@lumino/signaling';

import { IMemorySample, MemoryHistory } from '../chart/history';
import { IEngineLog, parseLogReply } from './enginelog';
import { DashboardEvent, IDashboardState, INITIAL_STATE, reduce } from './state';

export const COMM_TARGET = 'mpnb.dashboard';
// How long to wait for the kernel's comm subshell before opening on the main shell.
const SUBSHELL_WAIT_MS = 3000;
// A log request is answered at once, unless a cell holds a kernel without subshells.
const LOG_TIMEOUT_MS = 15000;

export class DashboardConnection implements IDisposable {
  readonly history = new MemoryHistory(600);
  private _state: IDashboardState = INITIAL_STATE;
  private _stateChanged = new Signal<this, IDashboardState>(this);
  private _kernel: Kernel.IKernelConnection | null = null;
  private _comm: Kernel.IComm | null = null;
  private _reopenOnIdle = false;
  private _retriedAfterClose = false;
  private _disposed = false;
  private _logRequests = new Map<string, (reply: IEngineLog) => void>();

  constructor(readonly sessionContext: ISessionContext) {
    sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    sessionContext.statusChanged.connect(this._onStatusChanged, this);
    this._attach(sessionContext.session?.kernel ?? null);
  }

  get state(): IDashboardState {
    return this._state;
  }

  /** Emitted after every state change (comm message or connection event). */
  get stateChanged(): ISignal<this, IDashboardState> {
    return this._stateChanged;
  }

  get kernel(): Kernel.IKernelConnection | null {
    return this._kernel;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  /** Ask for a fresh `state`, reopening the comm if mpnb was not loaded before. */
  refresh(): void {
    if (this._comm && !this._comm.isDisposed) {
      this._comm.send({ type: 'refresh' });
    } else {
      void this._open();
    }
  }

  /** The end of `rank`'s engine log, read by the kernel from the path its session recorded. */
  requestLog(rank: number, lines: number): Promise<IEngineLog> {
    const comm = this._comm;
    if (!comm || comm.isDisposed || this._state.connection !== 'connected') {
      return Promise.reject(new Error('mpnb is not connected to this notebook’s kernel.'));
    }
    const id = UUID.uuid4();
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this._logRequests.delete(id);
        reject(new Error('The kernel did not answer: it may be busy with a cell. Try Refresh later.'));
      }, LOG_TIMEOUT_MS);
      this._logRequests.set(id, reply => {
        clearTimeout(timer);
        resolve(reply);
      });
      comm.send({ type: 'log', id, rank, lines });
    });
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._detach();
    Signal.clearData(this);
  }

  private _dispatch(event: DashboardEvent): void {
    const next = reduce(this._state, event);
    if (event.type === 'state') {
      this.history.setEstimate(next.estimate);
      if (!next.cluster && this._state.cluster) {
        this.history.reset();
      }
    }
    if (next !== this._state) {
      this._state = next;
      this._stateChanged.emit(next);
    }
  }

  private _onKernelChanged(): void {
    this._detach();
    this.history.reset();
    this._attach(this.sessionContext.session?.kernel ?? null);
  }

  private _onStatusChanged(_: ISessionContext, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      // The kernel's comms and mpnb session are gone with it.
      this._comm = null;
      this.history.reset();
      this._reopenOnIdle = status !== 'dead';
      this._dispatch({ type: status === 'dead' ? 'no-kernel' : 'connecting' });
    } else if (status === 'idle' && this._reopenOnIdle) {
      this._reopenOnIdle = false;
      void this._open();
    }
  }

  private _attach(kernel: Kernel.IKernelConnection | null): void {
    this._kernel = kernel;
    if (!kernel) {
      this._dispatch({ type: 'no-kernel' });
      return;
    }
    kernel.registerCommTarget(COMM_TARGET, this._onKernelOpened);
    void this._open();
  }

  private _detach(): void {
    const kernel = this._kernel;
    const comm = this._comm;
    this._comm = null;
    this._kernel = null;
    if (kernel && !kernel.isDisposed) {
      kernel.removeCommTarget(COMM_TARGET, this._onKernelOpened);
      if (comm && !comm.isDisposed) {
        try {
          comm.close();
        } catch {
          // the kernel connection is going away anyway
        }
      }
    }
  }

  /** Open the comm from the frontend: on connect, after reload, after a restart. */
  private async _open(): Promise<void> {
    const kernel = this._kernel;
    if (!kernel || kernel.isDisposed || this._disposed) {
      return;
    }
    this._dispatch({ type: 'connecting' });
    try {
      await kernel.info;
    } catch {
      return;
    }
    if (kernel !== this._kernel || kernel.isDisposed) {
      return;
    }
    const comm = kernel.createComm(COMM_TARGET);
    this._adopt(comm);
    // Comms travel on a kernel subshell when the kernel has them (ipykernel 7), so the
    // sidebar gets its state even while a long distributed cell holds the main shell.
    const started = (comm as unknown as { subshellStarted?: Promise<void> }).subshellStarted;
    if (kernel.supportsSubshells && started) {
      await Promise.race([started, new Promise(resolve => setTimeout(resolve, SUBSHELL_WAIT_MS))]);
    }
    if (!comm.isDisposed && this._comm === comm) {
      comm.open({});
    }
  }

  /** The kernel opened a comm to us (`%load_ext mpnb` ran after we connected). */
  private _onKernelOpened = (comm: Kernel.IComm, msg: KernelMessage.ICommOpenMsg): void => {
    if (this._disposed || comm.isDisposed) {
      return;
    }
    if (this._comm && !this._comm.isDisposed && this._state.connection === 'connected') {
      // We already have a live comm: close this one so the kernel does not send everything twice.
      // Another page that adopted it sees the close and opens a comm of its own.
      try {
        comm.close();
      } catch {
        // already gone
      }
      return;
    }
    this._adopt(comm);
    this._onData(msg.content.data);
  };

  private _adopt(comm: Kernel.IComm): void {
    const previous = this._comm;
    this._comm = comm;
    if (previous && previous !== comm && !previous.isDisposed) {
      previous.onMsg = () => undefined;
      previous.onClose = () => undefined;
    }
    comm.onMsg = msg => this._onData(msg.content.data);
    comm.onClose = () => {
      if (this._comm !== comm) {
        return;
      }
      this._comm = null;
      const wasConnected = this._state.connection === 'connected';
      this._dispatch({ type: 'unavailable' });
      if (wasConnected && !this._retriedAfterClose) {
        // The kernel dropped a live comm (it keeps a bounded number): open a new one once.
        this._retriedAfterClose = true;
        void this._open();
      }
    };
  }

  private _onData(data: unknown): void {
    if (!data || typeof data !== 'object') {
      return;
    }
    const message = data as { type?: string; samples?: IMemorySample[] };
    if (message.type === 'state') {
      this._retriedAfterClose = false;
      this._dispatch(message as DashboardEvent);
    } else if (message.type === 'log') {
      const reply = parseLogReply(data);
      const resolve = reply ? this._logRequests.get(reply.id) : undefined;
      if (reply && resolve) {
        this._logRequests.delete(reply.id);
        resolve(reply);
      }
    } else if (message.type === 'samples' && Array.isArray(message.samples)) {
      this.history.add(message.samples);
      this._dispatch({ type: 'samples', samples: message.samples });
    }
  }
}
