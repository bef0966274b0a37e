package agent

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/tmc/langchaingo/llms"

	"faregate/agent/guide"
	"faregate/agent/tools"
	"faregate/protect/redistest"
)

func TestParseAnswer(t *testing.T) {
	good := `{"summary":"S","days":[{"day":1,"title":"T","items":["a"," "]},{"day":2,"title":"U","items":["b"]}]}`
	cases := []struct {
		name, text string
		days       int
		ok         bool
	}{
		{"valid", good, 2, true},
		{"fenced with prose", "Here you go:\n```json\n" + good + "\n```", 2, true},
		{"wrong day count", good, 3, false},
		{"no summary", `{"days":[{"day":1,"title":"T","items":["a"]}]}`, 1, false},
		{"misnumbered", `{"summary":"S","days":[{"day":2,"title":"T","items":["a"]}]}`, 1, false},
		{"empty items", `{"summary":"S","days":[{"day":1,"title":"T","items":[" "]}]}`, 1, false},
		{"not json", "I cannot plan that.", 1, false},
		{"truncated", good[:40], 2, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, days, err := parseAnswer(tc.text, tc.days)
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v, want ok=%v", err, tc.ok)
			}
			if tc.ok && len(days[0].Items) != 1 {
				t.Fatalf("blank items not dropped: %v", days[0].Items)
			}
		})
	}
}

func TestCanonicalArgs(t *testing.T) {
	same := []string{`{"location":"Lisbon","units":"c"}`, `{ "units":"c", "location" : "lisbon " }`}
	if canonicalArgs(same[0]) != canonicalArgs(same[1]) {
		t.Fatalf("%q != %q", canonicalArgs(same[0]), canonicalArgs(same[1]))
	}
	if canonicalArgs(`{"location":"Lisbon"}`) == canonicalArgs(`{"location":"Porto"}`) {
		t.Fatal("different arguments compare equal")
	}
}

func TestEstimateTokens(t *testing.T) {
	cases := map[string]int64{"": 0, "abcd": 1, "abcde": 2, "東京": 2, strings.Repeat("word ", 100): 125}
	for s, want := range cases {
		if got := EstimateTokens(s); got != want {
			t.Errorf("EstimateTokens(%.20q) = %d, want %d", s, got, want)
		}
	}
}

