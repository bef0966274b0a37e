package tools

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"faregate/agent/outbound"
	"faregate/protect/codes"
)

const forecastJSON = `{"latitude":38.72,"longitude":-9.14,"timezone":"Europe/Lisbon",
"daily":{"time":["2026-08-15","2026-08-16"],
"temperature_2m_max":[27.4,29.1],"temperature_2m_min":[18.2,null],
"precipitation_probability_max":[10,null],"weather_code":[0,61]}}`

func TestWeatherFromCorpusCoordinates(t *testing.T) {
	var gotQuery map[string][]string
	var gotHeader http.Header
	fc, fcHits := serve(t, func(w http.ResponseWriter, r *http.Request) {
		gotQuery, gotHeader = r.URL.Query(), r.Header.Clone()
		io.WriteString(w, forecastJSON)
	})
	geo, geoHits := serve(t, func(w http.ResponseWriter, r *http.Request) {})
	sess, rec := session(t, nil)
	tool := NewWeather(sess.Client(), Config{WeatherURL: fc.URL, GeocodingURL: geo.URL, Now: august})

	// The model asks three times with the same arguments: one request.
	for i := range 3 {
		ctx := outbound.WithCall(context.Background(), "call_w", i+1)
		obs := tool.Call(ctx, args("location", "Lisbon, Portugal"))
		if obs.Failed || obs.Warning != "" {
			t.Fatalf("call %d: %+v", i, obs)
		}
		for _, want := range []string{"Lisbon, Portugal", "Sat 15 Aug: high 27 °C, low 18 °C, rain chance 10%, clear sky"} {
			if !strings.Contains(obs.Text, want) {
				t.Errorf("observation lacks %q:\n%s", want, obs.Text)
			}
		}
		// A day without a low temperature is dropped, not printed as 0.
		if strings.Contains(obs.Text, "16 Aug") {
			t.Errorf("incomplete day rendered:\n%s", obs.Text)
		}
		// The same answer as data, for planners that do not read prose.
		fc, ok := obs.Data.(Forecast)
		if !ok || fc.Place != "Lisbon, Portugal" || fc.Norm != nil || len(fc.Days) != 1 {
			t.Fatalf("data %+v", obs.Data)
		}
		if d := fc.Days[0]; d.Date != "2026-08-15" || d.HighC != 27.4 || d.LowC != 18.2 ||
			d.RainChance == nil || *d.RainChance != 10 || d.Code == nil || *d.Code != 0 || !strings.Contains(obs.Text, d.String()) {
			t.Errorf("day %+v (%s)", d, d)
		}
	}
	if fcHits.hits.Load() != 1 || geoHits.hits.Load() != 0 {
		t.Fatalf("forecast hits %d (want 1), geocoding hits %d (want 0)", fcHits.hits.Load(), geoHits.hits.Load())
	}
	want := map[string]string{
		"latitude": "38.7223", "longitude": "-9.1393", "timezone": "auto", "forecast_days": "7",
		"daily": "temperature_2m_max,temperature_2m_min,precipitation_probability_max,weather_code",
	}
	for k, v := range want {
		if got := gotQuery[k]; !slices.Equal(got, []string{v}) {
			t.Errorf("query %s = %v, want %s", k, got, v)
		}
	}
	if ua := gotHeader.Get("User-Agent"); !strings.HasPrefix(ua, "faregate-agent/test (+") {
		t.Errorf("User-Agent %q", ua)
	}
	if gotHeader.Get(outbound.HeaderToolCallID) != "call_w" || gotHeader.Get(outbound.HeaderDepth) != "1" {
		t.Errorf("call headers %v", gotHeader)
	}
	if len(rec.warns) != 0 {
		t.Errorf("warnings %v", rec.warns)
	}
}

func TestWeatherGeocodingFallback(t *testing.T) {
	var fcQuery, geoQuery url.Values
	fc, _ := serve(t, func(w http.ResponseWriter, r *http.Request) {
		fcQuery = r.URL.Query()
		io.WriteString(w, forecastJSON)
	})
	geo, _ := serve(t, func(w http.ResponseWriter, r *http.Request) {
		geoQuery = r.URL.Query()
		io.WriteString(w, `{"results":[{"name":"Porto","latitude":41.14961,"longitude":-8.61099,"country":"Portugal","admin1":"Porto"}]}`)
	})
	sess, _ := session(t, nil)
	tool := NewWeather(sess.Client(), Config{WeatherURL: fc.URL, GeocodingURL: geo.URL, Now: august})
	obs := tool.Call(context.Background(), args("location", "Porto, Portugal"))
	if obs.Failed || !strings.Contains(obs.Text, "Forecast for Porto, Portugal (41.15, -8.61)") {
		t.Fatalf("%+v", obs)
	}
	if geoQuery.Get("name") != "Porto" || geoQuery.Get("count") != "1" {
		t.Errorf("geocoding query %v", geoQuery)
	}
	if fcQuery.Get("latitude") != "41.1496" || fcQuery.Get("longitude") != "-8.6110" {
		t.Errorf("forecast query %v", fcQuery)
	}
}

