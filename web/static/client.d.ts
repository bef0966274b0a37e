// Types of faregate's client module (/api/client.js). They follow the
// server's OpenAPI document (/api/openapi.json).

/** A plan's language. */
export type Language = 'en' | 'zh-CN';

/** Every stable code of an error answer. */
export type ErrorCode =
  | 'invalid_request' // 400: a field is wrong; see FaregateError.fields
  | 'prompt_rejected' // 400: the text matches a prompt rule
  | 'invalid_api_key' // 401: unknown, disabled or malformed key
  | 'turnstile_failed' // 403: the human check failed, expired or was replayed
  | 'task_not_found' // 404
  | 'not_found' // 404: no such path
  | 'method_not_allowed' // 405
  | 'request_too_large' // 413: body over 16384 bytes
  | 'unsupported_media_type' // 415: not application/json
  | 'demo_ip_limit_reached' // 429: this visitor's tasks today; retryAfter = to 00:00 UTC
  | 'demo_global_limit_reached' // 429: the site's tasks today
  | 'demo_budget_exhausted' // 429: today's token or money budget, or the principal's sliding hour of tokens
  | 'too_many_streams' // 429: too many open event streams; poll instead
  | 'rate_limited' // 429: too many requests this minute or second (fewer past the soft share of the hour)
  | 'too_many_failed_checks' // 429: too many refused attempts this hour
  | 'token_rate_limited' // 429: tokens-per-minute bucket empty
  | 'key_daily_limit_reached' // 429: the API key's tasks today
  | 'anomaly_blocked' // 429: repeated anomalies this hour
  | 'invalid_ratio' // 429: too large a share of this principal's last 10 minutes' requests were invalid
  | 'internal_error' // 500
  | 'demo_protection_unavailable' // 503: Turnstile or Redis down; nothing counted
  | 'model_unavailable' // 503: model breaker open, no fallback
  | 'aitf_queue_full' // 503: AI-traffic delay queue full
  | 'server_busy' // 503: connection or stream limit of the process
  | 'fetch_refused' // 400 (/v1): not a public http(s) address
  | 'model_not_allowed' // 400 (/v1): a model GET /v1/models does not list
  | 'unsupported_parameter' // 400 (/v1): a cost-changing field (param names it)
  | 'step_limit' // 429 (/v1): the task's model calls are used
  | 'too_many_calls' // 429 (/v1): too many of the task's calls in flight
  | 'input_spike' // 429 (/v1): a prompt far over the principal's average; the task ends
  | 'task_finished' // 409 (/v1): the task's result was already taken
  | 'event_limit' // 429 (/v1): the task's progress events are used up
  | 'tool_limit' // 429 (/v1): the task's tool calls are used up
  | 'upstream_invalid'; // 502 (/v1): the provider's answer passed its reservation and could not be cut

/** Codes the client itself produces. */
export type ClientErrorCode =
  | 'network' // no HTTP answer (or a stream that kept breaking)
  | 'unknown' // an answer without a usable body, e.g. a proxy's HTML page
  | 'stream_unsupported'; // this browser cannot read a response as a stream

/** Why an admitted task failed; its quota slot stays used. */
export type TaskErrorCode =
  | 'model_unavailable'
  | 'agent_failed'
  | 'worker_lost'
  | 'input_spike'
  | 'token_rate_limited'
  | 'agent_unreachable' // the external agent could not be reached
  | 'agent_timeout'; // the external agent accepted but sent no result in time

/** Why a finished plan was limited; the plan is still usable. */
export type WarningCode =
  | 'weather_unavailable'
  | 'search_unavailable'
  | 'fetch_failed'
  | 'downstream_pushback'
  | 'budget_exhausted'
  | 'output_truncated'
  | 'output_loop'
  | 'step_limit'
  | 'tool_limit'
  | 'time_limit'
  | 'tool_loop'
  | 'low_precision'
  | 'fallback_model'
  | 'throttled' // the principal was past the soft share of its hourly tokens
  | 'downgraded'; // so its model calls went to the fallback model first

export type TaskStatus = 'queued' | 'running' | 'succeeded' | 'failed';

/**
 * The body of POST /api/tasks in the trip form (Config.input "trip").
 * Unknown fields are ignored by the server. Text holding format or control
 * characters (zero-width spaces, bidi controls, tag characters, tabs, line
 * breaks) is refused naming the field; lengths count code points of NFKC.
 */
