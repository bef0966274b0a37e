package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"time"

	"faregate/agent/alert"
	"faregate/protect/budget"
)

// followEvery is how often a following export looks for new entries.
const followEvery = time.Second

// runLedger implements `faregate ledger export [-group billing] [-day D]
// [-follow]`: the day's ledger entries that the export group has not
// acknowledged, as JSON Lines on stdout, each batch acknowledged once it
// is written; it exits when none is left, or with -follow keeps going,
// across midnight, until interrupted.
func runLedger(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	const help = "usage: faregate ledger export [-group billing] [-day YYYY-MM-DD] [-follow]"
	if len(args) == 0 || args[0] != "export" {
		return errors.New(help)
	}
	fs := flag.NewFlagSet("ledger export", flag.ContinueOnError)
	fs.SetOutput(stdout)
	group := fs.String("group", budget.DefaultExportGroup, "export group: readers of one group share its entries")
	day := fs.String("day", time.Now().UTC().Format(time.DateOnly), "UTC day to export (with -follow: the first)")
	follow := fs.Bool("follow", false, "keep exporting new entries, across midnight, until interrupted")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	var errs []error
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("ledger export: unexpected argument %q (%s)", fs.Arg(0), help))
	}
	if t, err := time.Parse(time.DateOnly, *day); err != nil || t.Format(time.DateOnly) != *day {
		errs = append(errs, fmt.Errorf("ledger export: -day %q: want a date as YYYY-MM-DD", *day))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	raw := getenv("FAREGATE_REDIS_URL")
	if raw == "" {
		return errors.New("ledger export: FAREGATE_REDIS_URL is not set; the embedded Redis lives inside the serving process and cannot be read from here")
	}
	rdb, err := newRedis(raw, getenv("FAREGATE_REDIS_CLUSTER") == "true", redisOptions{})
	if err != nil {
		return fmt.Errorf("ledger export: %w", err)
	}
	defer rdb.Close()
	// The stream's writers gave it its shape (FAREGATE_LEDGER_MAX_ENTRIES):
	// the export's acknowledgements keep it.
	x, err := budget.NewLedger(rdb, nil).Exporter(ctx, budget.ExportOptions{Group: *group})
	if err != nil {
		return fmt.Errorf("ledger export: %w", err)
	}
	write := jsonLines(stdout)
	if !*follow {
		_, err := x.Export(ctx, *day, write)
		return err
	}
	err = followLedger(ctx, x, *day, followEvery, time.Now, write, func(err error) bool { return true })
	if ctx.Err() != nil {
		return nil // interrupted: what was written is acknowledged
	}
	return err
}

// jsonLines writes each batch as JSON Lines to w and flushes it before
// returning, so a batch is acknowledged only once it has left the process.
func jsonLines(w io.Writer) func([]budget.Line) error {
	bw := bufio.NewWriterSize(w, 64<<10)
	enc := json.NewEncoder(bw)
	return func(lines []budget.Line) error {
		for _, l := range lines {
			if err := enc.Encode(l); err != nil {
				return err
			}
		}
		return bw.Flush()
	}
}

// followLedger exports day from and every day after it up to today, then
// every `every` the days whose entries can still come (today's, and
// yesterday's: a task admitted before midnight settles to its own day),
// until ctx ends. An export error goes to failed, which says whether to
// stop (the error is returned) or to try again at the next round.
func followLedger(ctx context.Context, x *budget.Exporter, from string, every time.Duration, now func() time.Time,
	write func([]budget.Line) error, failed func(error) bool) error {
	next, err := time.Parse(time.DateOnly, from)
	if err != nil {
		return fmt.Errorf("ledger export: -day %q: %w", from, err)
	}
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		today := now().UTC().Truncate(24 * time.Hour)
		var roundErr error
		for d := next; !d.After(today); d = d.AddDate(0, 0, 1) {
			if _, err := x.Export(ctx, d.Format(time.DateOnly), write); err != nil {
				roundErr = err
				break
			}
		}
		if roundErr != nil && ctx.Err() == nil && failed(roundErr) {
			return roundErr
		}
		if roundErr == nil {
			// Days before yesterday are done: nothing settles to them now.
			next = maxTime(next, today.AddDate(0, 0, -1))
		}
		t.Reset(every)
	}
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// billingBatch is the body of one POST to FAREGATE_BILLING_URL.
type billingBatch struct {
	Entries []budget.Line `json:"entries"`
}

