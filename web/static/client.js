// @ts-self-types="./client.d.ts"
// faregate's typed client: an ES module with no dependencies, served by the
// app at /api/client.js (types: /api/client.d.ts). The page uses it, and so
// can any other frontend:
//
//   import { createClient, FaregateError } from 'https://plans.example/api/client.js';
//   const api = createClient({ baseUrl: 'https://plans.example' });
//   const { id } = await api.createTask({ turnstile_token, destination: 'Lisbon', days: 3 });
//   const task = await api.follow(id, { onStep: (step) => show(step) });
//
// Every failure is a FaregateError with the server's stable code, its
// status, Retry-After in seconds and the request id. Events are read with
// fetch, not EventSource, so a stream can carry an API key and a refused
// stream still shows its code; follow() falls back to polling whenever a
// stream cannot be had.

/** Task statuses that can no longer change. */
const FINAL = new Set(['succeeded', 'failed']);

/** Codes after which following a task cannot succeed by trying again. */
const FATAL = new Set(['task_not_found', 'not_found', 'invalid_api_key']);

/** The events of a task stream, as the document names them. */
const EVENT_TYPES = new Set(['status', 'step', 'done']);

const DEFAULTS = Object.freeze({
  pollInterval: 2000,
  reconnectDelay: 1000,
  idleTimeout: 45000,
  maxStreamFailures: 3,
});

/** isFinal reports whether a task status can no longer change. */
export function isFinal(status) {
  return FINAL.has(status);
}

/**
 * FaregateError is every failure of the client: a refusal by the server
 * (code and status from its answer), "network" when no answer came,
 * "unknown" when an answer had no usable body, and "stream_unsupported"
 * when this browser cannot read a stream.
 */
export class FaregateError extends Error {
  constructor({ code, status = 0, message = '', requestId = '', retryAfter = null, fields = null, rateLimit = null, cause }) {
    super(message || code, cause === undefined ? undefined : { cause });
    this.name = 'FaregateError';
    this.code = code;
    this.status = status;
    this.requestId = requestId;
    this.retryAfter = retryAfter;
    this.fields = fields;
    this.rateLimit = rateLimit;
  }
}

/**
 * parseRetryAfter reads Retry-After (delay seconds or an HTTP date) into
 * whole seconds from now, or null.
 */
export function parseRetryAfter(value, now = Date.now()) {
  if (value == null) return null;
  const text = String(value).trim();
  if (/^\d{1,10}$/.test(text)) return Number(text);
  const date = Date.parse(text);
  if (Number.isNaN(date)) return null;
  return Math.max(0, Math.ceil((date - now) / 1000));
}

/**
 * parseRateLimit reads the IETF draft fields RateLimit
 * ("daily";r=4;t=3600) and RateLimit-Policy ("daily";q=5;w=86400) into
 * {daily: {remaining, reset, quota, window}}; a missing number is absent.
 * It returns null when neither header names a policy.
 */
export function parseRateLimit(rateLimit, policy) {
  const out = {};
  const names = { r: 'remaining', t: 'reset', q: 'quota', w: 'window' };
  for (const field of [rateLimit, policy]) {
    if (!field) continue;
    for (const item of String(field).split(',')) {
      const [first, ...params] = item.split(';').map((s) => s.trim());
      const m = /^"([^"]{1,64})"$/.exec(first);
      if (!m) continue;
      const entry = out[m[1]] || (out[m[1]] = {});
      for (const p of params) {
        const [k, v] = p.split('=');
        if (Object.hasOwn(names, k) && /^\d{1,15}$/.test(v || '')) entry[names[k]] = Number(v);
      }
    }
  }
  return Object.keys(out).length > 0 ? out : null;
}

// sleep waits ms, or rejects with the signal's reason when it aborts.
function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal && signal.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      if (signal) signal.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    if (signal) signal.addEventListener('abort', onAbort, { once: true });
  });
}

// canStream reports whether this browser can read a response body as a
// stream; without it the client polls.
function canStream() {
  return typeof ReadableStream === 'function' && typeof TextDecoder === 'function' &&
    typeof Response === 'function' && 'body' in Response.prototype;
}

/**
 * EventStreamParser turns text of a text/event-stream into events, as the
 * HTML standard's parser does: lines end in CRLF, LF or CR (a CR at the end
 * of one chunk and an LF at the start of the next are one line end), lines
 * starting with ":" are comments, "data" lines join with "\n", an event
 * without data is not dispatched, and the last event id and the retry time
 * outlive the event that set them.
 */
