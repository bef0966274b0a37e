package ratelimit

import (
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// testGatePerSecond: the second window over the minute's log. Eleven
// requests in one second (across two replicas) admit ten, and the
// refusal says exactly when the oldest leaves the second; with 600 a
// minute, nine a second for a whole minute all pass.
func testGatePerSecond(t *testing.T, r *rig) {
	req := GateRequest{Scope: visA, RequestsPerMinute: 120, RequestsPerSecond: 10}
	for i := range 10 {
		r.at(time.Duration(i) * 50 * time.Millisecond)
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		if d := r.gate(t, l, req); !d.Allowed {
			t.Fatalf("request %d of the second: %+v", i+1, d)
		}
	}
	r.at(500 * time.Millisecond)
	d := r.gate(t, r.b, req)
	if d.Allowed || d.Reason != ReasonRateLimited || d.Window != WindowSecond || d.RetryAfter != 500*time.Millisecond || d.Remaining != 110 {
		t.Fatalf("11th in the second: %+v; want rate_limited (second) for 500ms, the minute untouched", d)
	}
	var re *RefusedError
	if err := d.Err(); !errors.Is(err, ErrRateLimited) || !errors.As(err, &re) || re.Window != WindowSecond {
		t.Fatalf("Err() = %v", err)
	}
	// 1 ms before the oldest leaves the second it is still refused; then one fits.
	r.at(time.Second - time.Millisecond)
	if d := r.gate(t, r.a, req); d.Allowed || d.RetryAfter != time.Millisecond {
		t.Fatalf("1ms before: %+v", d)
	}
	r.at(time.Second)
	if d := r.gate(t, r.a, req); !d.Allowed {
		t.Fatalf("the oldest left the second: %+v", d)
	}
	// Off at 0: a second's burst of 20 passes.
	off := GateRequest{Scope: visB, RequestsPerMinute: 120}
	for i := range 20 {
		if d := r.gate(t, r.a, off); !d.Allowed {
			t.Fatalf("without a second window, request %d: %+v", i+1, d)
		}
	}

	// 600 a minute and 10 a second: 9 a second for a minute pass, and the
	// minute's own bound still holds after it.
	steady := GateRequest{Scope: keyAcme, RequestsPerMinute: 600, RequestsPerSecond: 10}
	base := 10 * time.Second
	for sec := range 60 {
		for i := range 9 {
			r.at(base + time.Duration(sec)*time.Second + time.Duration(i)*100*time.Millisecond)
			l := r.a
			if i%2 == 1 {
				l = r.b
			}
			if d := r.gate(t, l, steady); !d.Allowed {
				t.Fatalf("second %d, request %d: %+v", sec, i+1, d)
			}
		}
	}
	tight := GateRequest{Scope: keyAcme, RequestsPerMinute: 540, RequestsPerSecond: 10}
	r.at(base + 59*time.Second + 950*time.Millisecond)
	if d := r.gate(t, r.a, tight); d.Allowed || d.Window != WindowMinute {
		t.Fatalf("the minute full at 540: %+v; want the minute's refusal", d)
	}
}

// testInvalidRatio: the share of invalid requests over ten minutes, per
// principal, on two replicas. Its refusals are not counted, and lift when
// enough slots have left for the share to fall to the ratio.
func testInvalidRatio(t *testing.T, r *rig) {
	rule := InvalidRule{Ratio: RatioScale / 2, MinRequests: 20}
	req := GateRequest{Scope: visA, RequestsPerMinute: 1000, CheckAnomaly: true, Invalid: rule}
	note := func(l *Limiter, scope string, requests, invalid int64) {
		t.Helper()
		if _, _, err := l.Record(r.ctx, Note{Scope: scope, Requests: requests, Invalid: invalid, Op: r.op()}); err != nil {
			t.Fatal(err)
		}
	}
	// Ten requests at 0, all invalid; ten at one minute, one invalid.
	for i := range 20 {
		at := time.Duration(0)
		if i >= 10 {
			at = time.Minute
		}
		r.at(at)
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		if d := r.gate(t, l, req); !d.Allowed {
			t.Fatalf("request %d: %+v", i+1, d)
		}
		if i < 11 {
			note(l, visA, 0, 1)
		}
	}
	// 11 of 20: over half. The 21st is refused until the first slot (0 to
	// 30 s) has been out of the window for ten minutes: then 10 requests
	// are left, fewer than the minimum.
	for _, l := range []*Limiter{r.a, r.b} {
		d := r.gate(t, l, req)
		if d.Allowed || d.Reason != ReasonInvalidRatio || d.RetryAfter != 9*time.Minute+30*time.Second {
			t.Fatalf("11 invalid of 20: %+v; want invalid_ratio for 9m30s", d)
		}
		if !errors.Is(d.Err(), ErrInvalidRatio) {
			t.Fatalf("Err() = %v", d.Err())
		}
	}
	if got := r.counts(t, visA); got != [2]int64{20, 11} {
		t.Fatalf("after the refusals the window holds %v; want 20 requests, 11 invalid (refusals not counted)", got)
	}
	// Another principal is not affected; without the rule nothing is checked.
	if d := r.gate(t, r.a, GateRequest{Scope: visB, RequestsPerMinute: 1000, Invalid: rule}); !d.Allowed {
		t.Fatalf("another visitor: %+v", d)
	}
	if d := r.gate(t, r.a, GateRequest{Scope: visA, RequestsPerMinute: 1000}); !d.Allowed {
		t.Fatalf("without the rule: %+v", d)
	}
	r.at(10*time.Minute + 30*time.Second - time.Millisecond)
	if d := r.gate(t, r.b, req); d.Allowed || d.RetryAfter != time.Millisecond {
		t.Fatalf("1ms before: %+v", d)
	}
	r.at(10*time.Minute + 30*time.Second)
	if d := r.gate(t, r.b, req); !d.Allowed {
		t.Fatalf("after the window: %+v", d)
	}
}

// testInvalidRatioBelow: a principal whose share stays at or below the
// ratio is never refused, and an external agent's model calls count in
// the window as requests (and invalid ones when refused).
func testInvalidRatioBelow(t *testing.T, r *rig) {
	rule := InvalidRule{Ratio: RatioScale / 2, MinRequests: 20}
	note := func(l *Limiter, scope string, requests, invalid int64) {
		t.Helper()
		if _, _, err := l.Record(r.ctx, Note{Scope: scope, Requests: requests, Invalid: invalid, Op: r.op()}); err != nil {
			t.Fatal(err)
		}
	}
	// 30 valid and 10 invalid: never refused.
	good := GateRequest{Scope: visB, RequestsPerMinute: 1000, Invalid: rule}
	for i := range 40 {
		if d := r.gate(t, r.a, good); !d.Allowed {
			t.Fatalf("30 valid, 10 invalid: request %d refused: %+v", i+1, d)
		}
		if i%4 == 0 {
			note(r.b, visB, 0, 1)
		}
	}

	// An external agent's calls count too: 10 requests and 10 refused
	// calls are exactly half, which is not over it; one more refused call is.
	for range 10 {
		if d := r.gate(t, r.a, GateRequest{Scope: keyAcme, RequestsPerMinute: 1000, Invalid: rule}); !d.Allowed {
			t.Fatalf("key's request: %+v", d)
		}
		note(r.b, keyAcme, 1, 1)
	}
	k := GateRequest{Scope: keyAcme, RequestsPerMinute: 1000, Invalid: rule}
	if d := r.gate(t, r.a, k); !d.Allowed {
		t.Fatalf("exactly half: %+v", d)
	}
	note(r.a, keyAcme, 1, 1)
	note(r.a, keyAcme, 1, 1)
	if d := r.gate(t, r.b, k); d.Reason != ReasonInvalidRatio {
		t.Fatalf("12 of 23 invalid: %+v; want invalid_ratio", d)
	}
}

// counts reads a principal's invalid window: requests and invalid.
func (r *rig) counts(t *testing.T, scope string) [2]int64 {
	t.Helper()
	h, err := r.rdb.HGetAll(r.ctx, key(scope, "inv")).Result()
	if err != nil {
		t.Fatal(err)
	}
	var out [2]int64
	for f, v := range h {
		n, _ := strconv.ParseInt(v, 10, 64)
		switch f[0] {
		case 't':
			out[0] += n
		case 'i':
			out[1] += n
		}
	}
	return out
}

// testHourQuota: a sliding hour of tokens charged per principal: a call
// holds its whole amount until settled, the settle keeps what it was
// charged, the soft share is reported, a short hour says exactly when it
// will have room, and it slides across midnight.
func testHourQuota(t *testing.T, r *rig) {
	const hourly, soft = 10_000, 8_000
	call := func(l *Limiter, amount int64) CallDecision {
		t.Helper()
		return r.call(t, l, CallRequest{Scope: keyAcme, PromptTokens: 10, Amount: amount, TokensPerHour: hourly, SoftTokens: soft})
	}
	settle := func(l *Limiter, d CallDecision, reserved, actual int64) {
		t.Helper()
		if _, err := l.Settle(r.ctx, SettleRequest{Scope: keyAcme, TokensPerHour: hourly, HourSlot: d.HourSlot,
			Reserved: reserved, Actual: actual, Op: r.op()}); err != nil {
			t.Fatal(err)
		}
	}
	// start is 30 s into its minute: what is taken now counts until 1h30s.
	d1 := call(r.a, 3000)
	if !d1.Taken || d1.HourUsed != 0 || d1.Soft || d1.HourSlot == 0 {
		t.Fatalf("first call: %+v", d1)
	}
	settle(r.b, d1, 3000, 1000)
	r.at(10 * time.Minute)
	d2 := call(r.b, 7000)
	if !d2.Taken || d2.HourUsed != 1000 || d2.Soft {
		t.Fatalf("second call: %+v; want taken with 1000 used", d2)
	}
	settle(r.a, d2, 7000, 7000)
	r.at(20 * time.Minute)
	d3 := call(r.a, 1000) // in flight from here on
	if !d3.Taken || d3.HourUsed != 8000 || !d3.Soft {
		t.Fatalf("at the soft share: %+v; want taken, soft, 8000 used", d3)
	}
	// 9000 held: 1500 more must wait until the first minute's 1000 leaves.
	d4 := call(r.b, 1500)
	if d4.Taken || !d4.HourShort || d4.RetryAfter != 40*time.Minute+30*time.Second || !d4.Soft {
		t.Fatalf("short hour: %+v; want short for 40m30s", d4)
	}
	var re *RefusedError
	if err := d4.Err(); !errors.Is(err, ErrHourExhausted) || !errors.As(err, &re) || re.Reason != ReasonHourExhausted {
		t.Fatalf("Err() = %v", err)
	}
	if ok, wait, used, err := r.a.HourRoom(r.ctx, keyAcme, hourly, 1500); ok || wait != 40*time.Minute+30*time.Second || used != 9000 || err != nil {
		t.Fatalf("HourRoom(1500) = %v, %v, %d, %v", ok, wait, used, err)
	}
	if ok, _, _, err := r.a.HourRoom(r.ctx, keyAcme, hourly, 1000); !ok || err != nil {
		t.Fatalf("HourRoom(1000) = %v, %v", ok, err)
	}
	if _, _, _, err := r.a.HourRoom(r.ctx, keyAcme, hourly, hourly+1); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("HourRoom past the quota: %v", err)
	}
	if d := call(r.a, hourly+1); !d.HourShort || d.RetryAfter != HourWindow {
		t.Fatalf("an amount over the quota: %+v", d)
	}
	// The in-flight call settles with an overage of 200: 9200 held.
	settle(r.b, d3, 1000, 1200)
	if _, _, used, _ := r.a.HourRoom(r.ctx, keyAcme, hourly, 0); used != 9200 {
		t.Fatalf("after the overage: %d used; want 9200", used)
	}
	// Across midnight the first minute leaves (at 1h00m30s of the clock).
	r.at(time.Hour + 30*time.Second - time.Millisecond)
	if d := call(r.a, 1500); d.Taken {
		t.Fatalf("1ms before the first minute leaves: %+v", d)
	}
	r.at(time.Hour + 30*time.Second)
	d5 := call(r.b, 1500)
	if !d5.Taken || d5.HourUsed != 8200 {
		t.Fatalf("the first minute left: %+v; want taken with 8200 used", d5)
	}
	// A settle whose slot has left gives nothing back there.
	settle(r.a, d1, 3000, 0)
	if _, _, used, _ := r.a.HourRoom(r.ctx, keyAcme, hourly, 0); used != 9700 {
		t.Fatalf("a late give-back changed the hour: %d; want 9700", used)
	}
	// Two hours on, it is empty.
	r.at(3 * time.Hour)
	if _, _, used, _ := r.b.HourRoom(r.ctx, keyAcme, hourly, 0); used != 0 {
		t.Fatalf("two hours on: %d used", used)
	}
}

