package api

import (
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/aitf"
	"faregate/protect/principal"
	"faregate/protect/ratelimit"
)

// TestServerBuildsItsAITFGuard: with Deps.AITFOptions the server builds the
// guard and joins it to itself: its observe-mode verdicts are counted in
// the refusal summary and its refusal is the documented envelope. (cmd
// used to join them through closures over a *Server assigned later.)
func TestServerBuildsItsAITFGuard(t *testing.T) {
	srv := NewServer(Deps{Registry: prometheus.NewRegistry(), AITFOptions: &aitf.Options{Mode: aitf.ModeObserve, Threshold: 0.05}})
	g := srv.s.d.AITF
	if g == nil {
		t.Fatal("no guard built")
	}
	body := `{"destination":"Rome","days":1,"tool_call_id":"call_abc123","recursion_depth":4,"mode":"batch_process","retry_strategy":{"max_retries":5}}`
	h := g.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) }))
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, "/api/tasks", strings.NewReader(body)))
	var buf strings.Builder
	srv.s.summary.flush(slog.New(slog.NewTextHandler(&buf, nil)), time.Second)
	if !strings.Contains(buf.String(), `noted="aitf_observed=1"`) {
		t.Fatalf("observe-mode verdict not in the summary: %q", buf.String())
	}
	w := httptest.NewRecorder()
	srv.RefuseAITF(w, httptest.NewRequest(http.MethodGet, "/api/config", nil), 2*time.Second)
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "2" || !strings.Contains(w.Body.String(), `"code":"aitf_queue_full"`) {
		t.Fatalf("refusal %d %v %s", w.Code, w.Header(), w.Body)
	}
}

// TestForgetDenials: a reload's raise forgets the rate_limited refusals of
// every visitor (public raised) or of the keys named, and only those.
func TestForgetDenials(t *testing.T) {
	srv := NewServer(Deps{Registry: prometheus.NewRegistry()})
	v := principal.Principal{Kind: principal.KindVisitor, ID: strings.Repeat("a", 64)}
	acme, other := principal.Principal{Kind: principal.KindKey, ID: "acme"}, principal.Principal{Kind: principal.KindKey, ID: "other"}
	for _, p := range []principal.Principal{v, acme, other} {
		srv.s.limited.remember(p, ratelimit.ErrRateLimited, time.Minute)
		srv.s.memo.remember(p, ratelimit.ErrAnomalyBlocked, time.Minute)
	}
	refused := func(m *denials, p principal.Principal) bool { return errors.Is(m.refusal(p), ratelimit.ErrRateLimited) }
	srv.ForgetDenials(false, []string{"acme"})
	if refused(srv.s.limited, acme) || !refused(srv.s.limited, other) || !refused(srv.s.limited, v) {
		t.Fatal("raising key acme forgot the wrong refusals")
	}
	srv.ForgetDenials(true, nil)
	if refused(srv.s.limited, v) || !refused(srv.s.limited, other) {
		t.Fatal("raising the public tier forgot the wrong refusals")
	}
	if srv.s.memo.refusal(acme) == nil || srv.s.memo.refusal(v) == nil {
		t.Fatal("anomaly blocks (not the policy's) were forgotten")
	}
}
