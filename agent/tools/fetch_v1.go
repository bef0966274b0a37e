package tools

import (
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"

	"golang.org/x/net/idna"

	"faregate/agent/outbound"
)

// ErrFetchRefused: a fetch for an external agent (POST /v1/tools/fetch)
// named no public http(s) address, was redirected to one that is not, or
// could not be fetched at all.
var ErrFetchRefused = errors.New("tools: fetch refused")

// Bounds of Fetch.
const (
	// DefaultFetchBytes is what Fetch reads when the caller names no
	// bound; MaxPageBytes the most it ever reads.
	DefaultFetchBytes = 256 << 10
)

// Fetched is a page as an external agent gets it.
type Fetched struct {
	Status      int    `json:"status"`
	ContentType string `json:"content_type"`
	Text        string `json:"text"`
	Truncated   bool   `json:"truncated"`
}

// CheckFetchURL refuses, with ErrFetchRefused, what Fetch would refuse
// without asking the network: a URL that is not an absolute http(s) one,
// carries credentials, or names a literal address that is not public (a
// name is judged by what it resolves to, when Fetch dials). The endpoint
// checks it before it counts a tool call: a refusal that cost nothing
// spends none of the task's calls.
func CheckFetchURL(raw string) error {
	u, err := checkFetchURL(raw)
	if err != nil {
		return err
	}
	a, literal, err := hostAddr(u.Hostname())
	switch {
	case err != nil:
		return fmt.Errorf("%w: %v", ErrFetchRefused, err)
	case literal && !IsPublic(a):
		return fmt.Errorf("%w: not a public address", ErrFetchRefused)
	}
	return nil
}

// hostAddr reads host as an address literal in any form a resolver or a
// browser would take for one: IPv6 (with a zone, or an IPv4 address
// inside), dotted decimal, and the older IPv4 forms inet_aton and the URL
// standard accept, where each part may be decimal, octal (a leading 0) or
// hex (0x), and the last part fills the bytes the parts before it left
// (0 is 0.0.0.0, 2130706433 and 0x7f000001 and 0177.0.0.1 and 127.1 are
// 127.0.0.1); full-width digits and dots are read as ASCII first, as IDNA
// maps them. literal is false for a name. A host that ends in a number but
// is no address (256.1, 1.2.3.4.5) is an error: no name can end so, and a
// resolver may read it as something else.
func hostAddr(host string) (a netip.Addr, literal bool, err error) {
	if mapped, err := idna.Lookup.ToASCII(host); err == nil {
		host = mapped
	}
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	if a, err := netip.ParseAddr(host); err == nil {
		return a, true, nil
	}
	parts := strings.Split(host, ".")
	if !isNumber(parts[len(parts)-1]) {
		return netip.Addr{}, false, nil
	}
	if a, ok := looseIPv4(parts); ok {
		return a, true, nil
	}
	return netip.Addr{}, false, errors.New("the host ends in a number but is not an IPv4 address")
}

// isNumber reports whether s is an IPv4 part in the URL standard's sense
// (decimal digits, or 0x and hex digits): a host whose last label is one
// must be an address.
func isNumber(s string) bool {
	if h, ok := strings.CutPrefix(s, "0x"); ok {
		return strings.Trim(h, "0123456789abcdef") == ""
	}
	return s != "" && strings.Trim(s, "0123456789") == ""
}

// looseIPv4 reads 1 to 4 parts as inet_aton does.
func looseIPv4(parts []string) (netip.Addr, bool) {
	if len(parts) > 4 {
		return netip.Addr{}, false
	}
	var v uint64
	for i, p := range parts {
		n, ok := ipv4Part(p)
		last := i == len(parts)-1
		// Every part but the last is one byte; the last fills the rest.
		if !ok || (!last && n > 0xff) || (last && n >= 1<<(8*(5-len(parts)))) {
			return netip.Addr{}, false
		}
		if last {
			v = v<<(8*(5-len(parts))) | n
		} else {
			v = v<<8 | n
		}
	}
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}), true
}

// ipv4Part reads one part: 0x hex, 0 octal, else decimal; at most 32 bits.
func ipv4Part(p string) (uint64, bool) {
	base := 10
	switch {
	case strings.HasPrefix(p, "0x"):
		p, base = p[2:], 16
		if p == "" {
			return 0, true // "0x" alone is 0, as the URL standard reads it
		}
	case len(p) > 1 && p[0] == '0':
		p, base = p[1:], 8
	}
	n, err := strconv.ParseUint(p, base, 32)
	return n, err == nil && p != ""
}

// checkFetchURL is CheckFetchURL without the address: Fetch leaves that
// to its client's dial (SafeTransport, whose Policy may allow more).
func checkFetchURL(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Hostname() == "" || len(raw) > maxURLLen {
		return nil, fmt.Errorf("%w: not an absolute http(s) URL", ErrFetchRefused)
	}
	if u.User != nil {
		return nil, fmt.Errorf("%w: credentials in the URL", ErrFetchRefused)
	}
	return u, nil
}

// Fetch GETs raw through c, which must be built like fetch_page's (an
// outbound session on SafeTransport: public addresses only, honest
// identity, one answer per task for the same request, capped retries),
// reading at most maxBytes (0: DefaultFetchBytes; at most MaxPageBytes).
// A text or HTML page becomes its readable text; any other answer keeps
// its status and type with no text. Every failure before an answer is
// ErrFetchRefused, wrapped with the reason.
func Fetch(ctx context.Context, c *http.Client, raw string, maxBytes int64) (Fetched, error) {
	if maxBytes <= 0 {
		maxBytes = DefaultFetchBytes
	}
	maxBytes = min(maxBytes, MaxPageBytes)
	u, err := checkFetchURL(raw)
	if err != nil {
		return Fetched{}, err
	}
	u.Fragment = ""
	cc := *NewFetchPage(c).(fetchPage).c
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return Fetched{}, fmt.Errorf("%w: %v", ErrFetchRefused, err)
	}
	req.Header.Set("Accept", "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.1")
	resp, err := cc.Do(req)
	if err != nil {
		return Fetched{}, fmt.Errorf("%w: %s", ErrFetchRefused, reason(err))
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBytes+1))
	if err != nil {
		return Fetched{}, fmt.Errorf("%w: the connection broke while reading the page", ErrFetchRefused)
	}
	cut := int64(len(body)) > maxBytes || resp.Header.Get(outbound.HeaderTruncated) == "true"
	if int64(len(body)) > maxBytes {
		body = body[:maxBytes]
	}
	ct := resp.Header.Get("Content-Type")
	out := Fetched{Status: resp.StatusCode, ContentType: mediaType(ct), Truncated: cut}
	if _, text, ok := pageText(ct, body); ok {
		out.Text = text
	}
	return out, nil
}

// mediaType is a Content-Type without its parameters.
func mediaType(ct string) string {
	if mt, _, err := mime.ParseMediaType(ct); err == nil {
		return mt
	}
	return strings.ToLower(strings.TrimSpace(strings.Split(ct, ";")[0]))
}