class EventStreamParser {
  constructor(lastEventId) {
    // lastEventId changes only when an event ends (a blank line), as in
    // EventSource: an id line of an event cut off by a broken connection
    // must not make the resume skip that event.
    this.lastEventId = lastEventId;
    this.idBuffer = lastEventId;
    this.retry = null;
    this.rest = '';
    this.skipLF = false;
    this.resetEvent();
  }

  resetEvent() {
    this.type = '';
    this.data = [];
  }

  /** reconnect drops a half-read line and event: a new connection starts clean. */
  reconnect() {
    this.rest = '';
    this.skipLF = false;
    this.idBuffer = this.lastEventId;
    this.resetEvent();
  }

  /** feed takes the next decoded text and returns the events it completes. */
  feed(text) {
    const out = [];
    let s = this.rest + text;
    let start = 0;
    if (this.skipLF && s.length > 0) {
      if (s[0] === '\n') start = 1;
      this.skipLF = false;
    }
    for (let i = start; i < s.length; i++) {
      const c = s[i];
      if (c !== '\n' && c !== '\r') continue;
      this.line(s.slice(start, i), out);
      if (c === '\r') {
        if (i + 1 === s.length) this.skipLF = true;
        else if (s[i + 1] === '\n') i++;
      }
      start = i + 1;
    }
    this.rest = s.slice(start);
    return out;
  }

  line(line, out) {
    if (line === '') {
      // Dispatch. The id field sets the last event id even for an event
      // that carries no data, which is then dropped.
      this.lastEventId = this.idBuffer;
      if (this.data.length > 0) {
        out.push({ id: this.lastEventId, type: this.type || 'message', data: this.data.join('\n') });
      }
      this.resetEvent();
      return;
    }
    if (line[0] === ':') return;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value[0] === ' ') value = value.slice(1);
    switch (field) {
      case 'event':
        this.type = value;
        break;
      case 'data':
        this.data.push(value);
        break;
      case 'id':
        if (!value.includes('\0')) this.idBuffer = value;
        break;
      case 'retry':
        if (/^\d{1,9}$/.test(value)) this.retry = Number(value);
        break;
      default:
      // Unknown fields are ignored.
    }
  }
}

/**
 * createClient returns a client for one faregate server. Options: baseUrl
 * (another origin; that origin must allow this page in
 * FAREGATE_CORS_ORIGINS), apiKey (sent as a Bearer token: no Turnstile,
 * the key's own limits), fetch (for tests), pollInterval (ms between polls,
 * default 2000), reconnectDelay (ms before a stream is resumed when the
 * server did not say; default 1000), idleTimeout (ms of silence after
 * which a stream counts as dead; default 45000, three keep-alives),
 * maxStreamFailures (connections in a row that fail before follow polls
 * instead; default 3).
 */
