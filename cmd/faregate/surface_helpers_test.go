package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	neturl "net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Helpers of the public-surface tests (#7): event streams held on raw
// connections, metrics and Redis counters read as numbers, log lines
// parsed, and a model that holds one task running until the test lets go.

// heldLLM is a fake model whose calls for the destination hold wait until
// release is called; every other call answers a one-day plan at once. The
// release also runs when the test ends, before the fake closes, so no
// handler is left waiting whatever the test did.
func heldLLM(t testing.TB, hold string) (llm *fakeLLM, release func()) {
	t.Helper()
	ch := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	llm = newFakeLLM(t, func(req chatRequest, _ int) fakeReply {
		if strings.Contains(fmt.Sprint(req.Messages), hold) {
			<-ch
		}
		return fakeReply{Content: itinerary(1, "")}
	})
	t.Cleanup(release)
	return llm, release
}

// oneDayBody is a valid creation for a one-day trip (what heldLLM plans).
func oneDayBody(dest string) string {
	return fmt.Sprintf(`{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":%q,"days":1}`, dest)
}

// startHeldTask creates a task for hold and waits until its model call is
// under way, so the task is running and stays so until release.
func startHeldTask(t testing.TB, s *server, llm *fakeLLM, hold string, header map[string]string) string {
	t.Helper()
	r := do(t, "POST", s.URL+"/api/tasks", oneDayBody(hold), header)
	if r.Status != 202 {
		t.Fatalf("create the followed task: %d %s", r.Status, r.Raw)
	}
	pollUntil(t, 20*time.Second, "the followed task's model call started", func() bool { return llmAsked(llm, hold) })
	return r.Body["id"].(string)
}

func llmAsked(llm *fakeLLM, hold string) bool {
	for _, req := range llm.Requests() {
		if strings.Contains(fmt.Sprint(req.Messages), hold) {
			return true
		}
	}
	return false
}

// rawStream is one GET on a connection of its own, read by hand: a test can
// hold a thousand of them, and it sees each answer as the server wrote it.
type rawStream struct {
	conn   net.Conn
	req    *http.Request
	resp   *http.Response
	events *bufio.Reader // the SSE body of a 200
	raw    []byte        // the body of any other answer
}

// hostPort is the host:port of a base URL.
func hostPort(base string) string {
	u, err := neturl.Parse(base)
	if err != nil {
		panic(err)
	}
	return u.Host
}

// openStream sends GET path on a new connection. A 200 is held open after
// its first line (the retry preamble, so the server has taken the stream);
// any other answer is read whole and its connection closed. Every answer is
// checked against the OpenAPI document.
func openStream(t testing.TB, base, path string, header map[string]string) (*rawStream, error) {
	return openStreamChecked(t, base, path, header, true)
}

// openStreamChecked is openStream, with the OpenAPI check only when check
// is set: a measurement checks a sample, so the test's own validation does
// not compete with the server it measures for the CPU.
func openStreamChecked(t testing.TB, base, path string, header map[string]string, check bool) (*rawStream, error) {
	conn, err := net.DialTimeout("tcp", hostPort(base), 20*time.Second)
	if err != nil {
		return nil, err
	}
	req, _ := http.NewRequest("GET", base+path, nil)
	req.Header.Set("Accept", "text/event-stream")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	if err := req.Write(conn); err != nil {
		conn.Close()
		return nil, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		conn.Close()
		return nil, err
	}
	st := &rawStream{conn: conn, req: req, resp: resp}
	if resp.StatusCode != http.StatusOK {
		st.raw, err = io.ReadAll(resp.Body)
		conn.Close()
		if check {
			if cerr := openAPI.Check(req, resp.StatusCode, resp.Header, st.raw); cerr != nil {
				t.Errorf("OpenAPI: %v", cerr)
			}
		}
		return st, err
	}
	if check {
		if cerr := openAPI.Check(req, resp.StatusCode, resp.Header, nil); cerr != nil {
			t.Errorf("OpenAPI: %v", cerr)
		}
	}
	st.events = bufio.NewReader(resp.Body)
	line, err := st.events.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "retry:") {
		conn.Close()
		return nil, fmt.Errorf("stream preamble %q: %v", line, err)
	}
	_ = conn.SetDeadline(time.Time{})
	return st, nil
}

// code is the error code of a refused stream.
func (s *rawStream) code() string {
	var body map[string]any
	_ = json.Unmarshal(s.raw, &body)
	return reply{Body: body}.code()
}

// held reports whether the server took the stream.
func (s *rawStream) held() bool { return s.resp.StatusCode == http.StatusOK }

// close hangs up.
func (s *rawStream) close() { _ = s.conn.Close() }

// waitDone reads events until the done event, and reports whether it came
// within d.
func (s *rawStream) waitDone(d time.Duration) bool {
	_ = s.conn.SetReadDeadline(time.Now().Add(d))
	for {
		line, err := s.events.ReadString('\n')
		if err != nil {
			return false
		}
		if strings.TrimSpace(line) == "event: done" {
			return true
		}
	}
}

// scrapeMetrics reads /metrics on a connection of its own that is closed after,
// so scraping never holds a connection the test counts.
func scrapeMetrics(t testing.TB, base string) string {
	t.Helper()
	c := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get(base + "/metrics")
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("scrape: %d", resp.StatusCode)
	}
	return string(raw)
}

