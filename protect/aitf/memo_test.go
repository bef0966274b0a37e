package aitf

import (
	"strings"
	"testing"
)

// TestKeyMemo: the key memo changes nothing. Bodies scanned with and
// without it give the same result, keys repeated in other spellings and
// keys colliding in a memo slot included.
func TestKeyMemo(t *testing.T) {
	bodies := []string{
		string(agentBody(1 << 10)), string(agentBody(16 << 10)), pageBody(3),
		`{"Mode":"batch","mode":"dark","MODE":"x","tool_call_id":"call_1","tool_call_iD":"call_2","toolCallId":"c"}`,
		// Same length, first and last byte: one memo slot, different keys.
		`{"ab":1,"ab":2,"aab":3,"a_b":4,"aXb":5,"id":"call_z","iad":6,"ixd":"toolu_1","id":"x"}`,
		strings.Repeat(`{"role":"tool","Role":"x","top_p":0.5,"topP":2,"t\u006fp_p":1,"content":"c"},`, 80),
	}
	for _, b := range bodies {
		if on, off := scanMemo([]byte(b), true), scanMemo([]byte(b), false); on != off {
			t.Errorf("%.60q…: memo %+v, without %+v", b, on, off)
		}
	}
}

// FuzzKeyMemo: any body scans the same with and without the key memo.
func FuzzKeyMemo(f *testing.F) {
	f.Add(agentBody(600))
	f.Add([]byte(`{"ab":1,"a_b":2,"aXb":3,"ab":"4"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		if on, off := scanMemo(body, true), scanMemo(body, false); on != off {
			t.Fatalf("memo %+v, without %+v", on, off)
		}
	})
}