// testHourConcurrent: calls in flight at once on two replicas never take
// the hour past its quota.
func testHourConcurrent(t *testing.T, r *rig) {
	const hourly, amount, calls = 10_000, 300, 60
	var taken atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, calls)
	for i := range calls {
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		wg.Go(func() {
			d, err := l.BeforeCall(r.ctx, CallRequest{Scope: visB, PromptTokens: 10, Amount: amount,
				TokensPerHour: hourly, SoftTokens: 8000, Op: "c-" + strconv.Itoa(i)})
			if err != nil {
				errs <- err
				return
			}
			if d.Taken {
				taken.Add(1)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if taken.Load() != hourly/amount {
		t.Fatalf("%d calls of %d taken; want %d", taken.Load(), amount, hourly/amount)
	}
}

// testGateSoft: past its soft share a principal's window is held to the
// soft requests per minute, refused with WindowSoft, and the decision
// reports the hour.
func testGateSoft(t *testing.T, r *rig) {
	hour := HourRule{Tokens: 10_000, SoftTokens: 8000, SoftRequestsPerMinute: 5}
	req := GateRequest{Scope: visA, RequestsPerMinute: 120, Hour: hour}
	if d := r.gate(t, r.a, req); !d.Allowed || d.Soft || d.HourUsed != 0 || d.Remaining != 119 {
		t.Fatalf("before any use: %+v", d)
	}
	d := r.call(t, r.a, CallRequest{Scope: visA, PromptTokens: 10, Amount: 8000, TokensPerHour: hour.Tokens, SoftTokens: hour.SoftTokens})
	if !d.Taken {
		t.Fatalf("8000 tokens: %+v", d)
	}
	// One request is in the minute: four more pass, the sixth is refused.
	for i := range 4 {
		r.at(time.Duration(i+1) * time.Second)
		d := r.gate(t, r.b, req)
		if !d.Allowed || !d.Soft || d.HourUsed != 8000 || d.Limit != 5 || d.Remaining != int64(3-i) {
			t.Fatalf("soft request %d: %+v", i+2, d)
		}
	}
	r.at(5 * time.Second)
	if d := r.gate(t, r.a, req); d.Allowed || d.Reason != ReasonRateLimited || d.Window != WindowSoft || d.RetryAfter != 55*time.Second {
		t.Fatalf("6th in the minute: %+v; want rate_limited (soft) for 55s", d)
	}
	// A soft limit above the full one changes nothing.
	loose := req
	loose.Hour.SoftRequestsPerMinute = 500
	loose.RequestsPerMinute = 5
	if d := r.gate(t, r.a, loose); d.Allowed || d.Window != WindowMinute {
		t.Fatalf("soft above the full limit: %+v; want the minute's refusal", d)
	}
}

// testSlotsBounded: the slotted counters keep only the slots that still
// count, and expire with them, however long a principal stays busy.
func testSlotsBounded(t *testing.T, r *rig) {
	for i := range 240 { // one outcome every 30 s for two hours
		r.at(time.Duration(i) * invalidSlot)
		if _, _, err := r.a.Record(r.ctx, Note{Scope: visA, Requests: 1, Invalid: 1, Op: r.op()}); err != nil {
			t.Fatal(err)
		}
		d := r.call(t, r.b, CallRequest{Scope: visA, PromptTokens: 1, Amount: 1, TokensPerHour: 1_000_000, SoftTokens: 1})
		if !d.Taken {
			t.Fatalf("call %d: %+v", i, d)
		}
	}
	// Live invalid slots: the current one and the 20 before it (10 min of
	// 30 s slots, plus the slot being filled); two kinds each; and the
	// four fields of totals and the oldest slot.
	const totals = 4
	if n := r.rdb.HLen(r.ctx, key(visA, "inv")).Val(); n > 2*(int64(InvalidWindow/invalidSlot)+1)+totals {
		t.Errorf("invalid window holds %d fields", n)
	}
	if n := r.rdb.HLen(r.ctx, key(visA, "hour")).Val(); n > int64(HourWindow/hourSlot)+1+totals {
		t.Errorf("hour holds %d fields", n)
	}
	for k, most := range map[string]time.Duration{
		key(visA, "inv"):  invalidSlot + InvalidWindow + expiryGrace,
		key(visA, "hour"): hourSlot + HourWindow + expiryGrace,
	} {
		if ttl := r.rdb.PTTL(r.ctx, k).Val(); ttl <= 0 || ttl > most {
			t.Errorf("PTTL %s = %v; want in (0, %v]", k, ttl, most)
		}
	}
}
