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
	"strings"

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
	if a, err := netip.ParseAddr(u.Hostname()); err == nil && !IsPublic(a) {
		return fmt.Errorf("%w: not a public address", ErrFetchRefused)
	}
	return nil
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