func TestWeatherUnknownPlace(t *testing.T) {
	geo, _ := serve(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{"generationtime_ms":0.5}`) })
	fc, fcHits := serve(t, func(w http.ResponseWriter, r *http.Request) {})
	sess, _ := session(t, nil)
	obs := NewWeather(sess.Client(), Config{WeatherURL: fc.URL, GeocodingURL: geo.URL}).
		Call(context.Background(), args("location", "Xyzzyville"))
	if !obs.Failed || obs.Warning != "" || !strings.Contains(obs.Text, "No place called") {
		t.Fatalf("%+v", obs)
	}
	if fcHits.hits.Load() != 0 {
		t.Fatal("forecast requested for an unknown place")
	}
}

func TestWeatherDegrades(t *testing.T) {
	const lisbonAugust = "Live forecast unavailable; seasonal norms for Lisbon in August: high 28 °C, low 19 °C, usually sunny."
	down := downURL(t)

	tests := []struct {
		name      string
		handler   http.HandlerFunc // nil = server down
		geo       http.HandlerFunc // nil = geocoding down
		location  string
		deadline  time.Duration
		maxHits   int64
		wantHits  int64 // -1 = don't check
		wantText  string
		wantWaits []time.Duration // nil: no wait for the forecast (geocoding retries may wait)
	}{
		{
			name: "503 with Retry-After 1", location: "Lisbon", deadline: 30 * time.Second,
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusServiceUnavailable)
			},
			maxHits: 3, wantHits: 3, wantText: lisbonAugust, wantWaits: []time.Duration{time.Second, time.Second},
		},
		{
			name: "503 with Retry-After past the task deadline", location: "Lisbon", deadline: 500 * time.Millisecond,
			handler: func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusServiceUnavailable)
			},
			maxHits: 1, wantHits: 1, wantText: lisbonAugust,
		},
		{name: "server down", location: "Lisbon", deadline: 30 * time.Second, wantHits: -1, wantText: lisbonAugust},
		{
			name: "garbage answer", location: "Tokyo", deadline: 30 * time.Second,
			handler: func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "<html>oops</html>") },
			maxHits: 1, wantHits: 1,
			wantText: "Live forecast unavailable; seasonal norms for Tokyo in August: high 31 °C, low 24 °C, usually humid.",
		},
		{
			name: "404 is not retried", location: "Kyoto", deadline: 30 * time.Second,
			handler: func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) },
			maxHits: 1, wantHits: 1, wantText: "seasonal norms for Kyoto in August",
		},
		{
			name: "geocoding down for a place the guide lacks", location: "Berlin", deadline: 30 * time.Second,
			handler: func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, forecastJSON) },
			maxHits: 0, wantHits: 0, wantText: "Live forecast unavailable for Berlin, and the guide has no seasonal norms for it.",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fcURL := down
			var hits *counted
			if tc.handler != nil {
				s, c := serve(t, tc.handler)
				fcURL, hits = s.URL, c
			}
			sess, rec := session(t, nil)
			tool := NewWeather(sess.Client(), Config{WeatherURL: fcURL, GeocodingURL: down, Now: august})
			obs := tool.Call(taskCtx(t, tc.deadline), args("location", tc.location))
			if !obs.Failed || obs.Warning != codes.WeatherUnavailable {
				t.Fatalf("observation %+v, want failed with %s", obs, codes.WeatherUnavailable)
			}
			if !strings.Contains(obs.Text, tc.wantText) {
				t.Errorf("text %q, want %q", obs.Text, tc.wantText)
			}
			// The data carries the norm the text quotes, or none.
			fc, ok := obs.Data.(Forecast)
			if !ok || len(fc.Days) != 0 {
				t.Fatalf("data %+v", obs.Data)
			}
			if quotes := strings.Contains(obs.Text, "; seasonal norms for"); quotes != (fc.Norm != nil) ||
				(fc.Norm != nil && (fc.Norm.Month != 8 || !strings.Contains(obs.Text, fc.Norm.String()))) {
				t.Errorf("norm %+v for text %q", fc.Norm, obs.Text)
			}
			// Degraded (a stand-in given) exactly when the norms were.
			if obs.Degraded != (fc.Norm != nil) {
				t.Errorf("Degraded %v with norm %+v", obs.Degraded, fc.Norm)
			}
			if hits != nil && tc.wantHits >= 0 {
				if h := hits.hits.Load(); h != tc.wantHits || h > tc.maxHits {
					t.Errorf("forecast server saw %d requests, want %d (at most %d)", h, tc.wantHits, tc.maxHits)
				}
			}
			if w := rec.waits(); tc.wantWaits != nil && !slices.Equal(w, tc.wantWaits) {
				t.Errorf("waits %v, want %v", w, tc.wantWaits)
			} else if tc.wantWaits == nil && tc.handler != nil && tc.maxHits > 0 && len(w) != 0 {
				t.Errorf("waited %v, want no wait", w)
			}
		})
	}
}

func TestBadArguments(t *testing.T) {
	sess, _ := session(t, nil)
	all := All(sess.Client(), sess.Client(), Config{SearchURL: "http://search.invalid/"})
	if len(all) != 4 {
		t.Fatalf("All offered %d tools, want 4", len(all))
	}
	bad := []string{"", "{}", "null", "[]", "not json", `{"query": 5, "location": 5, "url": 5}`,
		`{"query": "", "location": "  ", "url": ""}`, `{"query": "` + strings.Repeat("x", 3000) + `"}`}
	for _, tool := range all {
		for _, a := range bad {
			t.Run(tool.Name()+"/"+a[:min(len(a), 20)], func(t *testing.T) {
				obs := tool.Call(context.Background(), a)
				if !obs.Failed || obs.Warning != "" || !strings.Contains(obs.Text, tool.Name()+" needs JSON arguments") {
					t.Fatalf("%+v", obs)
				}
			})
		}
	}
}

func TestStringArgForms(t *testing.T) {
	tests := []struct {
		in, want string
		ok       bool
	}{
		{`{"location":"Rome"}`, "Rome", true},
		{`  {"location":"  Rome  ", "extra": 1}  `, "Rome", true},
		{`"{\"location\":\"Rome\"}"`, "Rome", true}, // arguments double-encoded by the model
		{`{"place":"Rome"}`, "", false},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, ok := stringArg(tc.in, "location", 100)
			if got != tc.want || ok != tc.ok {
				t.Fatalf("stringArg = %q, %v", got, ok)
			}
		})
	}
}

func TestDefinitions(t *testing.T) {
	sess, _ := session(t, nil)
	tests := []struct {
		name      string
		cfg       Config
		fetch     bool
		wantNames []string
	}{
		{"no search, no fetch", Config{}, false, []string{NameGuideSearch, NameWeather}},
		{"everything", Config{SearchURL: "http://s.invalid"}, true, []string{NameGuideSearch, NameWeather, NameWebSearch, NameFetchPage}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var fetch *http.Client
			if tc.fetch {
				fetch = sess.Client()
			}
			defs := Definitions(All(sess.Client(), fetch, tc.cfg))
			var names []string
			for _, d := range defs {
				if d.Name == "" || d.Description == "" {
					t.Fatalf("bad definition %+v", d)
				}
				if req := d.Parameters["required"].([]string); len(req) != 1 {
					t.Fatalf("%s: required %v", d.Name, req)
				}
				names = append(names, d.Name)
			}
			if !slices.Equal(names, tc.wantNames) {
				t.Fatalf("tools %v, want %v", names, tc.wantNames)
			}
		})
	}
}

func TestGuideSearchTool(t *testing.T) {
	tool := NewGuideSearch(nil)
	tests := []struct {
		query, want string
	}{
		{"pastel de nata", "[Lisbon — food]"},
		{"Kyoto temples", "[Kyoto"},
		{"zzzxqv", "The guide has nothing matching"},
	}
	for _, tc := range tests {
		t.Run(tc.query, func(t *testing.T) {
			obs := tool.Call(context.Background(), args("query", tc.query))
			if obs.Failed || obs.Warning != "" || !strings.Contains(obs.Text, tc.want) {
				t.Fatalf("%+v", obs)
			}
			// Every hit the text shows is in the data, entries included.
			res, ok := obs.Data.(GuideResult)
			if !ok || res.Query != tc.query {
				t.Fatalf("data %+v", obs.Data)
			}
			for _, h := range res.Hits {
				if len(h.Entries) == 0 || !strings.Contains(obs.Text, "["+h.City+" — "+h.Section+"]\n"+h.Entries[0]) {
					t.Errorf("hit %s/%s with entries %q not in the text", h.City, h.Section, h.Entries)
				}
			}
		})
	}
}