// seriesValue is the value of one series in a Prometheus text exposition,
// named exactly as exposed (`name` or `name{label="v"}`); 0 when absent.
func seriesValue(text, series string) float64 {
	for _, line := range strings.Split(text, "\n") {
		if rest, ok := strings.CutPrefix(line, series+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err == nil {
				return v
			}
		}
	}
	return 0
}

// serverSeries scrapes the server and returns one series' value.
func serverSeries(t testing.TB, s *server, series string) float64 {
	t.Helper()
	return seriesValue(scrapeMetrics(t, s.URL), series)
}

// infoField returns one field of INFO section as an integer.
func infoField(t testing.TB, c *redis.Client, section, field string) int64 {
	t.Helper()
	text, err := c.Info(context.Background(), section).Result()
	if err != nil {
		t.Fatalf("INFO %s: %v", section, err)
	}
	for _, line := range strings.Split(text, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			n, err := strconv.ParseInt(rest, 10, 64)
			if err != nil {
				t.Fatalf("INFO %s %s = %q", section, field, rest)
			}
			return n
		}
	}
	return 0
}

// redisCommandCalls is how many times Redis ran cmd (INFO commandstats).
func redisCommandCalls(t testing.TB, c *redis.Client, cmd string) int64 {
	t.Helper()
	text, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatalf("INFO commandstats: %v", err)
	}
	for _, line := range strings.Split(text, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+cmd+":calls=")
		if !ok {
			continue
		}
		n, _ := strconv.ParseInt(strings.SplitN(rest, ",", 2)[0], 10, 64)
		return n
	}
	return 0
}

// opsMeter counts the commands a Redis processes over an interval, less
// the INFO calls that read the counter.
type opsMeter struct {
	c     *redis.Client
	start time.Time
	n0    int64
}

func startOps(t testing.TB, c *redis.Client) *opsMeter {
	return &opsMeter{c: c, start: time.Now(), n0: infoField(t, c, "stats", "total_commands_processed")}
}

// rate returns the commands per second since start, and how many.
func (m *opsMeter) rate(t testing.TB) (perSec float64, n int64) {
	n = infoField(t, m.c, "stats", "total_commands_processed") - m.n0 - 1
	return float64(n) / time.Since(m.start).Seconds(), n
}

// jsonLogLines parses the JSON log lines in text (the harness logs JSON).
func jsonLogLines(text string) []map[string]any {
	var out []map[string]any
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

// refusalSummary adds up the refusal summary lines in text: the total and
// the counts by code.
func refusalSummary(text string) (total int64, byCode map[string]int64, lines int) {
	byCode = map[string]int64{}
	for _, l := range jsonLogLines(text) {
		if l["msg"] != "refused requests" {
			continue
		}
		lines++
		if n, ok := l["total"].(float64); ok {
			total += int64(n)
		}
		codes, _ := l["codes"].(string)
		for _, kv := range strings.Fields(codes) {
			k, v, _ := strings.Cut(kv, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			byCode[k] += n
		}
	}
	return total, byCode, lines
}

// nearestRank is the p-th percentile (0 < p ≤ 100) of ds, nearest rank.
func nearestRank(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.999999) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// answerTally counts answers by "status code" under a lock.
type answerTally struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *answerTally) add(status int, code string) {
	k := strconv.Itoa(status)
	if code != "" {
		k += " " + code
	}
	c.mu.Lock()
	if c.m == nil {
		c.m = map[string]int{}
	}
	c.m[k]++
	c.mu.Unlock()
}

func (c *answerTally) get(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[k]
}

// withCode counts the answers with code, whatever their status.
func (c *answerTally) withCode(code string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for k, v := range c.m {
		if strings.HasSuffix(k, " "+code) {
			n += v
		}
	}
	return n
}

func (c *answerTally) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprint(c.m)
}

// runWorkers runs f(i) for i in [0, n) on workers goroutines.
func runWorkers(n, workers int, f func(i int)) {
	var wg sync.WaitGroup
	next := make(chan int)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				f(i)
			}
		}()
	}
	for i := 0; i < n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
}

// docVisitorIP is the i-th of many distinct visitors' addresses: IPv6 /64s of
// the documentation range, each its own visitor.
func docVisitorIP(i int) string { return fmt.Sprintf("2001:db8:%x:%x::1", i>>16, i&0xffff) }

// keepAliveClient keeps up to n idle connections per host: the shared
// client keeps 2, so n concurrent workers through it would open a new
// connection for most requests, and measure the dialling, not the server.
func keepAliveClient(t testing.TB, n int) *http.Client {
	tr := &http.Transport{MaxIdleConns: n, MaxIdleConnsPerHost: n, IdleConnTimeout: time.Minute}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 60 * time.Second}
}

// doOn is do through client c: the same request, and the same OpenAPI
// check when check is set. (A flood checks a sample: the validator compiles
// the response's schema on every call, which costs more than the server's
// whole answer and would slow a flood to a crawl on a busy machine.)
func doOn(t testing.TB, c *http.Client, check bool, method, url, body string, header map[string]string) reply {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range header {
		if v == "" {
			req.Header.Del(k) // "" removes a header doOn would send
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Errorf("%s %s: %v", method, url, err)
		return reply{}
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if check {
		if err := openAPI.Check(req, resp.StatusCode, resp.Header, raw); err != nil {
			t.Errorf("OpenAPI: %v", err)
		}
	}
	r := reply{Status: resp.StatusCode, Header: resp.Header, Raw: raw}
	_ = json.Unmarshal(raw, &r.Body)
	return r
}
