package aitf

import (
	"encoding/json"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// agentBody builds a realistic agent request of exactly size bytes: the
// kind of body an LLM agent loop sends to a tool API, with its sampling
// parameters, trace ids, tool call identity and a growing message history.
func agentBody(size int) []byte {
	head := `{"model":"gpt-4o-2024-08-06","temperature":0.2,"top_p":0.95,"max_tokens":1024,` +
		`"run_id":"3f2b9c1e-8a4d-4e21-9b7a-0c5d2e6f1a93","parent_run_id":"9d1c0b7e-2f4a-4c8e-a1d3-5b6e7f809a12",` +
		`"tool_call_id":"call_Jx7QmN2pR4vT8wYz","recursion_depth":3,"mode":"auto_chain",` +
		`"metadata":{"confidence":0.82,"source":"planner","step":4},` +
		`"query":{"doc_id":"doc_78912","fields":["title","body","links"]},"messages":[`
	msg := `{"role":"assistant","content":"Thought: the previous page linked to the next section, so I will fetch it and continue the summary.","tool_calls":[{"id":"call_a1","type":"function","function":{"name":"fetch_doc","arguments":"{\"doc_id\":\"doc_78911\"}"}}]},` +
		`{"role":"tool","tool_call_id":"call_a1","content":"Section 4.2 describes the retry semantics of the ingestion pipeline in detail, including backoff."},`
	const last, end = `{"role":"user","content":"`, `"}]}`
	var b strings.Builder
	b.WriteString(head)
	for b.Len()+len(msg)+len(last)+len(end)+1 <= size {
		b.WriteString(msg)
	}
	// Pad the last user message so the body is exactly size bytes.
	b.WriteString(last)
	b.WriteString(strings.Repeat("y", max(size-b.Len()-len(end), 1)))
	b.WriteString(end)
	return []byte(b.String())
}

// cleanBody is the page's task body padded with a free-text note to size
// bytes: no signal at all.
func cleanBody(size int) []byte {
	b := strings.TrimSuffix(pageBody(7), "}") + `,"notes":"`
	pad := max(size-len(b)-2, 0)
	return []byte(b + strings.Repeat("a quiet trip ", pad/13+1)[:pad] + `"}`)
}

func TestBenchBodies(t *testing.T) {
	for _, size := range []int{1 << 10, 16 << 10} {
		b := agentBody(size)
		if len(b) < size-64 || len(b) > size+64 || !json.Valid(b) {
			t.Errorf("agentBody(%d): %d bytes, valid %v", size, len(b), json.Valid(b))
		}
		if s, v := Score(b); s < 0.9 {
			t.Errorf("agentBody(%d) scores %.3f (%s), want ≥ 0.9", size, s, v)
		}
		if s, v := baselineScore(b); s < 0.9 {
			t.Errorf("baseline on agentBody(%d) scores %.3f (%s), want ≥ 0.9", size, s, v)
		}
	}
	c := cleanBody(1 << 10)
	if len(c) != 1<<10 || !json.Valid(c) {
		t.Errorf("cleanBody: %d bytes, valid %v", len(c), json.Valid(c))
	}
	if s, _ := Score(c); s != 0 {
		t.Errorf("cleanBody scores %.3f, want 0", s)
	}
}

func BenchmarkScore(b *testing.B) {
	cases := []struct {
		name string
		body []byte
	}{
		{"1KiB", agentBody(1 << 10)},
		{"16KiB", agentBody(16 << 10)},
		{"clean-1KiB", cleanBody(1 << 10)},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(c.body)))
			b.ReportAllocs()
			cpu0 := cpuTime()
			for b.Loop() {
				Score(c.body)
			}
			// The CPU the process spent, unlike ns/op, holds still on a
			// machine other work shares: Score allocates nothing, so it is
			// Score's own.
			b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/op")
		})
	}
}

// cpuTime is the CPU time this process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func BenchmarkDecodeBaseline(b *testing.B) {
	cases := []struct {
		name string
		body []byte
	}{
		{"1KiB", agentBody(1 << 10)},
		{"16KiB", agentBody(16 << 10)},
		{"clean-1KiB", cleanBody(1 << 10)},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(c.body)))
			b.ReportAllocs()
			for b.Loop() {
				baselineScore(c.body)
			}
		})
	}
}

// BenchmarkSpeedup reports how many times faster Score is than the
// decoding baseline on the same body, as the metric "x-faster": the median,
// over the benchmark's rounds, of one round's ratio. In a round the two run
// back to back in short batches, the baseline's garbage collected before
// the scanner's batch starts, so a machine whose load changes during the
// run skews the ratio less than two separate benchmarks would;
// BenchmarkScore and BenchmarkDecodeBaseline give the absolute numbers.
func BenchmarkSpeedup(b *testing.B) {
	for _, size := range []int{1 << 10, 16 << 10} {
		body := agentBody(size)
		b.Run(strconv.Itoa(size>>10)+"KiB", func(b *testing.B) {
			// About 20 µs of scanning per batch.
			batch := max(1, 20*(16<<10)/len(body))
			var ratios []float64
			for b.Loop() {
				b.StopTimer()
				runtime.GC()
				b.StartTimer()
				t0 := time.Now()
				for range batch {
					Score(body)
				}
				t1 := time.Now()
				for range batch {
					baselineScore(body)
				}
				ratios = append(ratios, float64(time.Since(t1))/float64(t1.Sub(t0)))
			}
			slices.Sort(ratios)
			b.ReportMetric(ratios[len(ratios)/2], "x-faster")
		})
	}
}

// baselineScore is the naive approach the scanner is measured against:
// decode the whole body into map[string]any and walk it for the same keys,
// with the same rules.
func baselineScore(body []byte) (float64, Vector) {
	var doc any
	if err := json.Unmarshal(body, &doc); err != nil {
		return 0, Vector{}
	}
	var s scanner
	walk(&s, doc, kNone)
	return combine(s.out.vec), s.out.vec
}

var keyReplacer = strings.NewReplacer("_", "", "-", "", ".", "", " ", "")

func walk(s *scanner, node any, parent uint8) {
	switch n := node.(type) {
	case map[string]any:
		for k, child := range n {
			spec := lookupKey([]byte(strings.ToLower(keyReplacer.Replace(k))))
			if spec.id != kNone && !s.settled(spec) {
				v := baselineValue(child)
				s.apply(spec, parent, &v)
			}
			walk(s, child, spec.id)
		}
	case []any:
		for _, child := range n {
			walk(s, child, parent)
		}
	}
}

func baselineValue(x any) value {
	switch x := x.(type) {
	case string:
		v := value{kind: vString, raw: []byte(x)}
		if n, j := parseNumber(v.raw, 0); len(v.raw) > 0 && j == len(v.raw) {
			v.num, v.isNum = n, true
		}
		return v
	case float64:
		return value{kind: vNumber, num: x, isNum: true}
	case bool:
		if x {
			return value{kind: vTrue}
		}
		return value{kind: vFalse}
	case map[string]any:
		return value{kind: vObject, empty: len(x) == 0}
	case []any:
		return value{kind: vArray, empty: len(x) == 0}
	}
	return value{kind: vNull}
}
