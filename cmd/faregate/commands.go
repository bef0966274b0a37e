package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"faregate/protect/aitf"
	"faregate/protect/budget"
)

// runUsage implements `faregate usage [-day YYYY-MM-DD] [-by model|principal]
// [-format table|csv]`: one UTC day's model calls from the usage ledger in
// Redis, summed per model or per principal, with tokens, cost and overage.
func runUsage(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	fs := flag.NewFlagSet("usage", flag.ContinueOnError)
	fs.SetOutput(stdout)
	day := fs.String("day", time.Now().UTC().Format(time.DateOnly), "UTC day, YYYY-MM-DD")
	by := fs.String("by", budget.ByModel, "group by model or principal")
	format := fs.String("format", "table", "table or csv")
	if err := fs.Parse(args); err != nil {
		return err
	}
	// Every bad flag is reported at once, before Redis is asked.
	var errs []error
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("usage: unexpected argument %q (flags: -day, -by, -format)", fs.Arg(0)))
	}
	if t, err := time.Parse(time.DateOnly, *day); err != nil || t.Format(time.DateOnly) != *day {
		errs = append(errs, fmt.Errorf("usage: -day %q: want a date as YYYY-MM-DD", *day))
	}
	if *by != budget.ByModel && *by != budget.ByPrincipal {
		errs = append(errs, fmt.Errorf("usage: -by %q: want model or principal", *by))
	}
	if *format != "table" && *format != "csv" {
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
	totals, err := budget.NewLedger(rdb, nil).Totals(ctx, *day, *by)
	if err != nil {
		return fmt.Errorf("usage: %w", err)
	}
	if *format == "csv" {
		return budget.WriteCSV(stdout, *day, *by, totals)
	}
	return budget.WriteTable(stdout, *day, *by, totals)
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
