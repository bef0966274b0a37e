package task

import (
	"encoding/json"
	"reflect"
	"testing"
)

func TestRequestJSON(t *testing.T) {
	for _, tt := range []struct {
		req  Request
		want string
	}{
		{Request{Prompt: "Write a haiku about Lisbon", Language: LangChinese}, `{"prompt":"Write a haiku about Lisbon","language":"zh-CN"}`},
		{Request{Prompt: "x"}, `{"prompt":"x","language":"en"}`},
		{Request{Destination: "Lisbon", Days: 2, Interests: []string{"food"}, Language: LangEnglish}, `{"destination":"Lisbon","days":2,"interests":["food"],"language":"en"}`},
	} {
		got, err := json.Marshal(tt.req)
		if err != nil || string(got) != tt.want {
			t.Errorf("Marshal(%+v) = %s, %v; want %s", tt.req, got, err, tt.want)
			continue
		}
		var back Request
		if err := json.Unmarshal(got, &back); err != nil {
			t.Fatal(err)
		}
		if tt.req.Language == "" {
			tt.req.Language = LangEnglish
		}
		if !reflect.DeepEqual(back, tt.req) {
			t.Errorf("round trip of %s = %+v, want %+v", got, back, tt.req)
		}
	}
	// A record inside a record (Task embeds Request) takes the same shape.
	raw, _ := json.Marshal(Task{Request: Request{Prompt: "hi"}})
	var m map[string]any
	_ = json.Unmarshal(raw, &m)
	if req, _ := m["request"].(map[string]any); req["prompt"] != "hi" || req["destination"] != nil {
		t.Errorf("task JSON %s", raw)
	}
}