// billingFeed exports the ledger to FAREGATE_BILLING_URL in the
// background. Every replica runs one in the same export group, so each
// entry is posted by one of them, and again only when a post failed or a
// replica died before its acknowledgement (at least once: the receiver
// drops repeats by ledger_id).
type billingFeed struct {
	ledger   *budget.Ledger
	poster   *alert.Poster
	consumer string
	every    time.Duration
	now      func() time.Time
	lg       *slog.Logger
}

// newBillingFeed is the feed of FAREGATE_BILLING_URL, nil when it is
// unset; consumer names this replica in the export group.
func newBillingFeed(cfg *config, lg *slog.Logger, l *budget.Ledger, consumer string) *billingFeed {
	if cfg.BillingURL == "" {
		return nil
	}
	return &billingFeed{ledger: l, consumer: "billing-" + consumer, every: followEvery, now: time.Now, lg: lg,
		poster: &alert.Poster{URL: cfg.BillingURL, Secret: cfg.BillingSecret, UserAgent: "faregate-billing", Timeout: 10 * time.Second}}
}

// billingRetry bounds the wait between rounds while posts fail.
const billingRetry = time.Minute

// Run follows the ledger from yesterday until ctx ends. A batch that could
// not be posted (after the poster's own retries) stays unacknowledged and
// is posted again at the next round, rounds spaced out up to
// billingRetry while the receiver keeps failing.
func (f *billingFeed) Run(ctx context.Context) {
	x, err := f.ledger.Exporter(ctx, budget.ExportOptions{Consumer: f.consumer})
	for wait := f.every; err != nil; wait = min(2*wait, billingRetry) {
		// Redis may be down at start: the export group is registered once
		// it answers.
		f.lg.Warn("billing export cannot start yet", "err", err.Error())
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		x, err = f.ledger.Exporter(ctx, budget.ExportOptions{Consumer: f.consumer})
	}
	failures := 0
	write := func(lines []budget.Line) error {
		body, err := json.Marshal(billingBatch{Entries: lines})
		if err == nil {
			_, err = f.poster.Post(ctx, body)
		}
		if err == nil {
			failures = 0
		}
		return err
	}
	// From yesterday: a replica started after midnight still finds what
	// settled to the day before.
	_ = followLedger(ctx, x, budget.Day(f.now().AddDate(0, 0, -1)), f.every, f.now, write, func(err error) bool {
		failures++
		f.lg.Warn("billing batch not delivered; it stays unacknowledged and is posted again", "failures", failures, "err", err.Error())
		// Wait out a failing receiver rather than ask it every second.
		pause := min(f.every<<min(failures, 6), billingRetry)
		select {
		case <-ctx.Done():
		case <-time.After(pause):
		}
		return false
	})
}

// ledgerAlerts raises ledger_backlog and ledger_lost from the ledger's
// events (budget.LedgerOptions.Watch): once per day for the backlog, and
// per deduplication window for losses, which faregate_ledger_lost_entries_total
// counts one by one.
func ledgerAlerts(notify func(alert.Alert)) func(budget.LedgerEvent) {
	return func(e budget.LedgerEvent) {
		scope := "ledger/" + e.Day
		details := map[string]any{"day": e.Day, "max_entries": e.MaxEntries}
		if e.Unexported >= 0 {
			details["unexported"] = e.Unexported
		}
		if e.Backlog {
			notify(alert.Alert{Event: alert.LedgerBacklog, Scope: scope, Severity: alert.Warning, Window: 24 * time.Hour,
				Text: fmt.Sprintf("The usage ledger of %s holds %d entries no export has read: 80%% of FAREGATE_LEDGER_MAX_ENTRIES (%d). Past it the oldest are dropped; check the billing export.",
					e.Day, e.Unexported, e.MaxEntries),
				Details: details})
		}
		if e.Lost > 0 {
			details["lost"] = e.Lost
			notify(alert.Alert{Event: alert.LedgerLost, Scope: scope, Severity: alert.Critical,
				Text: fmt.Sprintf("The usage ledger of %s dropped entries no export had read, past FAREGATE_LEDGER_MAX_ENTRIES (%d): faregate_ledger_lost_entries_total counts them, `faregate usage` still totals them.",
					e.Day, e.MaxEntries),
				Details: details})
		}
	}
}