export function createClient(options = {}) {
  const o = { ...DEFAULTS, ...options };
  const base = String(o.baseUrl || '').replace(/\/+$/, '');
  const doFetch = o.fetch || ((input, init) => globalThis.fetch(input, init));

  function headers(extra) {
    const h = { Accept: 'application/json', ...extra };
    if (o.apiKey) h.Authorization = 'Bearer ' + o.apiKey;
    return h;
  }

  function taskPath(id) {
    return '/api/tasks/' + encodeURIComponent(id);
  }

  // send runs one fetch; anything but an HTTP answer (abort aside) becomes
  // a "network" FaregateError.
  async function send(path, init, signal) {
    try {
      return await doFetch(base + path, { cache: 'no-store', ...init, signal });
    } catch (err) {
      if (signal && signal.aborted) throw signal.reason;
      throw new FaregateError({ code: 'network', message: String(err && err.message ? err.message : err), cause: err });
    }
  }

  // refusal reads an error answer into a FaregateError: the envelope's
  // code, or "unknown" when the answer has none (a proxy's HTML page).
  async function refusal(res) {
    let body = null;
    try {
      body = await res.json();
    } catch {
      body = null;
    }
    const e = body && typeof body === 'object' && body.error && typeof body.error === 'object' ? body.error : null;
    const code = e && typeof e.code === 'string' && e.code !== '' ? e.code : 'unknown';
    return new FaregateError({
      code,
      status: res.status,
      message: e && typeof e.message === 'string' ? e.message : 'HTTP ' + res.status,
      requestId: (e && typeof e.request_id === 'string' && e.request_id) || res.headers.get('X-Request-Id') || '',
      retryAfter: parseRetryAfter(res.headers.get('Retry-After')),
      fields: e && e.fields && typeof e.fields === 'object' ? e.fields : null,
      rateLimit: parseRateLimit(res.headers.get('RateLimit'), res.headers.get('RateLimit-Policy')),
    });
  }

  // json sends a request and returns its JSON body and answer, or throws.
  async function json(path, init = {}, signal) {
    const res = await send(path, init, signal);
    if (!res.ok) throw await refusal(res);
    let body;
    try {
      body = await res.json();
    } catch (err) {
      if (signal && signal.aborted) throw signal.reason;
      body = null;
    }
    if (!body || typeof body !== 'object') {
      throw new FaregateError({ code: 'unknown', status: res.status, message: 'answer is not a JSON object', requestId: res.headers.get('X-Request-Id') || '' });
    }
    return { body, res };
  }

  /** config fetches GET /api/config. */
  async function config({ signal } = {}) {
    return (await json('/api/config', { headers: headers() }, signal)).body;
  }

  /**
   * createTask posts a task: a trip ({destination, days, interests?}) or a
   * prompt ({prompt}), whichever form config().input names. The answer's
   * body comes with location (the task's URL) and rateLimit (parsed
   * RateLimit headers, or null).
   */
  async function createTask(request, { signal } = {}) {
    const { body, res } = await json('/api/tasks', {
      method: 'POST',
      headers: headers({ 'Content-Type': 'application/json' }),
      body: JSON.stringify(request),
    }, signal);
    return {
      ...body,
      location: res.headers.get('Location') || taskPath(body.id),
      rateLimit: parseRateLimit(res.headers.get('RateLimit'), res.headers.get('RateLimit-Policy')),
    };
  }

  /** getTask fetches one snapshot of a task. */
  async function getTask(id, { signal } = {}) {
    return (await json(taskPath(id), { headers: headers() }, signal)).body;
  }

  /** usage fetches GET /api/usage: an API key's limits and today's use. */
  async function usage({ signal } = {}) {
    return (await json('/api/usage', { headers: headers() }, signal)).body;
  }

  // connect opens one stream and yields its events until it ends. It
  // throws a refusal before the stream starts as it is, and anything that
  // breaks an open stream as "network". A connection silent for idleTimeout
  // is cut, so a dead network cannot hold a follower forever.
  async function* connect(id, parser, signal) {
    const conn = new AbortController();
    let reader = null;
    // Aborting the fetch errors its body in browsers; cancelling the reader
    // as well ends a pending read wherever the two are not tied.
    const cut = (reason) => {
      conn.abort(reason);
      if (reader) reader.cancel(reason).catch(() => {});
    };
    const onAbort = () => cut(signal.reason);
    if (signal) signal.addEventListener('abort', onAbort, { once: true });
    let idle = 0;
    const arm = () => {
      clearTimeout(idle);
      idle = setTimeout(() => cut(new FaregateError({ code: 'network', message: 'stream went silent' })), o.idleTimeout);
    };
    parser.reconnect();
    try {
      const extra = { Accept: 'text/event-stream' };
      if (parser.lastEventId) extra['Last-Event-ID'] = parser.lastEventId;
      arm();
      const res = await send(taskPath(id) + '/events', { headers: headers(extra) }, conn.signal);
      const type = (res.headers.get('Content-Type') || '').split(';')[0].trim().toLowerCase();
      if (!res.ok || type !== 'text/event-stream') {
        clearTimeout(idle);
        throw res.ok
          ? new FaregateError({ code: 'unknown', status: res.status, message: 'not an event stream', requestId: res.headers.get('X-Request-Id') || '' })
          : await refusal(res);
      }
      if (!res.body || typeof res.body.getReader !== 'function') {
        throw new FaregateError({ code: 'stream_unsupported', status: res.status, message: 'this browser cannot read streams' });
      }
      reader = res.body.getReader();
      const decoder = new TextDecoder();
      for (;;) {
        let chunk;
        try {
          chunk = await reader.read();
        } catch (err) {
          if (signal && signal.aborted) throw signal.reason;
          throw new FaregateError({ code: 'network', message: 'stream broke', cause: err });
        }
        if (chunk.done) {
          if (signal && signal.aborted) throw signal.reason;
          return;
        }
        arm();
        yield* parser.feed(decoder.decode(chunk.value, { stream: true }));
      }
    } finally {
      clearTimeout(idle);
      if (signal) signal.removeEventListener('abort', onAbort);
      if (reader) reader.cancel().catch(() => {});
    }
  }

  /**
   * events reads a task's event stream as an async iterator of
   * {type: "status" | "step" | "done", id, data}, ending after done. When
   * the server closes the stream without done (its maximum lifetime, a
   * shutdown) or the connection breaks, it waits (the server's retry, else
   * reconnectDelay) and resumes with Last-Event-ID, so no event comes twice
   * and nothing is surfaced. A refusal before a stream starts is thrown as
   * a FaregateError (too_many_streams, server_busy, rate_limited,
   * task_not_found…), and so is "network" once maxStreamFailures
   * connections in a row have brought no event.
   */
  async function* events(id, { signal, lastEventId = '' } = {}) {
    if (!canStream()) throw new FaregateError({ code: 'stream_unsupported', message: 'this browser cannot read streams' });
    const parser = new EventStreamParser(String(lastEventId || ''));
    let failures = 0;
    for (;;) {
      if (signal && signal.aborted) throw signal.reason;
      let delivered = false;
      let broke = null;
      try {
        for await (const ev of connect(id, parser, signal)) {
          if (!EVENT_TYPES.has(ev.type)) continue;
          let data;
          try {
            data = JSON.parse(ev.data);
          } catch {
            continue;
          }
          delivered = true;
          failures = 0;
          yield { type: ev.type, id: ev.id, data };
          if (ev.type === 'done') return;
        }
      } catch (err) {
        if (signal && signal.aborted) throw signal.reason;
        if (!(err instanceof FaregateError) || err.code !== 'network') throw err;
        broke = err;
      }
      // Closed without done, or broken. A connection that brought no event
      // counts as a failure, so a server that keeps hanging up is not
      // retried forever; one that did starts the count again.
      if (!delivered) {
        failures++;
        if (failures >= o.maxStreamFailures) {
          throw broke || new FaregateError({ code: 'network', message: 'the stream keeps closing without events' });
        }
      }
      await sleep(parser.retry ?? o.reconnectDelay, signal);
    }
  }

  // poll fetches the task every pollInterval until it is final. Transient
  // failures wait (Retry-After when the server names it, else a growing
  // delay up to 30 s) and are reported through onRetry.
  async function poll(id, h, signal, firstDelay) {
    let failures = 0;
    let delay = firstDelay;
    for (;;) {
      if (delay > 0) await sleep(delay, signal);
      let task;
      try {
        task = await getTask(id, { signal });
      } catch (err) {
        if (signal && signal.aborted) throw signal.reason;
        if (!(err instanceof FaregateError) || FATAL.has(err.code)) throw err;
        failures++;
        delay = err.retryAfter !== null ? err.retryAfter * 1000 : Math.min(o.pollInterval * 2 ** failures, 30000);
        if (h.onRetry) h.onRetry(err, delay);
        continue;
      }
      failures = 0;
      if (h.onTask) h.onTask(task);
      if (isFinal(task.status)) return task;
      delay = o.pollInterval;
    }
  }

  /**
   * follow follows a task to its final state and resolves with the final
   * task. It streams events (onStatus(status), onStep(step, eventId)) and
   * hands the final task to onTask; when no stream can be had (this
   * browser cannot read one, too_many_streams, server_busy, rate_limited,
   * repeated network failures…) it calls onMode("poll", reason) and polls
   * GET /api/tasks/{id}, handing each snapshot to onTask. It rejects with a
   * FaregateError only when following cannot succeed (task_not_found,
   * invalid_api_key), and with the signal's reason when signal aborts.
   */
  async function follow(id, h = {}) {
    const { signal } = h;
    let reason = null;
    if (canStream()) {
      try {
        let opened = false;
        for await (const ev of events(id, { signal, lastEventId: h.lastEventId })) {
          if (!opened && h.onMode) h.onMode('stream', null);
          opened = true;
          if (ev.type === 'status' && ev.data && typeof ev.data.status === 'string') {
            if (h.onStatus) h.onStatus(ev.data.status);
          } else if (ev.type === 'step' && ev.data && typeof ev.data === 'object') {
            if (h.onStep) h.onStep(ev.data, ev.id);
          } else if (ev.type === 'done' && ev.data && typeof ev.data === 'object' && isFinal(ev.data.status)) {
            if (h.onTask) h.onTask(ev.data);
            return ev.data;
          }
        }
        // A done event without a usable task: the snapshot will say.
        reason = new FaregateError({ code: 'unknown', message: 'done event without a final task' });
      } catch (err) {
        if (signal && signal.aborted) throw signal.reason;
        if (!(err instanceof FaregateError) || FATAL.has(err.code)) throw err;
        reason = err;
      }
    } else {
      reason = new FaregateError({ code: 'stream_unsupported', message: 'this browser cannot read streams' });
    }
    if (h.onMode) h.onMode('poll', reason);
    const wait = reason.retryAfter !== null && reason.code === 'rate_limited' ? reason.retryAfter * 1000 : 0;
    return poll(id, h, signal, wait);
  }

  return { config, createTask, getTask, usage, events, follow };
}
