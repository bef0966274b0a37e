package tools

import (
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strings"
	"unicode/utf8"

	"faregate/agent/chat"
	"faregate/agent/outbound"
	"faregate/protect/codes"
)

// Limits of fetch_page.
const (
	// MaxPageBytes is the most fetch_page reads of a page.
	MaxPageBytes = 1 << 20
	// MaxPageText is the most page text one observation carries: about
	// two thousand tokens, enough for an article without flooding the prompt.
	MaxPageText = 8000
	// MaxFetchRedirects bounds redirects; each hop is dialled through
	// SafeTransport again, so each is checked.
	MaxFetchRedirects = 3
	maxURLLen         = 2048
)

// fetchPage reads public pages through a SafeTransport-based client.
type fetchPage struct{ c *http.Client }

// NewFetchPage returns fetch_page. c must be built on SafeTransport (the
// outbound Transport's Base); this tool adds its own redirect limit and
// drops any cookie jar on a copy of c.
func NewFetchPage(c *http.Client) Tool {
	cc := *c
	cc.Jar = nil
	cc.CheckRedirect = func(req *http.Request, via []*http.Request) error {
		if len(via) > MaxFetchRedirects {
			return fmt.Errorf("%w (more than %d)", outbound.ErrTooManyRedirects, MaxFetchRedirects)
		}
		if req.URL.Scheme != "http" && req.URL.Scheme != "https" {
			return fmt.Errorf("%w: redirect to %s", ErrForbiddenAddress, req.URL.Scheme)
		}
		return nil
	}
	return fetchPage{c: &cc}
}

// Name implements Tool.
func (fetchPage) Name() string { return NameFetchPage }

// Definition implements Tool.
func (fetchPage) Definition() chat.ToolDef {
	return definition(NameFetchPage,
		"Fetch a public web page (http or https) and return its readable text, at most 8000 characters. Use it for a URL found by web_search.",
		"url", "an absolute http(s) URL, e.g. \"https://www.visitlisboa.com/en\"")
}

// Call implements Tool. A malformed URL is the model's mistake (no
// warning); a refused, unreachable or unreadable page is codes.FetchFailed.
func (f fetchPage) Call(ctx context.Context, args string) Observation {
	raw, ok := stringArg(args, "url", maxURLLen)
	if !ok {
		return badArgs(NameFetchPage, "url", `{"url": "https://example.org/page"}`, maxURLLen)
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return Observation{Failed: true, Text: fmt.Sprintf("fetch_page needs an absolute http or https URL; %q is not one.", raw)}
	}
	if u.User != nil {
		return Observation{Failed: true, Text: "fetch_page does not send credentials; remove the user:password part of the URL."}
	}
	u.Fragment = "" // never sent, and would split the cache for nothing

	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return Observation{Failed: true, Text: fmt.Sprintf("fetch_page cannot request %q.", raw)}
	}
	req.Header.Set("Accept", "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.1")
	resp, err := f.c.Do(req)
	if err != nil {
		return fetchFailed(u, reason(err))
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fetchFailed(u, fmt.Sprintf("the server answered %s", resp.Status))
	}
	// The outbound session already caps bodies; the limit is repeated here
	// so the tool keeps its promise whatever client it is given.
	body, err := io.ReadAll(io.LimitReader(resp.Body, MaxPageBytes))
	if err != nil {
		return fetchFailed(u, "the connection broke while reading the page")
	}

	// Name the page actually read: after redirects the model should cite
	// the final URL, not the one it asked for.
	final := resp.Request.URL.String()
	title, text, ok := pageText(resp.Header.Get("Content-Type"), body)
	if !ok {
		return fetchFailed(u, "it is not a text or HTML page")
	}
	text, cut := clip(text, MaxPageText)
	var b strings.Builder
	fmt.Fprintf(&b, "Page %s", final)
	if title != "" {
		fmt.Fprintf(&b, " — %s", title)
	}
	b.WriteString("\n\n")
	if text == "" {
		b.WriteString("(the page has no readable text)")
	}
	b.WriteString(text)
	if cut || len(body) == MaxPageBytes || resp.Header.Get(outbound.HeaderTruncated) == "true" {
		b.WriteString("\n\n[page truncated]")
	}
	return Observation{Text: b.String()}
}

func fetchFailed(u *url.URL, why string) Observation {
	return Observation{Failed: true, Warning: codes.FetchFailed,
		Text: fmt.Sprintf("Could not fetch %s: %s.", u.Redacted(), why)}
}

// reason turns a client error into words for the model; raw errors can
// carry internal detail that has no business in a prompt.
func reason(err error) string {
	switch {
	case errors.Is(err, ErrForbiddenAddress):
		return "the address is not on the public internet, so it is refused"
	case errors.Is(err, outbound.ErrTooManyRedirects):
		return fmt.Sprintf("it redirects more than %d times", MaxFetchRedirects)
	case errors.Is(err, context.DeadlineExceeded):
		return "it took too long"
	case errors.Is(err, context.Canceled):
		return "the task was cancelled"
	case errors.Is(err, ErrNoAddress):
		return "the host name does not resolve"
	}
	var dns *net.DNSError
	if errors.As(err, &dns) && dns.IsNotFound {
		return "the host name does not resolve"
	}
	return "the server could not be reached"
}

// pageText turns a body into readable text according to its media type,
// sniffing when the server does not say. ok is false for binary content.
func pageText(contentType string, body []byte) (title, text string, ok bool) {
	if contentType == "" {
		contentType = http.DetectContentType(body)
	}
	mt, params, err := mime.ParseMediaType(contentType)
	if err != nil {
		mt = strings.ToLower(strings.TrimSpace(strings.Split(contentType, ";")[0]))
	}
	s := decode(body, params["charset"])
	switch {
	case mt == "text/html" || mt == "application/xhtml+xml":
		title, text = htmlText(s)
		return title, text, true
	case strings.HasPrefix(mt, "text/"), mt == "application/json", mt == "application/xml",
		strings.HasSuffix(mt, "+json"), strings.HasSuffix(mt, "+xml"):
		return "", collapse(s), true
	}
	return "", "", false
}

// decode converts the body to valid UTF-8. Latin-1 is converted (it maps
// byte for byte onto Unicode); other legacy charsets would need
// golang.org/x/text, so their stray bytes are dropped instead.
func decode(b []byte, charset string) string {
	switch strings.ToLower(charset) {
	case "iso-8859-1", "latin1", "latin-1", "windows-1252", "cp1252", "us-ascii":
		if !utf8.Valid(b) {
			r := make([]rune, len(b))
			for i, c := range b {
				r[i] = rune(c)
			}
			return string(r)
		}
	}
	return strings.ToValidUTF8(string(b), "")
}
