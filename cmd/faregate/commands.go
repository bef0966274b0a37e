package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/taskstore"
	"faregate/protect/aitf"
	"faregate/protect/budget"
)

// runUsage implements `faregate usage [-day YYYY-MM-DD] [-by model|principal]
// [-format table|csv]`: one UTC day's model calls from the usage ledger in
// Redis, summed per model or per principal, with tokens, cost and overage
// (once entries have left the ledger, trimmed or lost unexported, the
// totals are the day's counters', budget.Ledger.Usage, and the table says
// so); and, with -site, -principal P or -task T, one scope's settled,
// outstanding, leased and overage tokens and money from its counters
// (-format table, csv or json), whatever the key layout.
func runUsage(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	fs := flag.NewFlagSet("usage", flag.ContinueOnError)
	fs.SetOutput(stdout)
	day := fs.String("day", time.Now().UTC().Format(time.DateOnly), "UTC day, YYYY-MM-DD")
	by := fs.String("by", budget.ByModel, "group by model or principal")
	format := fs.String("format", "table", "table, csv, or json (with -site, -principal or -task)")
	site := fs.Bool("site", false, "the site's scope (tokens and money) from its counters")
	principal := fs.String("principal", "", "a principal's scope (v_<hmac> or k_<id>) from its counters")
	taskID := fs.String("task", "", "a task's scope from its counters (the day is the task's)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	scopes := 0
	for _, on := range []bool{*site, *principal != "", *taskID != ""} {
		if on {
			scopes++
		}
	}
	// Every bad flag is reported at once, before Redis is asked.
	var errs []error
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("usage: unexpected argument %q (flags: -day, -by, -format, -site, -principal, -task)", fs.Arg(0)))
	}
	if t, err := time.Parse(time.DateOnly, *day); err != nil || t.Format(time.DateOnly) != *day {
		errs = append(errs, fmt.Errorf("usage: -day %q: want a date as YYYY-MM-DD", *day))
	}
	if *by != budget.ByModel && *by != budget.ByPrincipal {
		errs = append(errs, fmt.Errorf("usage: -by %q: want model or principal", *by))
	}
	switch {
	case scopes > 1:
		errs = append(errs, errors.New("usage: -site, -principal and -task: want one of them"))
	case *format == "json" && scopes == 0:
		errs = append(errs, errors.New(`usage: -format "json": only with -site, -principal or -task`))
	case *format != "table" && *format != "csv" && *format != "json":
		errs = append(errs, fmt.Errorf("usage: -format %q: want table or csv", *format))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	raw := getenv("FAREGATE_REDIS_URL")
	if raw == "" {
		return errors.New("usage: FAREGATE_REDIS_URL is not set; the embedded Redis lives inside the serving process and cannot be read from here")
	}
	rdb, err := newRedis(raw, getenv("FAREGATE_REDIS_CLUSTER") == "true", redisOptions{})
	if err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	defer rdb.Close()
	if scopes == 1 {
		return usageScope(ctx, rdb, *day, *principal, *taskID, *format, stdout)
	}
	return usageDay(ctx, rdb, *day, *by, *format, stdout)
}

// usageDay prints day's ledger summed by model or principal.
func usageDay(ctx context.Context, rdb redis.UniversalClient, day, by, format string, stdout io.Writer) error {
	u, err := budget.NewLedger(rdb, nil).Usage(ctx, day, by)
	if err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	if format == "csv" {
		return budget.WriteCSV(stdout, day, by, u.Rows)
	}
	if u.Trimmed > 0 || u.Lost > 0 {
		note := fmt.Sprintf("%d entries trimmed; totals from the counters", u.Trimmed)
		if u.Lost > 0 {
			note += fmt.Sprintf(" (%d more dropped before any export read them)", u.Lost)
		}
		if by == budget.ByPrincipal {
			note += "; " + budget.RestKey + " is what they add beyond the entries still in the ledger"
		}
		fmt.Fprintln(stdout, note)
	}
	return budget.WriteTable(stdout, day, by, u.Rows)
}

// usageScope prints one scope from its counters: the site's of day, a
// principal's of day, or a task's (of the day it was admitted, read from
// its record).
func usageScope(ctx context.Context, rdb redis.UniversalClient, day, principal, taskID, format string, stdout io.Writer) error {
	q, scope, name := budget.UsageQuery{Day: day}, budget.ScopeSite, ""
	switch {
	case taskID != "":
		rec, err := taskstore.New(rdb).Get(ctx, taskID)
		if err != nil {
			return fmt.Errorf("usage: task %s: %w (task records are kept 7 days)", taskID, err)
		}
		q = budget.UsageQuery{Day: rec.Day, Principal: rec.Principal, Task: taskID}
		scope, name = budget.ScopeTask, taskID
	case principal != "":
		q.Principal, scope, name = principal, budget.ScopePrincipal, principal
	}
	rep, err := budget.New(rdb, budget.Options{}).Usage(ctx, q)
	if err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	v := budget.View(rep, scope, name, q.Day)
	switch format {
	case "json":
		return budget.WriteScopeJSON(stdout, v)
	case "csv":
		return budget.WriteScopeCSV(stdout, v)
	}
	return budget.WriteScopeTable(stdout, v)
}

// runAITF implements `faregate aitf score [FILE]`: the vector and score of
// each JSON (or NDJSON) body in FILE or standard input.
func runAITF(args []string, stdout io.Writer) error {
	if len(args) == 0 || args[0] != "score" || len(args) > 2 {
		return errors.New(`usage: faregate aitf score [FILE]   (reads standard input without FILE; a line is a JSON body, or {"visitor","at","body"} to replay a session)`)
	}
	in := io.Reader(os.Stdin)
	if len(args) == 2 && args[1] != "-" {
		f, err := os.Open(args[1])
		if err != nil {
			return fmt.Errorf("aitf score: %w", err)
		}
		defer f.Close()
		in = f
	}
	return aitf.ScoreCommand(in, stdout)
}