export interface TaskRequest {
  /** Required for anonymous visitors; not needed with an API key. */
  turnstile_token?: string;
  /** 1–80 characters after trimming. */
  destination: string;
  /** 1–7. */
  days: number;
  /** At most 5, each 1–32 characters. */
  interests?: string[];
  /** Default: from Accept-Language, else "en". */
  language?: Language;
}

/**
 * The body of POST /api/tasks in the prompt form (Config.input "prompt",
 * an external agent). Tabs and line breaks are allowed, other control and
 * format characters are refused.
 */
export interface PromptRequest {
  /** Required for anonymous visitors; not needed with an API key. */
  turnstile_token?: string;
  /** 1 to Config.limits.prompt_max_chars code points of NFKC after trimming. */
  prompt: string;
  /** Default: from Accept-Language, else "en". */
  language?: Language;
}

export interface VisitorQuota {
  ip_remaining: number;
  global_remaining: number;
}

export interface KeyQuota {
  key_remaining: number;
}

/** One policy of the RateLimit / RateLimit-Policy headers. */
export interface RateLimitItem {
  /** r: what is left. */
  remaining?: number;
  /** t: seconds until it resets. */
  reset?: number;
  /** q: the quota. */
  quota?: number;
  /** w: the window in seconds (absent for "streams", a limit on streams open at once). */
  window?: number;
}

/** By policy name: "daily" (tasks per day), "budget" (tokens per day), "spend", "rpm", "tpm", "failed" (failed checks per hour), "anomaly", "streams". */
export type RateLimits = Record<string, RateLimitItem>;

/** The 202 answer of createTask. */
export interface Accepted {
  id: string;
  /** "succeeded": a cached plan for the same request was served at once. */
  status: 'queued' | 'succeeded';
  quota: VisitorQuota | KeyQuota;
  /** The task's URL (the Location header). */
  location: string;
  rateLimit: RateLimits | null;
}

export interface Step {
  seq: number;
  kind: 'model' | 'tool' | 'agent';
  name: string;
  status: 'started' | 'ok' | 'failed' | 'cached' | 'degraded';
  duration_ms: number;
  detail?: string;
}

export interface Day {
  day: number;
  title: string;
  items: string[];
}

/** A finished plan. Its text comes from a model: show it as text, never as markup. */
export interface PlanResult {
  summary: string;
  days: Day[];
  warnings: WarningCode[];
  model: string;
  /** true: the built-in deterministic demo planner wrote it, not a language model. */
  offline: boolean;
  /** The language the plan is written in: mark it up with lang. */
  language: Language;
  /** true: served from a plan cached for the same request; no tokens were spent. */
  cached?: boolean;
}

/**
 * An external agent's answer: Markdown text (at most 64 KiB of UTF-8).
 * Render it with a safe subset (headings, paragraphs, lists, emphasis,
 * code, http(s) links), never as HTML.
 */
export interface TextResult {
  text: string;
  title?: string;
  warnings: WarningCode[];
  /** The model the agent was given. */
  model: string;
  language: Language;
}

/** A finished task's result: a plan, or an agent's text (tell them apart by "text" in result). */
export type Result = PlanResult | TextResult;

/** A task's request as admitted (NFKC, trimmed, language resolved). */
export type TaskInput =
  | { destination: string; days: number; interests: string[]; language: Language }
  | { prompt: string; language: Language };

export interface Task {
  id: string;
  status: TaskStatus;
  created_at: string;
  updated_at: string;
  request: TaskInput;
  steps: Step[];
  warnings: WarningCode[];
  result?: Result;
  usage: { prompt_tokens: number; completion_tokens: number };
  error?: { code: TaskErrorCode; message: string };
}

/** GET /api/config. */
export interface Config {
  turnstile_site_key: string;
  turnstile_script_url: string;
  /** true: only the dummy token XXXX.DUMMY.TOKEN.XXXX passes; load no widget. */
  turnstile_test: boolean;
  dev_mode: boolean;
  model_status: 'ok' | 'degraded' | 'unavailable';
  offline_model: boolean;
  /** The body POST /api/tasks takes: TaskRequest ("trip") or PromptRequest ("prompt"). */
  input: 'trip' | 'prompt';
  /** Daily and per-minute counts, and both forms' bounds in code points of NFKC. */
  limits: {
    ip_daily: number;
    global_daily: number;
    requests_per_minute: number;
    prompt_max_chars: number;
    destination_max: number;
    days_min: number;
    days_max: number;
    interests_max: number;
    interest_max: number;
  };
  languages: Language[];
}

