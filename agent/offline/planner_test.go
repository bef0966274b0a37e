package offline

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"faregate/agent/chat"
	"faregate/agent/guide"
	"faregate/agent/task"
	"faregate/agent/tools"
)

// plan is the itinerary JSON the planner writes.
type plan struct {
	Summary string     `json:"summary"`
	Days    []task.Day `json:"days"`
}

// offered are the tool definitions a run offers.
var offered = []chat.ToolDef{tools.NewGuideSearch(nil).Definition(), {Name: tools.NameWeather}}

// lisbonNorm is the weather tool's answer when the forecast is down.
var lisbonNorm = tools.Forecast{Place: "Lisbon, Portugal",
	Norm: &tools.SeasonalNorm{City: "Lisbon", Month: 5, Norm: guide.Norm{HighC: 22, LowC: 14, Condition: "sunny"}}}

// converse runs the planner's first turn, answers its tool calls with the
// real guide and with forecast, and returns the second turn's plan and the
// text streamed while writing it.
func converse(t *testing.T, req task.Request, forecast tools.Forecast) (plan, string) {
	t.Helper()
	ctx := context.Background()
	p := New()
	msgs := []chat.Message{chat.Text(chat.RoleSystem, "system"), chat.Text(chat.RoleUser, "user")}
	first, err := p.Generate(ctx, chat.Turn{Messages: msgs, Tools: offered, Request: &req})
	if err != nil {
		t.Fatal(err)
	}
	names := []string{}
	for _, tc := range first.ToolCalls {
		names = append(names, tc.Name)
	}
	if strings.Join(names, ",") != "guide_search,guide_search,weather" || first.Content != "" || first.StopReason != "tool_calls" {
		t.Fatalf("first turn: %+v", first)
	}
	msgs = append(msgs, chat.Message{Role: chat.RoleAssistant, ToolCalls: first.ToolCalls})
	gs := tools.NewGuideSearch(nil)
	for _, tc := range first.ToolCalls {
		m := chat.Message{Role: chat.RoleTool, ToolCallID: tc.ID, Name: tc.Name,
			// The text a model would read is deliberately useless here: the
			// planner must work from the data alone.
			Content: "(text for language models)"}
		if tc.Name == tools.NameGuideSearch {
			m.Data = gs.Call(ctx, tc.Arguments).Data
		} else {
			m.Data = forecast
		}
		msgs = append(msgs, m)
	}
	var streamed strings.Builder
	second, err := p.Generate(ctx, chat.Turn{Messages: msgs, Tools: offered, Request: &req,
		Stream: func(c chat.Chunk) error { streamed.WriteString(c.Text); return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if len(second.ToolCalls) != 0 || second.Usage.Reported {
		t.Fatalf("second turn: %+v", second)
	}
	if streamed.String() != second.Content {
		t.Fatal("streamed text differs from the answer")
	}
	var out plan
	if err := json.Unmarshal([]byte(second.Content), &out); err != nil {
		t.Fatalf("%v\n%s", err, second.Content)
	}
	if len(out.Days) != req.Days {
		t.Fatalf("%d days for %d requested", len(out.Days), req.Days)
	}
	// Deterministic: the same conversation gives the same plan.
	again, _ := p.Generate(ctx, chat.Turn{Messages: msgs, Tools: offered, Request: &req})
	if again.Content != second.Content {
		t.Fatal("offline planner is not deterministic")
	}
	return out, second.Content
}

// TestEnglishPlanFromTypedResults: the plan names Lisbon's places, says it
// is not an LLM, quotes the seasonal norm once, and takes nothing from
// another city.
func TestEnglishPlanFromTypedResults(t *testing.T) {
	out, raw := converse(t, task.Request{Destination: "Lisbon", Days: 3, Interests: []string{"history"}}, lisbonNorm)
	if !strings.Contains(out.Summary, "(deterministic rules, not an LLM)") || !strings.Contains(out.Summary, "weather tool's answer") {
		t.Fatalf("summary %q", out.Summary)
	}
	if !strings.Contains(raw, "Castelo de São Jorge") && !strings.Contains(raw, "Jerónimos Monastery") {
		t.Fatalf("no Lisbon sight in the plan:\n%s", raw)
	}
	if !strings.Contains(raw, "for your interest in history") {
		t.Errorf("no sight chosen for the interest:\n%s", raw)
	}
	want := "Weather: Live forecast unavailable; seasonal norms for Lisbon in May: high 22 °C, low 14 °C, usually sunny."
	if got := out.Days[0].Items[len(out.Days[0].Items)-1]; got != want {
		t.Errorf("day 1 weather %q, want %q", got, want)
	}
	for _, d := range out.Days {
		if !strings.HasPrefix(d.Items[0], "Morning: ") {
			t.Errorf("day %d starts %q", d.Day, d.Items[0])
		}
		for _, it := range d.Items {
			if strings.Contains(it, "Tokyo") || strings.Contains(it, "Kyoto") {
				t.Fatalf("another city's entry in a Lisbon plan: %s", it)
			}
			if d.Day > 1 && strings.HasPrefix(it, "Weather:") {
				t.Errorf("the norm is repeated on day %d", d.Day)
			}
		}
	}
}

// TestChinesePlan: zh-CN plans are written in Chinese around the guide's
// own place names, with the disclosure, and without the guide's English
// descriptions.
func TestChinesePlan(t *testing.T) {
	rain, code := 40.0, 61
	fc := tools.Forecast{Place: "Lisbon, Portugal", Days: []tools.ForecastDay{
		{Date: "2026-08-15", HighC: 27.4, LowC: 18.2},
		{Date: "2026-08-16", HighC: 25, LowC: 17, RainChance: &rain, Code: &code},
	}}
	out, raw := converse(t, task.Request{Destination: "Lisbon", Days: 2, Interests: []string{"历史"}, Language: task.LangChinese}, fc)
	if !strings.Contains(out.Summary, "离线演示规划器（确定性规则，不是大语言模型）") || !strings.Contains(out.Summary, "Lisbon") {
		t.Fatalf("summary %q", out.Summary)
	}
	for _, english := range []string{"Morning", "Lunch", "Weather", "the oldest quarter", "Tip:"} {
		if strings.Contains(raw, english) {
			t.Errorf("English %q in a Chinese plan:\n%s", english, raw)
		}
	}
	for _, d := range out.Days {
		if !strings.HasPrefix(d.Items[0], "上午：") {
			t.Errorf("day %d starts %q", d.Day, d.Items[0])
		}
	}
	if w := out.Days[0].Items[len(out.Days[0].Items)-1]; w != "天气：8月15日（周六） 最高 27°C，最低 18°C" {
		t.Errorf("day 1 weather %q", w)
	}
	if w := out.Days[1].Items[len(out.Days[1].Items)-1]; w != "天气：8月16日（周日） 最高 25°C，最低 17°C，降水概率 40%，小雨" {
		t.Errorf("day 2 weather %q", w)
	}
	if !strings.Contains(raw, "（契合你对「历史」的兴趣）") {
		t.Errorf("a Chinese interest matched nothing:\n%s", raw)
	}
	// Place names stay as the guide spells them: titles are Lisbon's
	// neighbourhoods, mornings its sights, lunches its dishes.
	lisbon, _ := guide.Default().Lookup("Lisbon")
	nameSet := func(entries []string) map[string]bool {
		set := map[string]bool{}
		for _, e := range entries {
			if n, ok := named(e); ok {
				set[n] = true
			}
		}
		return set
	}
	hoods, sights, food := nameSet(lisbon.Neighbourhoods), nameSet(lisbon.Sights), nameSet(lisbon.Food)
	for _, d := range out.Days {
		if !hoods[d.Title] {
			t.Errorf("day %d title %q is not a Lisbon neighbourhood", d.Day, d.Title)
		}
		if n := strings.TrimPrefix(d.Items[0], "上午：参观 "); !sights[n] {
			t.Errorf("day %d morning %q is not a Lisbon sight", d.Day, d.Items[0])
		}
		if n := strings.TrimPrefix(d.Items[1], "午餐：品尝 "); !food[n] {
			t.Errorf("day %d lunch %q is not a Lisbon dish", d.Day, d.Items[1])
		}
	}
}

// TestUnknownCity: no guide entry, no weather: still a valid plan, which
// says the days are general.
func TestUnknownCity(t *testing.T) {
	for _, lang := range []string{task.LangEnglish, task.LangChinese} {
		req := task.Request{Destination: "Ulaanbaatar", Days: 2, Language: lang}
		reply, err := New().Generate(context.Background(), chat.Turn{Request: &req})
		if err != nil {
			t.Fatal(err)
		}
		var out plan
		if err := json.Unmarshal([]byte(reply.Content), &out); err != nil || len(out.Days) != 2 {
			t.Fatalf("%v\n%s", err, reply.Content)
		}
		if !strings.Contains(out.Summary, "general suggestions") && !strings.Contains(out.Summary, "一般性建议") {
			t.Errorf("%s summary %q", lang, out.Summary)
		}
	}
}

// TestCityIsTheOneAsked: the guide's best match for an unknown place is
// some other city; the plan must not be about it. An alias is the city.
func TestCityIsTheOneAsked(t *testing.T) {
	out, raw := converse(t, task.Request{Destination: "Ulaanbaatar", Days: 1}, tools.Forecast{Place: "Ulaanbaatar"})
	if !strings.Contains(out.Summary, "plan for Ulaanbaatar") || !strings.Contains(out.Summary, "general suggestions") ||
		strings.Contains(out.Summary, "weather tool") {
		t.Fatalf("summary %q", out.Summary)
	}
	for _, city := range guide.Default().Cities() {
		if strings.Contains(raw, city) {
			t.Fatalf("an Ulaanbaatar plan names %s:\n%s", city, raw)
		}
	}
	out, _ = converse(t, task.Request{Destination: "Lisboa", Days: 1}, tools.Forecast{})
	if !strings.Contains(out.Summary, "plan for Lisbon") {
		t.Fatalf("alias: %q", out.Summary)
	}
}

func TestRefusals(t *testing.T) {
	if _, err := New().Generate(context.Background(), chat.Turn{}); !errors.Is(err, ErrNoRequest) {
		t.Fatalf("no request: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req := task.Request{Destination: "Rome", Days: 1}
	if _, err := New().Generate(ctx, chat.Turn{Request: &req}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
	// A stream that refuses more stops the answer with its error.
	stop := errors.New("enough")
	n := 0
	_, err := New().Generate(context.Background(), chat.Turn{Request: &req, Stream: func(c chat.Chunk) error {
		if n++; n == 2 {
			return stop
		}
		return nil
	}})
	if !errors.Is(err, stop) || n != 2 {
		t.Fatalf("stream stop: %v after %d chunks", err, n)
	}
}
