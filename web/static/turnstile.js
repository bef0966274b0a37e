// The human check. With the local test verifier (turnstile_test) no widget
// script is loaded at all, since the machine may be offline, and the page
// sends Cloudflare's dummy token. Otherwise the Turnstile widget is rendered
// explicitly and its single-use token is handed out once per submission.

/** DUMMY_TOKEN is what Cloudflare's test site keys produce and the local verifier accepts. */
export const DUMMY_TOKEN = 'XXXX.DUMMY.TOKEN.XXXX';

/** ACTION is the Turnstile action the server may check on the token. */
export const ACTION = 'create-task';

/** DEFAULT_SCRIPT_URL is Cloudflare's widget script. */
export const DEFAULT_SCRIPT_URL = 'https://challenges.cloudflare.com/turnstile/v0/api.js';

// Turnstile calls a global function by name once its script has run;
// render=explicit keeps it from scanning the page for widgets itself.
const ONLOAD = 'faregateTurnstileReady';

/** scriptURL appends the explicit-render parameters, respecting an existing query. */
export function scriptURL(base, onload) {
  const url = base || DEFAULT_SCRIPT_URL;
  return url + (url.includes('?') ? '&' : '?') + 'render=explicit&onload=' + encodeURIComponent(onload);
}

/**
 * startHumanCheck sets up the check inside container and returns
 * {mode, token(), reset()}. onChange runs whenever a token appears or is
 * used up; onError(code) receives "turnstile_load" or "turnstile_widget".
 */
export function startHumanCheck({ config, container, lang, onChange, onError }) {
  if (config.turnstile_test) {
    return { mode: 'test', token: () => DUMMY_TOKEN, reset() {} };
  }
  let token = '';
  let widgetId = null;
  const check = {
    mode: 'widget',
    token: () => token,
    reset() {
      // Tokens verify once: after any submission, or expiry, ask for a new one.
      token = '';
      onChange();
      if (widgetId !== null && window.turnstile) window.turnstile.reset(widgetId);
    },
  };
  window[ONLOAD] = () => {
    delete window[ONLOAD];
    try {
      widgetId = window.turnstile.render(container, {
        sitekey: config.turnstile_site_key,
        action: ACTION,
        language: lang === 'zh-CN' ? 'zh-cn' : 'en',
        callback: (t) => {
          token = typeof t === 'string' ? t : '';
          onChange();
        },
        'error-callback': () => {
          token = '';
          onChange();
          onError('turnstile_widget');
          // Returning true tells Turnstile the error was handled, so it
          // does not throw; it keeps retrying on its own.
          return true;
        },
        'expired-callback': () => check.reset(),
        'timeout-callback': () => check.reset(),
      });
    } catch {
      onError('turnstile_widget');
    }
  };
  const script = document.createElement('script');
  script.src = scriptURL(config.turnstile_script_url, ONLOAD);
  script.async = true;
  script.addEventListener('error', () => onError('turnstile_load'));
  document.head.append(script);
  return check;
}