// TestOfflinePlannerUsesToolsThenComposes: the offline model asks for the
// guide and the weather first, then writes a valid plan from what they said,
// reporting token usage like the openai provider.
func TestOfflinePlannerUsesToolsThenComposes(t *testing.T) {
	ctx := context.Background()
	m := NewOffline()
	req := Request{Destination: "Lisbon", Days: 3, Interests: []string{"history"}}
	msgs := initialMessages(req)
	ix := guide.Default()
	ts := []tools.Tool{tools.NewGuideSearch(ix)}
	defs := []llms.Tool{ts[0].Definition(), {Type: "function", Function: &llms.FunctionDefinition{Name: "weather"}}}

	resp, err := m.GenerateContent(ctx, msgs, llms.WithTools(defs))
	if err != nil {
		t.Fatal(err)
	}
	c := resp.Choices[0]
	if len(c.ToolCalls) != 3 || c.ToolCalls[0].FunctionCall.Name != "guide_search" || c.ToolCalls[2].FunctionCall.Name != "weather" {
		t.Fatalf("first turn: %+v", c.ToolCalls)
	}
	if c.GenerationInfo["PromptTokens"].(int) <= 0 || c.GenerationInfo["CompletionTokens"].(int) <= 0 {
		t.Fatalf("usage: %v", c.GenerationInfo)
	}
	assistant := llms.MessageContent{Role: llms.ChatMessageTypeAI}
	for _, tc := range c.ToolCalls {
		assistant.Parts = append(assistant.Parts, tc)
	}
	msgs = append(msgs, assistant)
	for _, tc := range c.ToolCalls {
		text := "Live forecast unavailable; seasonal norms for Lisbon in May: high 22 °C, low 14 °C, usually sunny."
		if tc.FunctionCall.Name == "guide_search" {
			text = ts[0].Call(ctx, tc.FunctionCall.Arguments).Text
		}
		msgs = append(msgs, llms.MessageContent{Role: llms.ChatMessageTypeTool,
			Parts: []llms.ContentPart{llms.ToolCallResponse{ToolCallID: tc.ID, Name: tc.FunctionCall.Name, Content: text}}})
	}
	var streamed strings.Builder
	resp, err = m.GenerateContent(ctx, msgs, llms.WithTools(defs), llms.WithStreamingFunc(func(_ context.Context, b []byte) error {
		streamed.Write(b)
		return nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	text := resp.Choices[0].Content
	if streamed.String() != text {
		t.Fatal("streamed text differs from the answer")
	}
	summary, days, err := parseAnswer(text, 3)
	if err != nil {
		t.Fatalf("plan invalid: %v\n%s", err, text)
	}
	if !strings.Contains(summary, "not an LLM") || !strings.Contains(text, "Lisbon") || !strings.Contains(text, "seasonal norms") {
		t.Fatalf("plan does not come from the observations or hides what it is:\n%s", text)
	}
	for _, d := range days {
		for _, it := range d.Items {
			if strings.Contains(it, "Tokyo") || strings.Contains(it, "Kyoto") {
				t.Fatalf("another city's entry in a Lisbon plan: %s", it)
			}
		}
	}
	// Deterministic: the same conversation gives the same plan.
	again, _ := m.GenerateContent(ctx, msgs)
	if again.Choices[0].Content != text {
		t.Fatal("offline planner is not deterministic")
	}
}

func TestOfflinePlannerUnknownCity(t *testing.T) {
	m := NewOffline()
	resp, err := m.GenerateContent(context.Background(), initialMessages(Request{Destination: "Ulaanbaatar", Days: 2}))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := parseAnswer(resp.Choices[0].Content, 2); err != nil {
		t.Fatalf("%v\n%s", err, resp.Choices[0].Content)
	}
}

// TestStoreFollow on both backends: replay, resume after an id, done ends it.
func TestStoreFollow(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			st := NewStore(be.Client)
			st.Poll = 5 * time.Millisecond
			rec := Record{Task: Task{ID: NewID(), Status: StatusQueued}}
			if err := st.Create(ctx, rec); err != nil {
				t.Fatal(err)
			}
			go func() {
				time.Sleep(30 * time.Millisecond)
				rec.Status = StatusSucceeded
				done, _ := json.Marshal(rec.Task)
				_ = st.Save(ctx, rec, Event{Type: EventStep, Data: []byte(`{"seq":1}`)}, Event{Type: EventDone, Data: done})
			}()
			var got []Event
			if err := st.Follow(ctx, rec.ID, "", func(e Event) error { got = append(got, e); return nil }); err != nil {
				t.Fatal(err)
			}
			if len(got) < 3 || got[len(got)-1].Type != EventDone {
				t.Fatalf("events: %+v", got)
			}
			var resumed []Event
			if err := st.Follow(ctx, rec.ID, got[0].ID, func(e Event) error { resumed = append(resumed, e); return nil }); err != nil {
				t.Fatal(err)
			}
			if len(resumed) != len(got)-1 || resumed[0].ID == got[0].ID {
				t.Fatalf("resume after %s: %+v", got[0].ID, resumed)
			}
			// While nothing happens, followers get keep-alives.
			idle := Record{Task: Task{ID: NewID(), Status: StatusRunning}}
			if err := st.Create(ctx, idle); err != nil {
				t.Fatal(err)
			}
			st.KeepAlive = 20 * time.Millisecond
			fctx, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
			keepalives := 0
			_ = st.Follow(fctx, idle.ID, "", func(e Event) error {
				if e.Type == EventKeepAlive {
					keepalives++
				}
				return nil
			})
			cancel()
			if keepalives < 2 {
				t.Fatalf("%d keep-alives in 150ms at a 20ms interval", keepalives)
			}
			if err := st.Follow(ctx, NewID(), "", func(Event) error { return nil }); err != ErrNotFound {
				t.Fatalf("unknown task: %v", err)
			}
			if _, err := st.Get(ctx, "t_nothex!"); err != ErrNotFound {
				t.Fatalf("malformed id: %v", err)
			}
		})
	}
}
