package gateway

import (
	"fmt"
	"strings"
	"testing"
)

// seenCases are bodies whose parse the memo must not change: valid ones,
// and every kind of refusal the parts it skips could hide.
var seenCases = []string{
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hello"}]}`,
	` { "model" : "gpt-4o-mini" , "messages" : [ {"role":"system","content":"be brief"} , {"role":"user","name":"ann","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"https://x/y.png","detail":"low"}}]} ] } `,
	`{"model":"gpt-4o-mini","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":\"\\\"q\\\"\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"it said \"yes\" \\ ok"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]}`,
	`{"model":"gpt-4o-mini","messages":[]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"},]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"} {"role":"user","content":"b"}]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"messages":[]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"Messages":[]}`,
	`{"model":"gpt-4o-mini","MODEL":"gpt-5","messages":[{"role":"user","content":"a"}]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","Content":"a"}]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":tru}]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a\x01"}]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}]} x`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}]`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":[{"type":"file","file":{"file_id":"f_1"}}]}]}`,
	`{"model":"gpt-4o-mini","messages":"hello"}`,
	`{"model":"gpt-4o-mini","messages":[1,2]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"tools":[{"type":"web_search"}]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"tools":[{"Type":"function","function":{"name":"f"}}]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"tools":{"type":"function"}}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"tools":[{"type":"function","function":{"name":"f"}}}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"temperature":1e}`,
	`{"mod\u0065l":"gpt-4o-mini","messages":[{"role":"user","content":"a"}]}`,
	`{"model":"gpt-4o-mini","max_tokenſ":5,"messages":[{"role":"user","content":"a"}]}`,
	`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"a"}],"stream":true,"stream_options":{"include_usage":true}}`,
	`[{"model":"gpt-4o-mini"}]`,
	``,
}

// TestSeenMemoChangesNothing: a call parsed through the memo, the first
// time and again (every part then remembered), is what it is without the
// memo: the same prompt, images and fields, or the same refusal in the
// same words.
func TestSeenMemoChangesNothing(t *testing.T) {
	memo := newSeenMemo()
	for i, body := range seenCases {
		for _, kind := range []string{KindChat, KindResponses} {
			if kind == KindResponses {
				body = strings.Replace(body, `"messages"`, `"input"`, 1)
			}
			want, wantErr := parseCallHolding(kind, []byte(body), anyModel, 700, nil)
			for round := range 2 {
				got, err := parseCallHolding(kind, []byte(body), anyModel, 700, memo)
				if fmt.Sprint(err) != fmt.Sprint(wantErr) {
					t.Fatalf("case %d %s round %d: error %v, want %v\n%s", i, kind, round, err, wantErr, body)
				}
				if err != nil {
					continue
				}
				if got.prompt != want.prompt || got.images != want.images || got.lowImages != want.lowImages ||
					got.stream != want.stream || got.includeUsage != want.includeUsage || got.model != want.model ||
					len(got.obj.fields) != len(want.obj.fields) {
					t.Fatalf("case %d %s round %d: %+v, want %+v\n%s", i, kind, round, got, want, body)
				}
				for j := range got.obj.fields {
					if got.obj.fields[j].key != want.obj.fields[j].key || string(got.obj.fields[j].raw) != string(want.obj.fields[j].raw) {
						t.Fatalf("case %d %s: field %d %q=%s, want %q=%s", i, kind, j, got.obj.fields[j].key, got.obj.fields[j].raw,
							want.obj.fields[j].key, want.obj.fields[j].raw)
					}
				}
			}
		}
	}
}

// FuzzSeenMemo: whatever the body, the memo's parse (cold, then warm)
// agrees with the plain parse (go test -fuzz FuzzSeenMemo ./agent/gateway).
func FuzzSeenMemo(f *testing.F) {
	for _, c := range seenCases {
		f.Add(c)
	}
	f.Add(agentBody(4, "a tool's result"))
	f.Add(`{"model":"gpt-4o","instructions":"be brief","input":[{"role":"user","content":"hi"},{"type":"function_call","name":"f","arguments":"{}"},{"type":"function_call_output","output":"ok"},{"type":"item_reference","id":"m1"},{"type":"reasoning","summary":[]}]}`)
	memo := newSeenMemo()
	f.Fuzz(func(t *testing.T, body string) {
		kind := KindChat
		if strings.Contains(body, `"input"`) {
			kind = KindResponses
		}
		want, wantErr := parseCallHolding(kind, []byte(body), anyModel, 700, nil)
		for range 2 {
			got, err := parseCallHolding(kind, []byte(body), anyModel, 700, memo)
			if fmt.Sprint(err) != fmt.Sprint(wantErr) {
				t.Fatalf("error %v, want %v", err, wantErr)
			}
			if err == nil && (got.prompt != want.prompt || got.images != want.images || len(got.obj.fields) != len(want.obj.fields)) {
				t.Fatalf("prompt %d images %d, want %d %d", got.prompt, got.images, want.prompt, want.images)
			}
		}
	})
}
