package alert

import (
	"net/netip"
	"regexp"
	"strings"
)

// Alerts leave the process (a webhook, a chat channel) and land in logs, so
// they must not carry a visitor's IP, and a visitor's HMAC key only cut
// short: enough to match log lines, not to re-identify across systems.

// visitorHash matches a visitor key: 64 hex digits.
var visitorHash = regexp.MustCompile(`\b[0-9a-fA-F]{64}\b`)

// shortHash is how many hex digits of a visitor key an alert keeps.
const shortHash = 12

// clean fills defaults and scrubs Scope and string Details.
func clean(a Alert) Alert {
	if a.Severity == "" {
		a.Severity = Warning
	}
	if a.Scope == "" {
		a.Scope = "site"
	}
	a.Scope = scrub(a.Scope)
	if a.Text == "" {
		a.Text = a.Event + " (" + a.Scope + ")"
	} else {
		a.Text = scrub(a.Text)
	}
	if len(a.Details) > 0 {
		d := make(map[string]any, len(a.Details))
		for k, v := range a.Details {
			if s, ok := v.(string); ok {
				v = scrub(s)
			}
			d[k] = v
		}
		a.Details = d
	}
	return a
}

// scrub cuts visitor hashes short and replaces anything that parses as an
// IP address (alone, after a "label:" prefix, or as a word) by "ip-redacted".
func scrub(s string) string {
	s = visitorHash.ReplaceAllStringFunc(s, func(h string) string { return h[:shortHash] })
	if isAddr(s) {
		return "ip-redacted"
	}
	if i := strings.IndexByte(s, ':'); i >= 0 && isAddr(s[i+1:]) {
		return s[:i+1] + "ip-redacted"
	}
	if !strings.ContainsAny(s, ".:") {
		return s
	}
	words := strings.Fields(s)
	changed := false
	for i, w := range words {
		if isAddr(strings.Trim(w, "()[],;\"'")) {
			words[i] = "ip-redacted"
			changed = true
		}
	}
	if !changed {
		return s
	}
	return strings.Join(words, " ")
}

func isAddr(s string) bool {
	if _, err := netip.ParseAddr(s); err == nil {
		return true
	}
	if _, err := netip.ParsePrefix(s); err == nil {
		return true
	}
	if ap, err := netip.ParseAddrPort(s); err == nil && ap.IsValid() {
		return true
	}
	return false
}
