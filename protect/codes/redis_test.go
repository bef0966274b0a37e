package codes_test

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// redisSpeakers are the packages of protect/ and agent/ whose own code may
// import go-redis, and why each must. Everyone else reaches Redis through
// one of them: the guards through their own types, the agent's tasks
// through agent/taskstore. A package that stops speaking Redis leaves the
// list (the test says so); one that starts must say here why it cannot
// use one of these.
var redisSpeakers = map[string]string{
	"protect/budget":    "a guard: tokens and money reserved and settled in Lua scripts",
	"protect/quota":     "a guard: the daily task quotas, one Lua script",
	"protect/ratelimit": "a guard: windows and buckets in Lua scripts",

	"protect/kit/redisbatch":        "kit: the commands a wave of goroutines sends at once go as one pipeline",
	"protect/kit/testkit/redistest": "test kit: starts the test Redis servers and clusters",

	"agent/taskstore":  "Redis task storage: records, events, the queue, leases, the inbox",
	"agent/taskkey":    "task keys: minted, checked and written by scripts fenced by the task's lease",
	"agent/tasklimits": "an external task's limits shared by the replicas: one family of Lua scripts",
	"agent/alert":      "alert deduplication shared by the replicas (SET NX on Redis's clock)",
	"agent/plancache":  "cached plans shared by the replicas",
}

// TestRedisStaysInItsPackages: under protect/ and agent/, only the
// packages of redisSpeakers import go-redis outside their tests, and each
// of them still does.
func TestRedisStaysInItsPackages(t *testing.T) {
	speaking := map[string]string{} // package dir → a file that imports go-redis
	for _, s := range sources(t) {
		if !under(s.dir, "protect") && !under(s.dir, "agent") {
			continue
		}
		for _, imp := range s.file.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if path == "github.com/redis/go-redis/v9" || strings.HasPrefix(path, "github.com/redis/go-redis/v9/") {
				speaking[s.dir] = s.path
			}
		}
	}
	for _, dir := range slices.Sorted(maps.Keys(speaking)) {
		if _, ok := redisSpeakers[dir]; !ok {
			t.Errorf("%s imports go-redis: reach Redis through a package that owns it (agent/taskstore for tasks), or name %s in redisSpeakers with the reason it must", speaking[dir], dir)
		}
	}
	for _, dir := range slices.Sorted(maps.Keys(redisSpeakers)) {
		if _, ok := speaking[dir]; !ok {
			t.Errorf("%s no longer imports go-redis: remove it from redisSpeakers", dir)
		}
	}
}