/** GET /api/usage (API keys only). */
export interface UsageReport {
  principal: { kind: 'key'; id: string };
  tier: string;
  /** Today, UTC, as YYYY-MM-DD. */
  day: string;
  limits: {
    tasks_per_day: number;
    tokens_per_day: number;
    tokens_per_minute: number;
    requests_per_minute: number;
    /** 0: no second window. */
    requests_per_second: number;
    /** 0: no hourly quota. */
    tokens_per_hour: number;
    /** With an hourly quota: the share from which the key is throttled, and its window then. */
    soft_at?: number;
    soft_requests_per_minute?: number;
    max_site_share: number;
  };
  used: { tasks: number; tokens: number };
  remaining: { tasks: number; tokens: number };
  /** Past the soft share of the hour: held to soft_requests_per_minute, model calls to the fallback first. */
  throttled: boolean;
  /** With an hourly quota: the sliding hour's tokens, charged and held by calls in flight. */
  hour?: { tokens: number; remaining: number; soft_tokens: number };
}

/** One event of a task stream. */
export type StreamEvent =
  | { type: 'status'; id: string; data: { status: TaskStatus } }
  | { type: 'step'; id: string; data: Step }
  | { type: 'done'; id: string; data: Task };

/** Every failure of the client. */
export class FaregateError extends Error {
  name: 'FaregateError';
  code: ErrorCode | ClientErrorCode | (string & {});
  /** The HTTP status; 0 when no answer came. */
  status: number;
  /** The server's request id, for support. */
  requestId: string;
  /** Retry-After in seconds, or null. */
  retryAfter: number | null;
  /** On invalid_request: a message per wrong field. */
  fields: Record<string, string> | null;
  rateLimit: RateLimits | null;
}

export interface ClientOptions {
  /** Another origin's server, e.g. "https://plans.example"; it must list this page's origin in FAREGATE_CORS_ORIGINS. Default: this origin. */
  baseUrl?: string;
  /** An API key (fg_…), sent as a Bearer token: no Turnstile token needed; the key's own limits apply. */
  apiKey?: string;
  /** A fetch to use instead of the global one. */
  fetch?: typeof fetch;
  /** Milliseconds between polls. Default 2000. */
  pollInterval?: number;
  /** Milliseconds before a closed stream is resumed when the server sent no retry. Default 1000. */
  reconnectDelay?: number;
  /** Milliseconds of silence after which a stream counts as dead (the server sends a keep-alive every 15 s). Default 45000. */
  idleTimeout?: number;
  /** Stream connections in a row that bring no event before follow() polls instead. Default 3. */
  maxStreamFailures?: number;
}

export interface RequestOptions {
  signal?: AbortSignal;
}

export interface EventsOptions extends RequestOptions {
  /** Resume after this event id. */
  lastEventId?: string;
}

export interface FollowOptions extends EventsOptions {
  onStatus?(status: TaskStatus): void;
  /** A step started or ended; a step is reported again under the same seq when it ends. */
  onStep?(step: Step, eventId: string): void;
  /** A whole task: each snapshot while polling, and the final task. */
  onTask?(task: Task): void;
  /** "stream" once the first event arrives; "poll" when no stream can be had, with the reason. */
  onMode?(mode: 'stream' | 'poll', reason: FaregateError | null): void;
  /** A poll failed and will be retried after delayMs (e.g. network, rate_limited, server_busy). */
  onRetry?(error: FaregateError, delayMs: number): void;
}

export interface FaregateClient {
  config(options?: RequestOptions): Promise<Config>;
  /** The body's form is the one Config.input names. */
  createTask(request: TaskRequest | PromptRequest, options?: RequestOptions): Promise<Accepted>;
  getTask(id: string, options?: RequestOptions): Promise<Task>;
  usage(options?: RequestOptions): Promise<UsageReport>;
  /** The task's event stream, resumed after closes without done; ends after done. Refusals are thrown. */
  events(id: string, options?: EventsOptions): AsyncGenerator<StreamEvent, void, undefined>;
  /** Follows a task to its final state by stream, falling back to polling; resolves with the final task. */
  follow(id: string, options?: FollowOptions): Promise<Task>;
}

export function createClient(options?: ClientOptions): FaregateClient;

export function isFinal(status: string): status is 'succeeded' | 'failed';

/** Retry-After (seconds or an HTTP date) as whole seconds from now, or null. */
export function parseRetryAfter(value: string | number | null | undefined, now?: number): number | null;

/** The RateLimit and RateLimit-Policy headers by policy name, or null. */
export function parseRateLimit(rateLimit: string | null | undefined, policy?: string | null): RateLimits | null;
