package budget

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"faregate/protect/redistest"
)

// TestScriptsReadEachScopeOnce counts the commands the reserve and the
// settle scripts make on a real redis-server (INFO commandstats): inside
// a script a redis.call costs about as much again as the command, and
// these two run on every model call. A reserve reads each of its five
// scopes once (it knows what it added); a settle reads none it wrote
// (HINCRBY answers the new value), only the spend scope an unpriced model
// leaves untouched; each key's expiry is set once per script.
func TestScriptsReadEachScopeOnce(t *testing.T) {
	redistest.Require(t)
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	b := New(rdb, Options{Limits: Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}})
	req := Request{Day: time.Now().UTC().Format("2006-01-02"), Principal: "v_x", Task: "t_1", Model: "unpriced",
		PrincipalLimit: 1 << 40, PromptTokens: 30, MaxTokens: 200, Tier: "public", TierLimit: 1 << 40}
	call := Call{PromptTokens: 20, CompletionTokens: 10, Counted: 30}
	// The first round loads the scripts.
	res, err := b.Reserve(ctx, req)
	if err == nil {
		_, err = b.SettleCall(ctx, res, call)
	}
	if err != nil {
		t.Fatal(err)
	}
	counts := func() map[string]int {
		t.Helper()
		info, err := rdb.Info(ctx, "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]int{}
		for line := range strings.Lines(info) {
			name, stats, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(line), "cmdstat_"), ":")
			if !ok {
				continue
			}
			n, _, _ := strings.Cut(strings.TrimPrefix(stats, "calls="), ",")
			out[name], _ = strconv.Atoi(n)
		}
		if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	counts()
	req.ID = ""
	if res, err = b.Reserve(ctx, req); err != nil {
		t.Fatal(err)
	}
	reserve := counts()
	e := Entry{Task: req.Task, Model: req.Model, Principal: req.Principal, Outcome: "ok"}
	call.Ledger = &e
	if _, err := b.SettleCall(ctx, res, call); err != nil {
		t.Fatal(err)
	}
	settle := counts()
	t.Logf("reserve: %v", reserve)
	t.Logf("settle: %v", settle)
	// reserve: site, spend, tier, principal, task; the four token scopes
	// it adds to and its three reservation keys expire.
	if reserve["hmget"] != 5 || reserve["expire"] != 7 {
		t.Errorf("reserve: %d scope reads, %d expiries; want 5 and 7", reserve["hmget"], reserve["expire"])
	}
	// settle: the spend scope only; done and the ledger stream expire
	// (the four token scopes keep the expiry their reserve set).
	if settle["hmget"] != 1 || settle["expire"] != 2 {
		t.Errorf("settle: %d scope reads, %d expiries; want 1 and 2", settle["hmget"], settle["expire"])
	}
}
